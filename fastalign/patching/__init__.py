"""``fastalign.patch_model(model)``: drop-in fused kernels for Hugging Face causal LMs."""

from fastalign.patching.causal_lm import FusedCausalLMOutput, shift_labels
from fastalign.patching.families import SUPPORTED_MODEL_TYPES
from fastalign.patching.patch import (
    patch_lora_layers,
    patch_model,
    patched_pieces,
    skipped_pieces,
    unpatch_model,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "FusedCausalLMOutput",
    "patch_lora_layers",
    "patch_model",
    "patched_pieces",
    "shift_labels",
    "skipped_pieces",
    "unpatch_model",
]
