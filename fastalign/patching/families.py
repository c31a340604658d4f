"""What ``patch_model`` needs to know about each supported architecture family.

One small adapter per ``config.model_type``: which RMSNorm convention its norms follow and how its MLP
is laid out. RoPE and the causal-LM head are the same across these families (the attention calls a
module-level ``apply_rotary_pos_emb``; the head is ``lm_head`` on the final hidden states, with Gemma-2/3's
optional ``final_logit_softcapping``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    gemma_norm: bool  # RMSNorm computes x̂·(1 + w) in fp32 (Gemma) rather than w·cast(x̂) (Llama)
    mlp_layout: Literal["gate_up_down", "fused_gate_up"]  # gate_proj/up_proj/down_proj or gate_up_proj


FAMILIES: dict[str, Family] = {
    "llama": Family(gemma_norm=False, mlp_layout="gate_up_down"),
    "mistral": Family(gemma_norm=False, mlp_layout="gate_up_down"),
    "qwen2": Family(gemma_norm=False, mlp_layout="gate_up_down"),
    "qwen3": Family(gemma_norm=False, mlp_layout="gate_up_down"),
    "gemma": Family(gemma_norm=True, mlp_layout="gate_up_down"),
    "gemma2": Family(gemma_norm=True, mlp_layout="gate_up_down"),
    "gemma3_text": Family(gemma_norm=True, mlp_layout="gate_up_down"),
    "phi3": Family(gemma_norm=False, mlp_layout="fused_gate_up"),
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))

#: Hugging Face activation names the fused gated-MLP kernels compute exactly: name → uses GeLU (tanh).
GATED_ACTIVATIONS: dict[str, bool] = {
    "silu": False,
    "swish": False,
    "gelu_pytorch_tanh": True,
    "gelu_tanh": True,
}


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"fastalign.patch_model does not support model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return FAMILIES[model_type]
