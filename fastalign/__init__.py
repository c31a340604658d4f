"""fastalign: Triton-accelerated post-training (SFT, DPO family, GRPO) for Hugging Face causal LMs."""

from fastalign.ops import LinearCrossEntropyStats, linear_cross_entropy, token_logprobs

__version__ = "0.1.0"

__all__ = ["LinearCrossEntropyStats", "__version__", "linear_cross_entropy", "token_logprobs"]
