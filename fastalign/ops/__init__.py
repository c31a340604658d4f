"""The public functional API. Every op takes ``backend='auto'|'triton'|'torch'``."""

from fastalign.ops.grpo import combine_rewards, group_advantages
from fastalign.ops.linear_cross_entropy import (
    LinearCrossEntropyStats,
    linear_cross_entropy,
    token_logprobs,
    token_objective,
)
from fastalign.ops.rms_norm import rms_norm
from fastalign.ops.rope import apply_rotary_pos_emb
from fastalign.ops.swiglu import geglu, swiglu

__all__ = [
    "LinearCrossEntropyStats",
    "apply_rotary_pos_emb",
    "combine_rewards",
    "geglu",
    "group_advantages",
    "linear_cross_entropy",
    "rms_norm",
    "swiglu",
    "token_logprobs",
    "token_objective",
]
