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

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e import train_runs

#: The model of each preset: ``train_runs.MODELS``.
PRESETS = {
    "gpu": {
        "prompt_words": 128, "answer_words": 384, "max_completion_length": 256, "steps": 4,
        "flags": ["--bf16", "true"],
        "providers": ["fastalign", "fastalign-unpatched", "fastalign-checkpointing",
                      "fastalign-checkpointing-offloading"],
    },
    "cpu": {
        "prompt_words": 16, "answer_words": 48, "max_completion_length": 32, "steps": 4, "flags": [],
        "providers": ["fastalign", "fastalign-unpatched"],
    },
    "quick": {
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


def _runs(preset: dict, directory: Path) -> dict[str, list[str]]:
    pairs, prompts = _write_data(directory, preset)
    shared = ["--max_prompt_length", "1024", *preset["flags"]]  # grpo has no max_length (TRL's neither)
    return {
        "dpo": [*shared, "--max_length", "2048", "--dataset_name", str(pairs),
                "--per_device_train_batch_size", "8"],
        "grpo": [*shared, "--dataset_name", str(prompts), "--per_device_train_batch_size", "64",
                 "--num_generations", "8", "--reward_funcs", "fastalign.builtin:digit_ratio",
                 "--max_completion_length", str(preset["max_completion_length"])],
    }  # fmt: skip


def main() -> None:
    floor = "none stated: a whole training step (generation is memory-bound decoding)"
    train_runs.main("e2e_alignment_step", __doc__, PRESETS, PROVIDERS, _runs, floor)


if __name__ == "__main__":
    main()
