"""End to end: forward+backward of models of several families, original vs ``fastalign.patch_model``.

    python benchmarks/e2e/bench_patch_model.py --preset gpu   # published shapes, 2 layers each, bf16
    python benchmarks/e2e/bench_patch_model.py --preset cpu   # small shapes (~2 minutes on 2 quiet cores)
    python benchmarks/e2e/bench_patch_model.py --preset quick # tiny ones, seconds

The models, random weights built from a config (no download), each from its published config's shapes
(the GPU preset) scaled down for the CPU presets:

- llama: Llama-3-8B (2 of its 32 layers; the CPU presets' 32k vocabulary);
- granite: Granite-3.3-2B (2 of its 40 layers), a dense family of issue 23 with its embedding, residual,
  attention and logit multipliers, attention dropout and tied embeddings; patched: the RMSNorms, RoPE,
  the gated MLP and the fused head that divides by ``logits_scaling``;
- qwen3_moe: Qwen3-30B-A3B (2 of its 48 layers), one case per transformers expert path ("grouped_mm", its
  default, and the "eager" loop over the hit experts); patched besides: each expert's ``act(gate)·up``.

Each row: forward (with labels) and forward+backward median time, tokens/s, and the workspace (peak
memory of a step above the weights and their gradients). Floor: 6·P_active·T matmul FLOPs (P_active =
the matmul weights a token goes through: every 2-D one but the input embedding, the top-k share of the
experts; T = tokens) plus causal attention 6·L·S²·(heads·head_dim)·B, at the matmul ceiling measured on
the same device.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign import patch_model
from fastalign.bench import measure


@dataclass(frozen=True)
class Model:
    model_type: str
    config: dict  # config keys besides max_position_embeddings (the sequence length)
    seq: int
    #: A mixture of experts: the ``experts_implementation``s measured, one case each.
    experts: tuple[str, ...] = ()


EXPERTS = ("grouped_mm", "eager")
#: Granite-3.3-2B's published config values besides its sizes (ibm-granite/granite-3.3-2b-instruct, as
#: tests/patching/test_published_configs.py writes them).
GRANITE = dict(attention_dropout=0.1, attention_multiplier=0.015625, embedding_multiplier=12.0,
               residual_multiplier=0.22, logits_scaling=8.0, rms_norm_eps=1e-05, rope_theta=10000000.0,
               tie_word_embeddings=True)  # fmt: skip
PRESETS = {
    "gpu": {
        "models": (
            Model("llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=128256, num_hidden_layers=2), seq=8192),
            Model("granite", GRANITE | dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                            num_key_value_heads=8, vocab_size=49159, num_hidden_layers=2),
                  seq=8192),
            Model("qwen3_moe", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                    head_dim=128, num_experts=128, num_experts_per_tok=8,
                                    moe_intermediate_size=768, vocab_size=151936, num_hidden_layers=2),
                  seq=4096, experts=EXPERTS),
        ),
        "dtype": "bfloat16", "batch": 1, "repeats": 0,
    },
    "cpu": {
        "models": (
            Model("llama", dict(hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=32000, num_hidden_layers=2), seq=2048),
            Model("granite", GRANITE | dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                            num_key_value_heads=1, vocab_size=49159, num_hidden_layers=2),
                  seq=1024),
            Model("qwen3_moe", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=64, num_experts=32, num_experts_per_tok=8,
                                    moe_intermediate_size=128, vocab_size=32000, num_hidden_layers=2),
                  seq=1024, experts=EXPERTS),
        ),
        "dtype": "float32", "batch": 1, "repeats": 5,
    },
    "quick": {
        "models": (
            Model("llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=2048, num_hidden_layers=2), seq=256),
            Model("granite", GRANITE | dict(hidden_size=64, intermediate_size=256, num_attention_heads=4,
                                            num_key_value_heads=1, vocab_size=2048, num_hidden_layers=2),
                  seq=256),
            Model("qwen3_moe", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, vocab_size=2048, num_hidden_layers=2),
                  seq=256, experts=EXPERTS),
        ),
        "dtype": "float32", "batch": 1, "repeats": 5,
    },
}  # fmt: skip
PROVIDERS = ("torch-eager", "fastalign-patched")
FLOOR = "6·P_active·T + 6·L·S²·(heads·head_dim)·B FLOPs (forward+backward) at the measured matmul ceiling"


def _active_matmul_params(model) -> int:
    """Matmul weights one token goes through: the 2-D ones but the input embedding (attention, MLP,
    router, the head, counted once where it is tied to the embedding) and the top-k share of the 3-D
    expert weights."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    dense = sum(
        p.numel() for p in model.parameters() if p.dim() == 2 and p is not embedding and p is not head
    )
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    if experts:
        experts = experts * model.config.num_experts_per_tok // model.config.num_experts
    return dense + head.numel() + experts


def _floor_ms(model, batch_size: int, seq: int, tflops: float) -> float:
    config = model.config
    attention_width = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    flops = 6 * _active_matmul_params(model) * batch_size * seq
    flops += 6 * config.num_hidden_layers * seq * seq * attention_width * batch_size
    return flops / (tflops * 1e12) * 1e3


def _shape(config, batch_size: int, seq: int, experts: str | None) -> str:
    shape = f"{config.model_type} hidden={config.hidden_size} layers={config.num_hidden_layers} "
    if experts:
        shape += f"experts={config.num_experts} top_k={config.num_experts_per_tok} "
    shape += f"vocab={config.vocab_size} batch={batch_size} seq={seq}"
    return shape + (f" experts_implementation={experts}" if experts else "")


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
    args = common.arguments(__doc__, PRESETS, "gpu", "both").parse_args()
    names = common.select_providers("e2e_patch_model", PROVIDERS, args.providers)
    preset = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()
    tflops = common.matmul_tflops(device, dtype)
    batch_size = preset["batch"]
    rows = []
    for spec in preset["models"]:
        config = AutoConfig.for_model(spec.model_type, **spec.config, max_position_embeddings=spec.seq)
        torch.manual_seed(0)
        original = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        original = original.to(device)
        input_ids = torch.randint(0, config.vocab_size, (batch_size, spec.seq), device=device)
        batch = {"input_ids": input_ids, "labels": input_ids}
        floor_ms = _floor_ms(original, batch_size, spec.seq, tflops)
        for experts in spec.experts or (None,):
            if experts:
                original.set_experts_implementation(experts)
            shape = _shape(config, batch_size, spec.seq, experts)
            for name in names:
                model = original if name == "torch-eager" else patch_model(copy.deepcopy(original))
                row = _measure(name, model, batch, device, preset["repeats"])
                row = common.add_floor(row | {"shape": shape, "dtype": preset["dtype"]}, floor_ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del original
    common.record(
        suite="e2e", kernel="e2e_patch_model", preset=args.preset,
        floor=FLOOR, ceiling={"matmul_tflops": round(tflops, 3)}, device=device, rows=rows, skipped={},
        out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
