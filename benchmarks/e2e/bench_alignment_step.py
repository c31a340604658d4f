"""End to end: one DPO step and one GRPO step (generation + training) of a random-weight model.

    python benchmarks/e2e/bench_alignment_step.py --preset gpu   # ~1.2B Llama shape, bf16, one GPU
    python benchmarks/e2e/bench_alignment_step.py --preset cpu   # a small Llama shape, fp32
    python benchmarks/e2e/bench_alignment_step.py --preset quick # a tiny one, two steps

Each objective runs as ``fastalign train`` in a fresh process (its own peak memory) on a model saved
from a config (no download) and generated data: DPO on 8 pairs per step (frozen reference model),
GRPO on 8 prompts × 8 completions per step (no reference, beta 0). Providers: ``fastalign`` (the model
patched), ``fastalign-unpatched`` (``use_liger_kernel: false``), ``fastalign-checkpointing`` and
``fastalign-checkpointing-offloading`` (activations recomputed, and also offloaded to the host). Rows:
the median step time over the steps after the first, GRPO's split into generation and the rest
(rewards, log-probs, forward and backward, optimizer), tokens/s, MFU (where the GPU's peak is known) and
peak memory as the run logs them (CUDA: max allocated; CPU: peak RSS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign.bench import measure
from fastalign.builtin import tiny_tokenizer

PRESETS = {
    "gpu": {
        "config": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, num_hidden_layers=16),
        "prompt_words": 128, "answer_words": 384, "max_completion_length": 256, "steps": 4,
        "flags": ["--bf16", "true"],
        "providers": ["fastalign", "fastalign-unpatched", "fastalign-checkpointing",
                      "fastalign-checkpointing-offloading"],
    },
    "cpu": {
        "config": dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=32000, num_hidden_layers=2),
        "prompt_words": 16, "answer_words": 48, "max_completion_length": 32, "steps": 4, "flags": [],
        "providers": ["fastalign", "fastalign-unpatched"],
    },
    "quick": {
        "config": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2048, num_hidden_layers=2),
        "prompt_words": 8, "answer_words": 16, "max_completion_length": 8, "steps": 3, "flags": [],
        "providers": ["fastalign"],
    },
}  # fmt: skip
#: Provider → the ``fastalign train`` flags that make it.
PROVIDERS = {
    "fastalign": [],
    "fastalign-unpatched": ["--use_liger_kernel", "false"],
    "fastalign-checkpointing": ["--gradient_checkpointing", "true"],
    "fastalign-checkpointing-offloading": [
        "--gradient_checkpointing",
        "true",
        "--activation_offloading",
        "true",
    ],
}

_WORDS = "the model learns to answer questions about numbers and words quickly while training".split()


def _text(words: int, offset: int) -> str:
    return " ".join(_WORDS[(offset + i * 7) % len(_WORDS)] for i in range(words))


def _write_data(directory: Path, preset: dict) -> tuple[Path, Path]:
    prompts, answers = preset["prompt_words"], preset["answer_words"]
    pairs = [
        {"prompt": _text(prompts, i), "chosen": " " + _text(answers, i + 1),
         "rejected": " " + _text(answers, i + 2)}
        for i in range(64)
    ]  # fmt: skip
    prompt_rows = [{"prompt": _text(prompts, i)} for i in range(64)]
    for name, rows in (("pairs.jsonl", pairs), ("prompts.jsonl", prompt_rows)):
        (directory / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory / "pairs.jsonl", directory / "prompts.jsonl"


def _run(objective: str, flags: list[str], output_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "fastalign.cli.main", "train", objective,
               "--output_dir", str(output_dir), "--loss_curve_png", "false", "--logging_steps", "1",
               *flags]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _row(provider: str, objective: str, logs: list[dict], shape: str) -> dict:
    steady = logs[1:] or logs  # the first step compiles, allocates and warms the caches
    row = {
        "provider": provider, "objective": objective, "shape": shape,
        "step_ms": round(1e3 * statistics.median(r["step_seconds"] for r in steady), 1),
        "step_spread": round(measure.relative_spread([r["step_seconds"] for r in steady]), 3),
        "tokens_per_s": round(statistics.median(r["tokens_per_second"] for r in steady), 1),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in logs),
    }  # fmt: skip
    if "mfu" in steady[0]:
        row["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
    if "timing/generation_seconds" in steady[0]:
        generation = statistics.median(r["timing/generation_seconds"] for r in steady)
        row["generation_ms"] = round(1e3 * generation, 1)
        row["training_ms"] = round(row["step_ms"] - 1e3 * generation, 1)
        row["reward"] = steady[-1]["reward"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: the preset's)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    names = common.select_providers("e2e_alignment_step", PROVIDERS, args.providers, preset["providers"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp, common.keep_rows_on_termination(skipped):
        tmp = Path(tmp)
        config = LlamaConfig(**preset["config"], max_position_embeddings=4096)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
        tiny_tokenizer().save_pretrained(tmp / "model")
        pairs, prompts = _write_data(tmp, preset)
        common_flags = ["--model_name_or_path", str(tmp / "model"), "--max_steps", str(preset["steps"]),
                        "--max_length", "2048", "--max_prompt_length", "1024", *preset["flags"]]  # fmt: skip
        shape = (
            f"llama hidden={config.hidden_size} layers={config.num_hidden_layers} vocab={config.vocab_size}"
        )
        runs = {
            "dpo": [*common_flags, "--dataset_name", str(pairs), "--per_device_train_batch_size", "8"],
            "grpo": [*common_flags, "--dataset_name", str(prompts), "--per_device_train_batch_size", "64",
                     "--num_generations", "8", "--reward_funcs", "fastalign.builtin:digit_ratio",
                     "--max_completion_length", str(preset["max_completion_length"])],
        }  # fmt: skip
        for objective, flags in runs.items():
            for name in names:
                output_dir = tmp / f"{objective}-{name}"
                try:
                    row = _row(
                        name, objective, _run(objective, [*flags, *PROVIDERS[name]], output_dir), shape
                    )
                except RuntimeError as error:
                    skipped[f"{name} {objective}"] = str(error)
                    continue
                rows.append(row)
                print(json.dumps(row), flush=True)
    common.record(
        suite="e2e", kernel="e2e_alignment_step", preset=args.preset,
        floor="none stated: a whole training step (generation is memory-bound decoding)",
        ceiling={}, device=device, rows=rows, skipped=skipped, out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
