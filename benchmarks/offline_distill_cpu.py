"""Offline distillation on the real model, on the CPU (issue 38's goals): SmolLM2-135M-Instruct as the
teacher, a 2-layer student cut from it, the real-model SFT rows (tests/real).

1. a student step (forward + backward) on top-32 log-probs with the tail against an SFT step on the same
   rows (fused cross-entropy);
2. the teacher's scoring pass (top-32 through ``linear_topk_logprobs``) against its plain forward (logits);
3. the full forward KL(teacher ‖ student) after the same steps of top-32 + tail offline distillation and
   of full-logit distillation (``linear_divergence``, β 0), and its two parts (the chain rule of KL): the
   KL over the 33 buckets the offline loss sees (top-32 + tail) and the rest, the teacher's tail mass
   times the KL within the tail, which a top-32 + tail loss cannot see;
4. the peak memory of a student step and of an SFT step: each in its own process, the peak RSS of the
   step over the RSS before it (``/proc/self/clear_refs`` resets the peak; Linux).

Run: OMP_NUM_THREADS=1 FASTALIGN_CACHE_DIR=... PYTHONPATH=. python benchmarks/offline_distill_cpu.py
[--steps N] [--reps N]. Prints one JSON object.
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

K = 32


def batch_of(tokenizer):
    objective = DistillObjective.from_config(
        "distill", TrainConfig(teacher_model_name_or_path="t", lmbda=0.0, max_length=128), None
    )
    examples = objective.tokenize(real_sft_rows(), tokenizer)
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
    parser.add_argument("--memory", choices=("sft", "offline"), help="only the peak of one step (a child)")
    args = parser.parse_args()
    torch.manual_seed(0)
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    teacher = fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    teacher.requires_grad_(False)
    student0 = copy.deepcopy(teacher)
    student0.model.layers = student0.model.layers[:2]
    student0.config.num_hidden_layers = 2
    student0.requires_grad_(True).train()
    batch = batch_of(tokenizer)
    mask = batch["completion_mask"].bool()
    width = batch["input_ids"].shape[1] - mask.shape[1]
    tokens = batch["input_ids"][:, width:]
    labels = tokens.masked_fill(~mask, -100)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    count = mask.sum()

    if args.memory is None:
        memory = {}
        for name in ("sft", "offline"):
            child = [sys.executable, __file__, "--memory", name]
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
                head_fn=lambda h, w, b: linear_topk_logprobs(h[:, width - 1 : -1][mask], w, K, tokens[mask]),
            )

    if args.memory is None:
        plain(), scoring()
        plain_s, scoring_s = timed(plain), timed(scoring)
    with torch.no_grad():
        top = teacher(
            **inputs,
            head_fn=lambda h, w, b: linear_topk_logprobs(h[:, width - 1 : -1].reshape(-1, h.shape[-1]), w, K),
        ).head_output
        t_hidden, t_weight = teacher(**inputs, head_fn=lambda h, w, b: (h[:, width - 1 : -1], w)).head_output
    ids = top.ids.reshape(*mask.shape, K)
    lps = top.logprobs.reshape(*mask.shape, K)

    # 1. a student step against an SFT step
    def sft_loss(model):
        def head(h, w, b):
            return linear_cross_entropy(h[:, width - 1 : -1], w, labels, reduction="sum")

        return model(**inputs, head_fn=head).head_output / count

    def offline_loss(model):
        def head(h, w, b):
            return linear_sparse_divergence(h[:, width - 1 : -1], w, ids, lps, None, mask, beta=0.0)

        return model(**inputs, head_fn=head).head_output / count

    def full_loss(model):
        def head(h, w, b):
            return linear_divergence(
                h[:, width - 1 : -1], w, t_hidden, t_weight, labels, beta=0.0, reduction="sum"
            )

        return model(**inputs, head_fn=head).head_output / count

    student = copy.deepcopy(student0)
    if args.memory is not None:
        print(json.dumps(step_peak_mib(student, {"sft": sft_loss, "offline": offline_loss}[args.memory])))
        return

    def step(loss_fn):
        def run():
            student.zero_grad(set_to_none=True)
            loss_fn(student).backward()

        return run

    step(sft_loss)(), step(offline_loss)()
    sft_times, offline_times = [], []
    for _ in range(args.reps):  # interleaved: the busy CPU's drift hits both
        sft_times.append(timed(step(sft_loss), 1))
        offline_times.append(timed(step(offline_loss), 1))
    sft_s, offline_s = statistics.median(sft_times), statistics.median(offline_times)

    # 3. the full divergence after the same steps
    with torch.no_grad():
        t = teacher(**inputs).logits[:, width - 1 : -1].log_softmax(-1)[mask]
    t_top = t.gather(1, ids[mask])
    t_tail = torch.log1p(-t_top.exp().sum(-1).clamp(max=1 - 1e-7))

    def kl_parts(model) -> tuple[float, float]:
        """The mean over completion tokens of KL(teacher ‖ student) over the vocabulary, and of its part
        over the top-32 + tail buckets."""
        with torch.no_grad():
            s = model(**inputs).logits[:, width - 1 : -1].log_softmax(-1)[mask]
        s_top = s.gather(1, ids[mask])
        s_tail = torch.log1p(-s_top.exp().sum(-1).clamp(max=1 - 1e-7))
        buckets = (t_top.exp() * (t_top - s_top)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
        return float((t.exp() * (t - s)).sum(-1).mean()), float(buckets.mean())

    def full_kl(model) -> float:
        return kl_parts(model)[0]

    results = {"initial_full_kl": full_kl(student0)}
    checkpoints = {int(step) for step in args.kl_at.split(",") if step}
    by_steps: dict[int, dict[str, tuple[float, float]]] = {}
    for name, loss_fn in (("offline_top32_tail", offline_loss), ("full_logit", full_loss)):
        model = copy.deepcopy(student0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
        for done in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            optimizer.step()
            if done in checkpoints and done != args.steps:
                by_steps.setdefault(done, {})[name] = kl_parts(model)
        results[f"{name}_full_kl"], results[f"{name}_bucket_kl"] = kl_parts(model)
        by_steps.setdefault(args.steps, {})[name] = (results[f"{name}_full_kl"], results[f"{name}_bucket_kl"])
    results |= {
        "teacher_tail_mass": float(t_tail.exp().mean()),
        "rows": int(mask.shape[0]),
        "completion_tokens": int(count),
        "sequence_width": int(batch["input_ids"].shape[1]),
        "steps": args.steps,
        "sft_step_s": sft_s,
        "offline_step_s": offline_s,
        "offline_over_sft": offline_s / sft_s,
        "sft_step_peak_rss_mib": memory["sft"],
        "offline_step_peak_rss_mib": memory["offline"],
        "plain_forward_s": plain_s,
        "scoring_pass_s": scoring_s,
        "scoring_speed_over_plain": plain_s / scoring_s,
        "offline_kl_over_full_logit_kl": results["offline_top32_tail_full_kl"]
        / results["full_logit_full_kl"],
        # per step count: [full KL, KL over the 33 buckets] of each run (the rest is within the tail)
        "kl_full_and_buckets_by_steps": {str(step): by_steps[step] for step in sorted(by_steps)},
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
