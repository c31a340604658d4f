"""fastalign: Triton-accelerated post-training (SFT, DPO family, GRPO) for Hugging Face causal LMs."""

from fastalign.ops import LinearCrossEntropyStats, linear_cross_entropy, token_logprobs
from fastalign.patching import SUPPORTED_MODEL_TYPES, patch_model, unpatch_model

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "LinearCrossEntropyStats",
    "__version__",
    "linear_cross_entropy",
    "patch_model",
    "token_logprobs",
    "unpatch_model",
]
