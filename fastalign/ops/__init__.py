"""The public functional API. Every op takes ``backend='auto'|'triton'|'torch'``."""

from fastalign.ops.cpu_gemm import Fp32CpuGemms, cpu_gemms
from fastalign.ops.gae import generalized_advantage_estimation
from fastalign.ops.grpo import combine_rewards, group_advantages
from fastalign.ops.linear_cross_entropy import (
    LinearCrossEntropyStats,
    linear_cross_entropy,
    token_logprobs,
    token_objective,
)
from fastalign.ops.linear_divergence import linear_divergence
from fastalign.ops.nf4 import (
    FourBitState,
    NestedAbsmax,
    dequantize_4bit,
    linear_4bit,
    quantize_4bit,
    state_from_bitsandbytes,
)
from fastalign.ops.rms_norm import rms_norm
from fastalign.ops.rope import apply_rotary_pos_emb
from fastalign.ops.swiglu import geglu, glu_linear, swiglu

__all__ = [
    "FourBitState",
    "Fp32CpuGemms",
    "LinearCrossEntropyStats",
    "NestedAbsmax",
    "apply_rotary_pos_emb",
    "combine_rewards",
    "cpu_gemms",
    "dequantize_4bit",
    "geglu",
    "generalized_advantage_estimation",
    "glu_linear",
    "group_advantages",
    "linear_4bit",
    "linear_cross_entropy",
    "linear_divergence",
    "quantize_4bit",
    "rms_norm",
    "state_from_bitsandbytes",
    "swiglu",
    "token_logprobs",
    "token_objective",
]
