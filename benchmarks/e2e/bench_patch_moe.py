"""End to end: forward+backward of a Qwen3-MoE-shaped model, original vs ``fastalign.patch_model``, under
each of transformers' expert paths ("grouped_mm", its default, and the "eager" loop over the hit experts).

    python benchmarks/e2e/bench_patch_moe.py --preset gpu   # Qwen3-30B-A3B shape, 2 of its 48 layers, bf16
    python benchmarks/e2e/bench_patch_moe.py --preset cpu   # a small Qwen3-MoE shape, 32k vocabulary
    python benchmarks/e2e/bench_patch_moe.py --preset quick # a tiny one, seconds

Patched: the RMSNorms (q/k norms included), RoPE, each expert's ``act(gate) · up`` (through
``_apply_gate`` for grouped_mm; ``glu_linear`` in the eager loop) and the fused loss head. Rows and
figures as ``bench_patch_model.py``'s; the floor counts the active parameters (attention, router, the
top-k of the experts per token): 6·P_active·T plus causal attention 6·L·S²·D·B.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from benchmarks.e2e.bench_patch_model import PROVIDERS, _matmul_params, _measure
from fastalign import patch_model
from fastalign.bench import measure

PRESETS = {
    # Qwen3-30B-A3B's shapes; 2 of 48 decoder layers.
    "gpu": {
        "config": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       vocab_size=151936, num_hidden_layers=2),
        "dtype": "bfloat16", "batch": 1, "seq": 4096, "repeats": 0,
    },
    "cpu": {
        "config": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       num_experts=32, num_experts_per_tok=8, moe_intermediate_size=128,
                       vocab_size=32000, num_hidden_layers=2),
        "dtype": "float32", "batch": 1, "seq": 1024, "repeats": 5,
    },
    "quick": {
        "config": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       vocab_size=2048, num_hidden_layers=2),
        "dtype": "float32", "batch": 1, "seq": 256, "repeats": 5,
    },
}  # fmt: skip
EXPERTS = ("grouped_mm", "eager")


def _active_matmul_params(model, config) -> int:
    """Matmul weights one token goes through: the 2-D ones (attention, router, head) and top-k experts."""
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    return _matmul_params(model) + experts * config.num_experts_per_tok // config.num_experts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: both)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args()
    names = common.select_providers("e2e_patch_moe", PROVIDERS, args.providers)
    preset = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()
    config = Qwen3MoeConfig(**preset["config"], max_position_embeddings=preset["seq"])
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    batch_size, seq = preset["batch"], preset["seq"]
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq), device=device)
    batch = {"input_ids": input_ids, "labels": input_ids}

    tflops = common.matmul_tflops(device, dtype)
    flops = 6 * _active_matmul_params(original, config) * input_ids.numel()
    flops += 6 * config.num_hidden_layers * seq * seq * config.hidden_size * batch_size
    floor_ms = flops / (tflops * 1e12) * 1e3
    rows = []
    for experts in EXPERTS:
        original.set_experts_implementation(experts)
        shape = (
            f"qwen3_moe hidden={config.hidden_size} layers={config.num_hidden_layers} "
            f"experts={config.num_experts} top_k={config.num_experts_per_tok} vocab={config.vocab_size} "
            f"batch={batch_size} seq={seq} experts_implementation={experts}"
        )
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
        suite="e2e", kernel="e2e_patch_moe", preset=args.preset,
        floor="6·P_active·T + 6·L·S²·D·B FLOPs (forward+backward) at the measured matmul ceiling",
        ceiling={"matmul_tflops": round(tflops, 3)}, device=device, rows=rows, skipped={}, out_dir=args.out,
        spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
