"""End to end: forward+backward of a Llama-3-8B-shaped model, original vs ``fastalign.patch_model``.

    python benchmarks/e2e/bench_patch_model.py --preset gpu   # Llama-3-8B shape, 2 of its 32 layers, bf16
    python benchmarks/e2e/bench_patch_model.py --preset cpu   # a small Llama shape with a 32k vocabulary
    python benchmarks/e2e/bench_patch_model.py --preset quick # a tiny one, seconds

Random weights built from a config (no download). Each row: forward (with labels) and forward+backward
median time, tokens/s, and the workspace (peak memory of a step above the weights and their gradients).
Floor: 6·P·T matmul FLOPs (P = parameters in matmuls, T = tokens) plus causal attention 6·L·S²·D·B, at
the matmul ceiling measured on the same device.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign import patch_model
from fastalign.bench import measure

PRESETS = {
    # Llama-3-8B's shapes; 2 of 32 decoder layers so that one GPU holds it with room for activations.
    "gpu": {
        "config": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, num_hidden_layers=2),
        "dtype": "bfloat16", "batch": 1, "seq": 8192, "repeats": 0,
    },
    "cpu": {
        "config": dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=32000, num_hidden_layers=2),
        "dtype": "float32", "batch": 1, "seq": 2048, "repeats": 5,
    },
    "quick": {
        "config": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2048, num_hidden_layers=2),
        "dtype": "float32", "batch": 1, "seq": 256, "repeats": 5,
    },
}  # fmt: skip
PROVIDERS = ("torch-eager", "fastalign-patched")


def _matmul_params(model) -> int:
    return sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name
    )


def _measure(name: str, model, batch: dict, device: torch.device, repeats: int) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]

    def forward():
        return model(**batch).loss

    def forward_backward():
        for p in params:
            p.grad = None
        forward().backward()

    row = {"provider": name} | common.step_figures(forward, forward_backward, device, repeats)
    row["tokens_per_s"] = round(batch["input_ids"].numel() / (row["fwd_bwd_ms"] * 1e-3), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: both)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    names = common.select_providers("e2e_patch_model", PROVIDERS, args.providers)
    preset = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()
    config = LlamaConfig(**preset["config"], max_position_embeddings=preset["seq"])
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    batch_size, seq = preset["batch"], preset["seq"]
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq), device=device)
    batch = {"input_ids": input_ids, "labels": input_ids}

    tflops = common.matmul_tflops(device, dtype)
    flops = 6 * _matmul_params(original) * input_ids.numel()
    flops += 6 * config.num_hidden_layers * seq * seq * config.hidden_size * batch_size
    floor_ms = flops / (tflops * 1e12) * 1e3
    shape = (
        f"llama hidden={config.hidden_size} layers={config.num_hidden_layers} vocab={config.vocab_size} "
        f"batch={batch_size} seq={seq}"
    )
    rows = []
    for name in names:
        model = original if name == "torch-eager" else patch_model(copy.deepcopy(original))
        row = _measure(name, model, batch, device, preset["repeats"])
        row = common.add_floor(row | {"shape": shape, "dtype": preset["dtype"]}, floor_ms)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    common.record(
        suite="e2e", kernel="e2e_patch_model", preset=args.preset,
        floor="6·P·T + 6·L·S²·D·B FLOPs (forward+backward) at the measured matmul ceiling",
        ceiling={"matmul_tflops": round(tflops, 3)}, device=device, rows=rows, skipped={}, out_dir=args.out,
        spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
