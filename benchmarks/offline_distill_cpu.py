"""Offline distillation on the real model, on the CPU (issue 38's goals): SmolLM2-135M-Instruct as the
teacher, a 2-layer student cut from it, one batch of 16 rows (``--data``).

1. a student step (forward + backward) on top-k log-probs with the tail against an SFT step on the same
   rows (fused cross-entropy), k the first of ``--top-k``;
2. the teacher's scoring pass (that top-k through ``linear_topk_logprobs``) against its plain forward
   (logits);
3. the full forward KL(teacher ‖ student) after the same steps of top-k + tail offline distillation, for
   each k of ``--top-k``, and of one full-logit distillation run (``linear_divergence``, β 0), and its two
   parts (the chain rule of KL): the KL over the k + 1 buckets the offline loss sees (top-k + tail) and the
   rest, the teacher's tail mass times the KL within the tail, which a top-k + tail loss cannot see (the
   full-logit run's KL is split over each k's buckets too);
4. the peak memory of a student step and of an SFT step: each in its own process, the peak RSS of the
   step over the RSS before it (``/proc/self/clear_refs`` resets the peak; Linux).

``--kl-only`` runs 3 alone (no timing, no memory children).

``--data``: ``sft`` (the default) is the real-model SFT rows of ``tests/real`` ("What is the capital of
France?" → "The capital of France is Paris.", max_length 128). ``teacher-samples`` keeps those 16 prompts
and replaces each completion by one the teacher samples itself: the prompts through the chat template
(generation prompt on), left-padded into one batch, ``teacher.generate`` with ``do_sample``, temperature 1,
``top_k`` 0 and ``top_p`` 1 (the teacher's whole distribution), at most ``SAMPLE_TOKENS`` (64) new tokens,
after ``torch.manual_seed(SAMPLE_SEED)`` (0); the sampled tokens up to the first EOS are decoded to text
(special tokens skipped) and become the rows' assistant messages, tokenized as any row (max_length 256,
so none is cut). A completion cut at 64 tokens gets the template's end-of-turn token all the same, and
the decode-and-retokenize round trip may split a few tokens differently from the sampled ones: the text,
as a distillation data set stores it, is what is scored. Deterministic on one machine and one torch build.

Run: OMP_NUM_THREADS=1 FASTALIGN_CACHE_DIR=... PYTHONPATH=. python benchmarks/offline_distill_cpu.py
[--steps N] [--reps N] [--kl-at 10,20] [--top-k 32,64] [--data sft|teacher-samples] [--kl-only].
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fastalign
from fastalign.ops import linear_cross_entropy, linear_divergence
from fastalign.ops.sparse_divergence import linear_sparse_divergence, linear_topk_logprobs
from fastalign.train.config import TrainConfig
from fastalign.train.objectives.distill import DistillObjective
from tests.real.data import real_sft_rows
from tests.real.model import smollm2_dir

#: ``--data teacher-samples``: the most new tokens per completion, and the seed set before sampling
SAMPLE_TOKENS = 64
SAMPLE_SEED = 0


def teacher_sample_rows(teacher, tokenizer) -> list[dict]:
    """The SFT rows' prompts, each with one completion sampled from the teacher (see the docstring)."""
    rows = real_sft_rows()
    texts = [
        tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for row in rows
    ]
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = padding_side
    torch.manual_seed(SAMPLE_SEED)
    with torch.no_grad():
        out = teacher.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=SAMPLE_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
        )
    samples = []
    for sampled in out[:, encoded["input_ids"].shape[1] :].tolist():
        if tokenizer.eos_token_id in sampled:
            sampled = sampled[: sampled.index(tokenizer.eos_token_id)]
        samples.append(tokenizer.decode(sampled, skip_special_tokens=True))
    return [
        {"prompt": row["prompt"], "completion": [{"role": "assistant", "content": text}]}
        for row, text in zip(rows, samples, strict=True)
    ]


def batch_of(tokenizer, data: str, teacher):
    rows, max_length = (
        (real_sft_rows(), 128) if data == "sft" else (teacher_sample_rows(teacher, tokenizer), 256)
    )
    objective = DistillObjective.from_config(
        "distill", TrainConfig(teacher_model_name_or_path="t", lmbda=0.0, max_length=max_length), None
    )
    examples = objective.tokenize(rows, tokenizer)
    return objective.collate(tokenizer)(examples)


def timed(fn, reps=5):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024


def step_peak_mib(model, loss_fn, reps: int = 3) -> float:
    """The median over ``reps`` steps of a step's peak RSS over the RSS before it (MiB)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()  # warm-up
    peaks = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _status_mib("VmRSS")
        loss_fn(model).backward()
        peaks.append(_status_mib("VmHWM") - before)
    return statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--kl-at", default="", help="also the KL parts after these steps (e.g. 10,20,40)")
    parser.add_argument("--top-k", default="32", help="the offline runs' k, a comma list (e.g. 32,64,128)")
    parser.add_argument("--data", choices=("sft", "teacher-samples"), default="sft")
    parser.add_argument(
        "--kl-only", action="store_true", help="only the KL after training (no timing, memory)"
    )
    parser.add_argument("--memory", choices=("sft", "offline"), help="only the peak of one step (a child)")
    args = parser.parse_args()
    ks = [int(k) for k in args.top_k.split(",") if k]
    if not ks or len(set(ks)) != len(ks):
        parser.error(f"--top-k must be distinct integers, got {args.top_k!r}")
    timing_k = ks[0]  # the timing's and memory's k
    torch.manual_seed(0)
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    teacher = fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    teacher.requires_grad_(False)
    student0 = copy.deepcopy(teacher)
    student0.model.layers = student0.model.layers[:2]
    student0.config.num_hidden_layers = 2
    student0.requires_grad_(True).train()
    batch = batch_of(tokenizer, args.data, teacher)
    torch.manual_seed(0)
    mask = batch["completion_mask"].bool()
    width = batch["input_ids"].shape[1] - mask.shape[1]
    tokens = batch["input_ids"][:, width:]
    labels = tokens.masked_fill(~mask, -100)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    count = mask.sum()
    timing = args.memory is None and not args.kl_only

    if timing:
        memory = {}
        for name in ("sft", "offline"):
            child = [
                sys.executable,
                __file__,
                "--memory",
                name,
                "--top-k",
                str(timing_k),
                "--data",
                args.data,
            ]
            memory[name] = json.loads(
                subprocess.run(child, check=True, capture_output=True, text=True).stdout
            )

    # 2. the scoring pass against the plain forward
    def plain():
        with torch.no_grad():
            teacher(**inputs).logits.sum()

    def scoring():
        with torch.no_grad():
            teacher(
                **inputs,
                head_fn=lambda h, w, b: linear_topk_logprobs(
                    h[:, width - 1 : -1][mask], w, timing_k, tokens[mask]
                ),
            )

    if timing:
        plain(), scoring()
        plain_s, scoring_s = timed(plain), timed(scoring)

    def teacher_topk(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ids and log-probs at every completion position, [B, T, k] each."""
        with torch.no_grad():
            top = teacher(
                **inputs,
                head_fn=lambda h, w, b: linear_topk_logprobs(
                    h[:, width - 1 : -1].reshape(-1, h.shape[-1]), w, k
                ),
            ).head_output
        return top.ids.reshape(*mask.shape, k), top.logprobs.reshape(*mask.shape, k)

    tops = {k: teacher_topk(k) for k in ks}
    with torch.no_grad():
        t_hidden, t_weight = teacher(**inputs, head_fn=lambda h, w, b: (h[:, width - 1 : -1], w)).head_output

    # 1. a student step against an SFT step
    def sft_loss(model):
        def head(h, w, b):
            return linear_cross_entropy(h[:, width - 1 : -1], w, labels, reduction="sum")

        return model(**inputs, head_fn=head).head_output / count

    def offline_loss_at(k: int):
        ids, lps = tops[k]

        def offline_loss(model):
            def head(h, w, b):
                return linear_sparse_divergence(h[:, width - 1 : -1], w, ids, lps, None, mask, beta=0.0)

            return model(**inputs, head_fn=head).head_output / count

        return offline_loss

    def full_loss(model):
        def head(h, w, b):
            return linear_divergence(
                h[:, width - 1 : -1], w, t_hidden, t_weight, labels, beta=0.0, reduction="sum"
            )

        return model(**inputs, head_fn=head).head_output / count

    student = copy.deepcopy(student0)
    if args.memory is not None:
        print(
            json.dumps(
                step_peak_mib(student, {"sft": sft_loss, "offline": offline_loss_at(timing_k)}[args.memory])
            )
        )
        return

    def step(loss_fn):
        def run():
            student.zero_grad(set_to_none=True)
            loss_fn(student).backward()

        return run

    if timing:
        step(sft_loss)(), step(offline_loss_at(timing_k))()
        sft_times, offline_times = [], []
        for _ in range(args.reps):  # interleaved: the busy CPU's drift hits both
            sft_times.append(timed(step(sft_loss), 1))
            offline_times.append(timed(step(offline_loss_at(timing_k)), 1))
        sft_s, offline_s = statistics.median(sft_times), statistics.median(offline_times)

    # 3. the full divergence after the same steps
    with torch.no_grad():
        t = teacher(**inputs).logits[:, width - 1 : -1].log_softmax(-1)[mask]

    def tail_of(top: torch.Tensor) -> torch.Tensor:
        return torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))

    support = {k: tops[k][0][mask] for k in ks}
    t_tops = {k: t.gather(1, support[k]) for k in ks}
    t_tails = {k: tail_of(t_tops[k]) for k in ks}

    def kl_parts(model) -> dict[str, float]:
        """The mean over completion tokens of KL(teacher ‖ student) over the vocabulary ("full"), and for
        each k of its part over the top-k + tail buckets (str(k))."""
        with torch.no_grad():
            s = model(**inputs).logits[:, width - 1 : -1].log_softmax(-1)[mask]
        parts = {"full": float((t.exp() * (t - s)).sum(-1).mean())}
        for k in ks:
            t_top, t_tail = t_tops[k], t_tails[k]
            s_top = s.gather(1, support[k])
            s_tail = tail_of(s_top)
            buckets = (t_top.exp() * (t_top - s_top)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
            parts[str(k)] = float(buckets.mean())
        return parts

    initial = kl_parts(student0)
    checkpoints = {int(step) for step in args.kl_at.split(",") if step} | {args.steps}
    # by_steps[step][run] = kl_parts after that many steps of that run
    by_steps: dict[int, dict[str, dict[str, float]]] = {}
    runs = [("full_logit", full_loss)] + [(f"offline_top{k}_tail", offline_loss_at(k)) for k in ks]
    for name, loss_fn in runs:
        model = copy.deepcopy(student0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
        for done in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            optimizer.step()
            if done in checkpoints:
                by_steps.setdefault(done, {})[name] = kl_parts(model)

    def summary(parts_by_run: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """Per k: each run's full KL, bucket KL and within-tail part, and the ratio to the full-logit."""
        full = parts_by_run["full_logit"]
        out = {}
        for k in ks:
            own = parts_by_run[f"offline_top{k}_tail"]
            out[str(k)] = {
                "full_kl": own["full"],
                "bucket_kl": own[str(k)],
                "within_tail_kl": own["full"] - own[str(k)],
                "ratio_to_full_logit": own["full"] / full["full"],
                "full_logit_bucket_kl": full[str(k)],
                "full_logit_within_tail_kl": full["full"] - full[str(k)],
            }
        return out

    final = by_steps[args.steps]
    results = {
        "data": args.data,
        "top_k": ks,
        "initial_full_kl": initial["full"],
        "full_logit_full_kl": final["full_logit"]["full"],
    }
    for k in ks:
        own = final[f"offline_top{k}_tail"]
        results |= {
            f"offline_top{k}_tail_full_kl": own["full"],
            f"offline_top{k}_tail_bucket_kl": own[str(k)],
            f"offline_top{k}_tail_within_tail_kl": own["full"] - own[str(k)],
            f"offline_top{k}_tail_kl_over_full_logit_kl": own["full"] / final["full_logit"]["full"],
            f"teacher_tail_mass_top{k}": float(t_tails[k].exp().mean()),
        }
    if 32 in ks:  # the keys of the single-k (top-32) version of this script
        results |= {
            "full_logit_bucket_kl": final["full_logit"]["32"],
            "teacher_tail_mass": results["teacher_tail_mass_top32"],
            "offline_kl_over_full_logit_kl": results["offline_top32_tail_kl_over_full_logit_kl"],
        }
    results |= {
        "rows": int(mask.shape[0]),
        "completion_tokens": int(count),
        "sequence_width": int(batch["input_ids"].shape[1]),
        "steps": args.steps,
    }
    if timing:
        results |= {
            "timing_top_k": timing_k,
            "sft_step_s": sft_s,
            "offline_step_s": offline_s,
            "offline_over_sft": offline_s / sft_s,
            "sft_step_peak_rss_mib": memory["sft"],
            "offline_step_peak_rss_mib": memory["offline"],
            "plain_forward_s": plain_s,
            "scoring_pass_s": scoring_s,
            "scoring_speed_over_plain": plain_s / scoring_s,
        }
    # per step count, per k: the top-k + tail run's full KL, its bucket KL (top-k + tail) and within-tail
    # part, its ratio to the full-logit run's full KL, and the full-logit run's KL split over the same buckets
    results["by_steps"] = {
        str(step): {
            "full_logit_full_kl": by_steps[step]["full_logit"]["full"],
            "by_k": summary(by_steps[step]),
        }
        for step in sorted(by_steps)
    }
    if 32 in ks:  # the single-k version's layout: per step count, [full KL, KL over the 33 buckets] per run
        results["kl_full_and_buckets_by_steps"] = {
            str(step): {
                name: [by_steps[step][name]["full"], by_steps[step][name]["32"]]
                for name in ("offline_top32_tail", "full_logit")
            }
            for step in sorted(by_steps)
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
