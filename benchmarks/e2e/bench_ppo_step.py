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
        "prompt_words": 128, "max_completion_length": 256, "steps": 4, "flags": ["--bf16", "true"],
        "providers": ["separate", "one-base-lora", "one-base-qlora"],
    },
    "cpu": {
        "config": dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=32000, num_hidden_layers=2),
        "prompt_words": 16, "max_completion_length": 32, "steps": 4, "flags": [],
        "providers": ["separate", "one-base-lora"],
    },
    "quick": {
        "config": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2048, num_hidden_layers=2),
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


def _run(flags: list[str], output_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "fastalign.cli.main", "train", "ppo",
               "--output_dir", str(output_dir), "--loss_curve_png", "false", "--logging_steps", "1",
               "--save_strategy", "no", *flags]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _row(provider: str, logs: list[dict], shape: str) -> dict:
    steady = logs[1:] or logs  # the first step compiles, allocates and warms the caches
    step = statistics.median(r["step_seconds"] for r in steady)
    generation = statistics.median(r["timing/generation_seconds"] for r in steady)
    return {
        "provider": provider, "objective": "ppo", "shape": shape,
        "step_ms": round(1e3 * step, 1),
        "step_spread": round(measure.relative_spread([r["step_seconds"] for r in steady]), 3),
        "generation_ms": round(1e3 * generation, 1),
        "training_ms": round(1e3 * (step - generation), 1),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in logs),
        "reward": steady[-1]["objective/scores"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: the preset's)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    names = common.select_providers("e2e_ppo_step", PROVIDERS, args.providers, preset["providers"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp, common.keep_rows_on_termination(skipped):
        tmp = Path(tmp)
        config = LlamaConfig(**preset["config"], max_position_embeddings=4096)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
        tiny_tokenizer().save_pretrained(tmp / "model")
        flags = ["--model_name_or_path", str(tmp / "model"), "--max_steps", str(preset["steps"]),
                 "--dataset_name", str(_write_prompts(tmp, preset["prompt_words"])),
                 "--per_device_train_batch_size", "8", "--num_ppo_epochs", "1",
                 "--reward_funcs", "fastalign.builtin:digit_ratio", "--max_completion_length",
                 str(preset["max_completion_length"]), *preset["flags"]]  # fmt: skip
        shape = (
            f"llama hidden={config.hidden_size} layers={config.num_hidden_layers} vocab={config.vocab_size}"
        )
        for name in names:
            try:
                row = _row(name, _run([*flags, *PROVIDERS[name]], tmp / name), shape)
            except RuntimeError as error:
                skipped[name] = str(error)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    common.record(
        suite="e2e", kernel="e2e_ppo_step", preset=args.preset,
        floor="none stated: a whole PPO step (generation is memory-bound decoding)",
        ceiling={}, device=device, rows=rows, skipped=skipped, out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
