"""Tiny Llama/Qwen/Mistral-shaped causal LMs (or reward models: the same body with a one-score head) built
from configs with random weights (no download)."""

from __future__ import annotations

from typing import Literal

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

#: What a model is for: next-token prediction (a ``*ForCausalLM``), or one score per sequence (a
#: ``*ForSequenceClassification`` with ``num_labels=1``: a reward model, scored at its last non-pad token).
ModelTask = Literal["causal_lm", "sequence_classification"]
#: The transformers auto class of each task.
AUTO_CLASSES = {
    "causal_lm": AutoModelForCausalLM,
    "sequence_classification": AutoModelForSequenceClassification,
}

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
    "gemma": {"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},  # (1 + w) norms, GeGLU
    "gemma2": {"tie_word_embeddings": True, "final_logit_softcapping": 30.0, "sliding_window": 8},
    "gemma3_text": {"tie_word_embeddings": True, "sliding_window": 8},  # q/k norms, local/global layers
    "phi3": {"partial_rotary_factor": 0.5, "head_dim": None},  # fused qkv and gate_up, partial RoPE
}

#: Attention implementation with a CPU backward that each family accepts.
_ATTENTION = {"gemma2": "eager"}

TINY_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILY_OVERRIDES)


def tiny_config(model_type: str = "llama", vocab_size: int = 512, **overrides) -> PretrainedConfig:
    """Config of a tiny ``model_type`` model; ``overrides`` win over the defaults."""
    if model_type not in _FAMILY_OVERRIDES:
        raise ValueError(f"model_type must be one of {TINY_MODEL_TYPES}, got {model_type!r}")
    kwargs = {**_TINY_SHAPE, **_FAMILY_OVERRIDES[model_type], "vocab_size": vocab_size, **overrides}
    kwargs = {key: value for key, value in kwargs.items() if not (key == "head_dim" and value is None)}
    # special ids of fastalign.builtin.tiny_tokenizer
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
    attn_implementation: str | None = None,
    task: ModelTask = "causal_lm",
    **overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (or, for ``task`` sequence_classification, a reward model with
    ``num_labels=1``), the same weights for the same ``seed``.

    ``attn_implementation`` defaults to 'sdpa' (which has a CPU backward; flex attention has none), or
    'eager' for families without sdpa support.
    """
    if task == "sequence_classification":
        overrides = {"num_labels": 1, **overrides}
    config = tiny_config(model_type, vocab_size=vocab_size, **overrides)
    attention = attn_implementation or _ATTENTION.get(model_type, "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AUTO_CLASSES[task].from_config(config, attn_implementation=attention)
    return model.to(dtype)
