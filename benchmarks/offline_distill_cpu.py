"""Offline distillation on the real model, on the CPU (issue 38's goals): SmolLM2-135M-Instruct as the
teacher, a 2-layer student cut from it, batches of 16 rows (``--data``).

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

``--kl-only`` runs 3 alone (no timing, no memory children). ``--tail-samples 8,32`` adds, for each M, a
run on the first k's top-k and M draws from the teacher's tail per token (``teacher-logprobs
--tail_samples``; the support ``train distill`` builds from them, ``tail_sample_support``).

``--data``: ``sft`` (the default) is the real-model SFT rows of ``tests/real`` ("What is the capital of
France?" → "The capital of France is Paris.", max_length 128). ``teacher-samples`` keeps those 16 prompts
and replaces each completion by one the teacher samples itself: the prompts through the chat template
(generation prompt on), left-padded into one batch, ``teacher.generate`` with ``do_sample``, temperature 1,
``top_k`` 0 and ``top_p`` 1 (the teacher's whole distribution), at most ``SAMPLE_TOKENS`` (64) new tokens,
after ``torch.manual_seed(SAMPLE_SEED)`` (0); the sampled tokens up to the first EOS are decoded to text
(special tokens skipped) and become the rows' assistant messages, tokenized as any row (max_length 256,
so none is cut). A completion cut at 64 tokens gets the template's end-of-turn token all the same, and
the decode-and-retokenize round trip may split a few tokens differently from the sampled ones: the text,
as a distillation data set stores it, is what is scored. ``docs`` (``docs_rows``): 256 training and 64
held-out rows of human-written text, the standard library's docstrings, trained on in batches of 16
(step n on batch n mod 16) while the KL is measured on the held-out rows: the realistic case, where
``sft`` and ``teacher-samples`` train and measure on one batch. Deterministic on one machine, one torch
build and one Python (its standard library is the data).

Run: OMP_NUM_THREADS=1 FASTALIGN_CACHE_DIR=... PYTHONPATH=. python benchmarks/offline_distill_cpu.py
[--steps N] [--reps N] [--kl-at 10,20] [--top-k 32,64] [--tail-samples 8] [--data sft|teacher-samples|docs]
[--kl-only].
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import importlib.util
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fastalign
from fastalign.ops import linear_cross_entropy, linear_divergence
from fastalign.ops.sparse_divergence import (
    linear_sparse_divergence,
    linear_topk_logprobs,
    tail_sample_support,
)
from fastalign.train.config import TrainConfig
from fastalign.train.objectives.distill import DistillObjective
from tests.real.data import real_sft_rows
from tests.real.model import cut_layers, smollm2_dir

#: ``--data teacher-samples``: the most new tokens per completion, and the seed set before sampling
SAMPLE_TOKENS = 64
SAMPLE_SEED = 0
#: rows per batch (``sft`` and ``teacher-samples`` are one batch of 16)
BATCH_ROWS = 16
#: ``--data docs``: training rows, held-out rows, and the characters of a docstring a completion keeps
DOCS_TRAIN = 256
DOCS_EVAL = 64
DOCS_CHARS = 240


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


def _docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the standard library's modules and their public top-level classes
    and functions, read with ``ast`` from the source (nothing is imported), sorted by name."""
    found = []
    for module in sorted(sys.stdlib_module_names):
        if module.startswith("_") or module in ("this", "antigravity"):
            continue
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        found.append((module, ast.get_docstring(tree)))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                found.append((f"{module}.{node.name}", ast.get_docstring(node)))
    return [(name, doc) for name, doc in found if doc]


def docs_rows() -> tuple[list[dict], list[dict]]:
    """``--data docs``: ``DOCS_TRAIN`` training rows and ``DOCS_EVAL`` held-out rows of human-written
    text: "What does the Python name X do?" answered by the first ``DOCS_CHARS`` characters (cut at a
    word) of X's docstring, for the standard library's modules, classes and functions whose docstring is
    at least that long and whose text no other row has; shuffled with seed 0, then split."""
    rows, seen = [], set()
    for name, doc in _docstrings():
        text = " ".join(doc.split())
        if len(text) < DOCS_CHARS:
            continue
        text = text[: text.rfind(" ", 0, DOCS_CHARS)]
        if text in seen:
            continue
        seen.add(text)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What does the Python name {name} do?"}],
                "completion": [{"role": "assistant", "content": text}],
            }
        )
    random.Random(0).shuffle(rows)
    if len(rows) < DOCS_TRAIN + DOCS_EVAL:
        raise SystemExit(f"--data docs: {len(rows)} docstrings, {DOCS_TRAIN + DOCS_EVAL} needed")
    return rows[:DOCS_TRAIN], rows[DOCS_TRAIN : DOCS_TRAIN + DOCS_EVAL]


