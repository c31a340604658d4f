"""End to end: PPO steps (generation + training) of a random-weight model, with separate models and with
one base model under LoRA.

    python benchmarks/e2e/bench_ppo_step.py --preset gpu   # ~1.2B Llama shape, bf16, one GPU
    python benchmarks/e2e/bench_ppo_step.py --preset cpu   # a small Llama shape, fp32 (minutes on 2 cores)
    python benchmarks/e2e/bench_ppo_step.py --preset quick # a tiny one, three steps (a smoke test)

Each provider runs ``fastalign train ppo`` in a fresh process (its own peak memory) on a model saved from
a config (no download) and generated prompts, 8 prompts per step, one completion each, rewarded by
``fastalign.builtin:digit_ratio``; ``num_ppo_epochs`` 1, so every step samples. Providers:

- ``separate``: full fine-tuning; the policy, the critic (a sequence classifier of the same shape) and
  the frozen reference are three models, the first two trained with AdamW;
- ``one-base-lora``: ``use_peft``: one frozen base model, the policy's and the critic's LoRA adapters
  and a value head, the reference the base with the adapters off;
- ``one-base-qlora`` (gpu preset): the same on an NF4 base.

Rows: the median step time over the steps after the first, split into generation (``model.generate``)
and the rest (``training_ms``: the policy's, the reference's and the critic's forwards at rollout time,
rewards, GAE, forward and backward of policy and critic, the optimizer step), and the peak memory as
the run logs it (CUDA: max allocated; CPU: the process's peak RSS, interpreter and libraries included).
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
        "prompt_words": 128, "max_completion_length": 256, "steps": 4, "flags": ["--bf16", "true"],
        "providers": ["separate", "one-base-lora", "one-base-qlora"],
    },
    "cpu": {
        "prompt_words": 16, "max_completion_length": 32, "steps": 4, "flags": [],
        "providers": ["separate", "one-base-lora"],
    },
    "quick": {
        "prompt_words": 8, "max_completion_length": 8, "steps": 3, "flags": [],
        "providers": ["separate", "one-base-lora"],
    },
}  # fmt: skip
#: Provider → the ``fastalign train ppo`` flags that make it.
PROVIDERS = {
    "separate": [],
    "one-base-lora": ["--use_peft", "true"],
    "one-base-qlora": ["--use_peft", "true", "--quantization", "nf4"],
}

_WORDS = "what is the sum of these numbers and how many words are in this question".split()


def _write_prompts(directory: Path, words: int) -> Path:
    rows = [{"prompt": " ".join(_WORDS[(i + k * 5) % len(_WORDS)] for k in range(words))} for i in range(64)]
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _runs(preset: dict, directory: Path) -> dict[str, list[str]]:
    return {
        "ppo": ["--dataset_name", str(_write_prompts(directory, preset["prompt_words"])),
                "--per_device_train_batch_size", "8", "--num_ppo_epochs", "1", "--save_strategy", "no",
                "--reward_funcs", "fastalign.builtin:digit_ratio", "--max_completion_length",
                str(preset["max_completion_length"]), *preset["flags"]],
    }  # fmt: skip


def main() -> None:
    floor = "none stated: a whole PPO step (generation is memory-bound decoding)"
    train_runs.main("e2e_ppo_step", __doc__, PRESETS, PROVIDERS, _runs, floor, reward_key="objective/scores")


if __name__ == "__main__":
    main()
