"""The public functional API. Every op takes ``backend='auto'|'triton'|'torch'``."""

from fastalign.ops.linear_cross_entropy import (
    LinearCrossEntropyStats,
    linear_cross_entropy,
    token_logprobs,
)

__all__ = ["LinearCrossEntropyStats", "linear_cross_entropy", "token_logprobs"]