def batches_of(tokenizer, rows: list[dict], max_length: int) -> list[dict]:
    """The rows tokenized as ``train distill`` does and collated ``BATCH_ROWS`` at a time."""
    objective = DistillObjective.from_config(
        "distill", TrainConfig(teacher_model_name_or_path="t", lmbda=0.0, max_length=max_length), None
    )
    examples = objective.tokenize(rows, tokenizer)
    collate = objective.collate(tokenizer)
    return [collate(examples[at : at + BATCH_ROWS]) for at in range(0, len(examples), BATCH_ROWS)]


def data_of(tokenizer, data: str, teacher) -> tuple[list[dict], list[dict]]:
    """The training batches and the batches the KL is measured on: for ``sft`` and ``teacher-samples``
    one batch, both; for ``docs`` the training rows' batches and the held-out rows'."""
    if data == "docs":
        train, held_out = docs_rows()
        return batches_of(tokenizer, train, 256), batches_of(tokenizer, held_out, 256)
    rows, max_length = (
        (real_sft_rows(), 128) if data == "sft" else (teacher_sample_rows(teacher, tokenizer), 256)
    )
    batches = batches_of(tokenizer, rows, max_length)
    return batches, batches


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


class Batch:
    """One collated batch and what the runs need of the teacher on it: the completion positions
    (``mask``, ``width``: where the completions start), the labels, and per k the teacher's top-k ids
    and log-probs at every completion position ([B, T, k] each); with ``hidden``, the teacher's last
    hidden states there (the full-logit run's); with ``full``, the teacher's log-softmax over the
    vocabulary at the completion tokens (the KL's), and per k its top-k and tail there."""

    def __init__(
        self, batch: dict, teacher, ks: list[int], *, hidden: bool, full: bool, samples: list[int] = ()
    ):
        self.mask = batch["completion_mask"].bool()
        self.width = batch["input_ids"].shape[1] - self.mask.shape[1]
        self.tokens = batch["input_ids"][:, self.width :]
        self.labels = self.tokens.masked_fill(~self.mask, -100)
        self.inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        self.count = self.mask.sum()
        self.tops = {k: self.teacher_topk(teacher, k) for k in ks}
        self.sampled = {m: self.sampled_tail(teacher, ks[0], m) for m in samples}
        if hidden:
            with torch.no_grad():
                self.t_hidden, self.t_weight = teacher(
                    **self.inputs, head_fn=self.completion_head
                ).head_output
        if full:
            with torch.no_grad():
                self.t = teacher(**self.inputs).logits[:, self.width - 1 : -1].log_softmax(-1)[self.mask]
            self.support = {k: self.tops[k][0][self.mask] for k in ks}
            self.t_tops = {k: self.t.gather(1, self.support[k]) for k in ks}
            self.t_tails = {k: tail_of(self.t_tops[k]) for k in ks}

    def completion_head(self, h, w, b):
        return h[:, self.width - 1 : -1], w

    def teacher_topk(self, teacher, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            top = teacher(
                **self.inputs,
                head_fn=lambda h, w, b: linear_topk_logprobs(
                    h[:, self.width - 1 : -1].reshape(-1, h.shape[-1]), w, k
                ),
            ).head_output
        return top.ids.reshape(*self.mask.shape, k), top.logprobs.reshape(*self.mask.shape, k)

    def sampled_tail(self, teacher, k: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The support ``train distill`` builds from files scored with ``--tail_samples m``: the teacher's
        top-k and m draws from the rest of its distribution at every completion position
        (``linear_topk_logprobs``, uniforms from a generator seeded ``SAMPLE_SEED``), through
        ``tail_sample_support``: ids, log-probs and support mask [B, T, k + m]."""
        generator = torch.Generator().manual_seed(SAMPLE_SEED)
        uniforms = torch.rand(self.mask.numel(), m, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            top = teacher(
                **self.inputs,
                head_fn=lambda h, w, b: linear_topk_logprobs(
                    h[:, self.width - 1 : -1].reshape(-1, h.shape[-1]),
                    w,
                    k,
                    tail_samples=m,
                    uniforms=uniforms,
                ),
            ).head_output
        ids, lps, support = tail_sample_support(top.ids, top.logprobs, top.tail, top.sample_ids)
        shape = (*self.mask.shape, k + m)
        return ids.reshape(shape), lps.reshape(shape), support.reshape(shape)

    def sampled_loss(self, model, m: int):
        ids, lps, support = self.sampled[m]

        def head(h, w, b):
            return linear_sparse_divergence(
                h[:, self.width - 1 : -1], w, ids, lps, support, self.mask, beta=0.0
            )

        return model(**self.inputs, head_fn=head).head_output / self.count

    def sft_loss(self, model):
        def head(h, w, b):
            return linear_cross_entropy(h[:, self.width - 1 : -1], w, self.labels, reduction="sum")

        return model(**self.inputs, head_fn=head).head_output / self.count

    def offline_loss(self, model, k: int):
        ids, lps = self.tops[k]

        def head(h, w, b):
            return linear_sparse_divergence(h[:, self.width - 1 : -1], w, ids, lps, None, self.mask, beta=0.0)

        return model(**self.inputs, head_fn=head).head_output / self.count

    def full_loss(self, model):
        def head(h, w, b):
            return linear_divergence(
                h[:, self.width - 1 : -1],
                w,
                self.t_hidden,
                self.t_weight,
                self.labels,
                beta=0.0,
                reduction="sum",
            )

        return model(**self.inputs, head_fn=head).head_output / self.count

    def kl_sums(self, model, ks: list[int]) -> dict[str, float]:
        """Sums over the completion tokens of KL(teacher ‖ student) over the vocabulary ("full"), and for
        each k of its part over the top-k + tail buckets (str(k)); and the token count ("tokens")."""
        with torch.no_grad():
            s = model(**self.inputs).logits[:, self.width - 1 : -1].log_softmax(-1)[self.mask]
        sums = {"full": float((self.t.exp() * (self.t - s)).sum()), "tokens": float(self.count)}
        for k in ks:
            t_top, t_tail = self.t_tops[k], self.t_tails[k]
            s_top = s.gather(1, self.support[k])
            s_tail = tail_of(s_top)
            buckets = (t_top.exp() * (t_top - s_top)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
            sums[str(k)] = float(buckets.sum())
        return sums


def tail_of(top: torch.Tensor) -> torch.Tensor:
    return torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-7))


def kl_parts(model, batches: list[Batch], ks: list[int]) -> dict[str, float]:
    """The mean over the batches' completion tokens of ``Batch.kl_sums``."""
    totals: dict[str, float] = {}
    for batch in batches:
        for key, value in batch.kl_sums(model, ks).items():
            totals[key] = totals.get(key, 0.0) + value
    tokens = totals.pop("tokens")
    return {key: value / tokens for key, value in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--kl-at", default="", help="also the KL parts after these steps (e.g. 10,20,40)")
    parser.add_argument("--top-k", default="32", help="the offline runs' k, a comma list (e.g. 32,64,128)")
    parser.add_argument("--data", choices=("sft", "teacher-samples", "docs"), default="sft")
    parser.add_argument(
        "--kl-only", action="store_true", help="only the KL after training (no timing, memory)"
    )
    parser.add_argument(
        "--tail-samples",
        default="",
        help="also runs on the first k's top-k and this many draws from the teacher's tail (a comma list)",
    )
    parser.add_argument("--memory", choices=("sft", "offline"), help="only the peak of one step (a child)")
    args = parser.parse_args()
    ks = [int(k) for k in args.top_k.split(",") if k]
    if not ks or len(set(ks)) != len(ks):
        parser.error(f"--top-k must be distinct integers, got {args.top_k!r}")
    samples = [int(m) for m in args.tail_samples.split(",") if m]
    timing_k = ks[0]  # the timing's and memory's k
    torch.manual_seed(0)
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    teacher = fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    teacher.requires_grad_(False)
    student0 = cut_layers(copy.deepcopy(teacher))
    student0.requires_grad_(True).train()
    train_data, eval_data = data_of(tokenizer, args.data, teacher)
    held_out = eval_data is not train_data
    timing = args.memory is None and not args.kl_only
    measure = args.memory is None
    train = [
        Batch(data, teacher, ks, hidden=measure, full=measure and not held_out, samples=samples)
        for data in train_data
    ]
    evals = [Batch(data, teacher, ks, hidden=False, full=True) for data in eval_data] if held_out else train
    first = train[0]  # the timing's and memory's batch
    torch.manual_seed(0)

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
            teacher(**first.inputs).logits.sum()

    def scoring():
        with torch.no_grad():
            teacher(
                **first.inputs,
                head_fn=lambda h, w, b: linear_topk_logprobs(
                    h[:, first.width - 1 : -1][first.mask], w, timing_k, first.tokens[first.mask]
                ),
            )

    if timing:
        plain(), scoring()
        plain_s, scoring_s = timed(plain), timed(scoring)

    # 1. a student step against an SFT step
    student = copy.deepcopy(student0)
    if args.memory is not None:
        loss_fn = (
            first.sft_loss if args.memory == "sft" else functools.partial(first.offline_loss, k=timing_k)
        )
        print(json.dumps(step_peak_mib(student, loss_fn)))
        return

    def step(loss_fn):
        def run():
            student.zero_grad(set_to_none=True)
            loss_fn(student).backward()

        return run

    offline_first = functools.partial(first.offline_loss, k=timing_k)
    if timing:
        step(first.sft_loss)(), step(offline_first)()
        sft_times, offline_times = [], []
        for _ in range(args.reps):  # interleaved: the busy CPU's drift hits both
            sft_times.append(timed(step(first.sft_loss), 1))
            offline_times.append(timed(step(offline_first), 1))
        sft_s, offline_s = statistics.median(sft_times), statistics.median(offline_times)

    # 3. the full divergence after the same steps (step n trains on batch n mod the batches)
    initial = kl_parts(student0, evals, ks)
    checkpoints = {int(step) for step in args.kl_at.split(",") if step} | {args.steps}
    # by_steps[step][run] = kl_parts after that many steps of that run
    by_steps: dict[int, dict[str, dict[str, float]]] = {}
    runs = [("full_logit", lambda batch: batch.full_loss)] + [
        (f"offline_top{k}_tail", lambda batch, k=k: functools.partial(batch.offline_loss, k=k)) for k in ks
    ]
    runs += [
        (f"offline_top{ks[0]}_samples{m}", lambda batch, m=m: functools.partial(batch.sampled_loss, m=m))
        for m in samples
    ]
    for name, loss_of in runs:
        model = copy.deepcopy(student0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
        for done in range(1, args.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss_of(train[(done - 1) % len(train)])(model).backward()
            optimizer.step()
            if done in checkpoints:
                by_steps.setdefault(done, {})[name] = kl_parts(model, evals, ks)

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

    def teacher_tail_mass(k: int) -> float:
        tails = torch.cat([batch.t_tails[k] for batch in evals])
        return float(tails.exp().mean())

    final = by_steps[args.steps]
    results = {
        "data": args.data,
        "kl_on": "held-out rows" if held_out else "the training rows",
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
            f"teacher_tail_mass_top{k}": teacher_tail_mass(k),
        }
    if 32 in ks:  # the keys of the single-k (top-32) version of this script
        results |= {
            "full_logit_bucket_kl": final["full_logit"]["32"],
            "teacher_tail_mass": results["teacher_tail_mass_top32"],
            "offline_kl_over_full_logit_kl": results["offline_top32_tail_kl_over_full_logit_kl"],
        }
    results |= {
        "rows": sum(int(batch.mask.shape[0]) for batch in train),
        "completion_tokens": sum(int(batch.count) for batch in train),
        "sequence_width": int(first.inputs["input_ids"].shape[1]),
        "steps": args.steps,
        "python": sys.version.split()[0],
    }
    if held_out:
        results |= {
            "held_out_rows": sum(int(batch.mask.shape[0]) for batch in evals),
            "held_out_completion_tokens": sum(int(batch.count) for batch in evals),
            "batch_rows": BATCH_ROWS,
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
    for m in samples:  # per step count: the run's full KL and its ratio to the full-logit run's
        name = f"offline_top{ks[0]}_samples{m}"
        for step in sorted(by_steps):
            own, full = by_steps[step][name]["full"], by_steps[step]["full_logit"]["full"]
            results["by_steps"][str(step)][name] = {"full_kl": own, "ratio_to_full_logit": own / full}
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
