"""The measuring loop of the benchmarks that time whole ``fastalign train`` runs (``bench_alignment_step``,
``bench_ppo_step``): one random-weight Llama-shaped model per preset, each (objective, provider) run as
``fastalign train`` in a fresh process (its own peak memory), one row from its ``metrics.jsonl``.

A script gives its presets (each with its ``providers``), its providers' flags and the ``fastalign train``
flags of each objective; ``main`` does the rest. Rows: the median step time over the steps after the
first (which compiles, allocates and warms the caches) and its spread, tokens/s, MFU (where the GPU's
peak is known), generation (``model.generate``) and the rest of the step where the objective generates,
the last step's mean reward, and the peak memory as the run logs it (CUDA: max allocated; CPU: the
process's peak RSS, interpreter and libraries included).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import common
from fastalign.bench import measure
from fastalign.builtin import tiny_tokenizer

#: The model of each preset: ~1.2B parameters on GPU, small ones with a 32k or a 2k vocabulary on CPU.
MODELS = {
    "gpu": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, num_hidden_layers=16),
    "cpu": dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=32000, num_hidden_layers=2),
    "quick": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2048, num_hidden_layers=2),
}  # fmt: skip
#: (preset, temporary folder) → objective → its ``fastalign train`` flags (the data it writes there)
Runs = Callable[[dict, Path], dict[str, list[str]]]


def _save_model(config: dict, directory: Path) -> tuple[Path, str]:
    """The model saved from ``config`` with seed 0 and the tiny tokenizer: (its folder, the rows' shape)."""
    config = LlamaConfig(**config, max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return (
        directory,
        f"llama hidden={config.hidden_size} layers={config.num_hidden_layers} vocab={config.vocab_size}",
    )


def _train(objective: str, flags: list[str], output_dir: Path) -> list[dict]:
    """The logged metrics of one ``fastalign train`` run, one step each; RuntimeError: why it failed."""
    command = [sys.executable, "-m", "fastalign.cli.main", "train", objective,
               "--output_dir", str(output_dir), "--loss_curve_png", "false", "--logging_steps", "1",
               *flags]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _row(provider: str, objective: str, logs: list[dict], shape: str, reward_key: str) -> dict:
    steady = logs[1:] or logs  # the first step compiles, allocates and warms the caches
    step = statistics.median(r["step_seconds"] for r in steady)
    row = {
        "provider": provider, "objective": objective, "shape": shape,
        "step_ms": round(1e3 * step, 1),
        "step_spread": round(measure.relative_spread([r["step_seconds"] for r in steady]), 3),
        "tokens_per_s": round(statistics.median(r["tokens_per_second"] for r in steady), 1),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in logs),
    }  # fmt: skip
    if "mfu" in steady[0]:
        row["mfu"] = round(statistics.median(r["mfu"] for r in steady), 4)
    if "timing/generation_seconds" in steady[0]:
        generation = statistics.median(r["timing/generation_seconds"] for r in steady)
        row["generation_ms"] = round(1e3 * generation, 1)
        row["training_ms"] = round(1e3 * (step - generation), 1)
        row["reward"] = steady[-1][reward_key]
    return row


def main(
    kernel: str, description: str, presets: dict, providers: dict[str, list[str]], runs: Runs, floor: str,
    reward_key: str = "reward",
) -> None:  # fmt: skip
    """Parse the script's arguments, run each objective of ``runs`` with each selected provider (its
    flags in ``providers``) and record the rows as ``kernel``. ``reward_key``: the objective's logged
    mean reward. A run that fails is recorded as skipped, with the last line of its error."""
    args = common.arguments(description, presets, "gpu", "the preset's").parse_args()
    preset = presets[args.preset]
    names = common.select_providers(kernel, providers, args.providers, preset["providers"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory() as tmp, common.keep_rows_on_termination(skipped):
        tmp = Path(tmp)
        model, shape = _save_model(MODELS[args.preset], tmp / "model")
        for objective, flags in runs(preset, tmp).items():
            flags = ["--model_name_or_path", str(model), "--max_steps", str(preset["steps"]), *flags]
            for name in names:
                try:
                    logs = _train(objective, [*flags, *providers[name]], tmp / f"{objective}-{name}")
                except RuntimeError as error:
                    skipped[f"{name} {objective}"] = str(error)
                    continue
                rows.append(_row(name, objective, logs, shape, reward_key))
                print(json.dumps(rows[-1]), flush=True)
    common.record(
        suite="e2e", kernel=kernel, preset=args.preset, floor=floor, ceiling={}, device=device, rows=rows,
        skipped=skipped, out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip
