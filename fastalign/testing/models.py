"""Tiny Llama/Qwen/Mistral-shaped causal LMs built from configs with random weights (no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

#: Shape of every tiny model: small enough for CPU tests, with GQA (4 query heads, 2 KV heads).
_TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

#: What distinguishes each family at this size.
_FAMILY_OVERRIDES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"tie_word_embeddings": True},  # Qwen2 also has q/k/v biases, set by its config class
    "qwen3": {"tie_word_embeddings": True},  # Qwen3 adds q/k RMSNorm
}

TINY_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILY_OVERRIDES)


def tiny_config(model_type: str = "llama", vocab_size: int = 512, **overrides) -> PretrainedConfig:
    """Config of a tiny ``model_type`` model; ``overrides`` win over the defaults."""
    if model_type not in _FAMILY_OVERRIDES:
        raise ValueError(f"model_type must be one of {TINY_MODEL_TYPES}, got {model_type!r}")
    kwargs = {**_TINY_SHAPE, **_FAMILY_OVERRIDES[model_type], "vocab_size": vocab_size, **overrides}
    # special ids of fastalign.testing.tiny_tokenizer
    kwargs.setdefault("pad_token_id", 0)
    kwargs.setdefault("bos_token_id", 1)
    kwargs.setdefault("eos_token_id", 2)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(
    model_type: str = "llama",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM, the same weights for the same ``seed``.

    ``attn_implementation`` defaults to 'sdpa', which has a CPU backward (flex attention has none).
    """
    config = tiny_config(model_type, vocab_size=vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype)
