"""The model and tokenizer a run trains: a local checkpoint directory, or a built-in tiny model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fastalign.quant import (
    QuantOptions,
    checkpoint_tensors,
    empty_model,
    fill_model,
    load_4bit_model,
    quantize_model,
)
from fastalign.testing import BUILTIN_DATASETS, TINY_MODEL_TYPES, tiny_model, tiny_tokenizer

#: Built-in model names: ``tiny-<family>``, random weights, the offline tokenizer (no download).
BUILTIN_MODELS = tuple(f"tiny-{family}" for family in TINY_MODEL_TYPES)


def load_model_and_tokenizer(
    name_or_path: str,
    quantization: QuantOptions | None = None,
    device: torch.device | str = "cpu",
    *,
    materialize: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """fp32 weights (mixed precision is the engine's business), ``use_cache`` off for training.

    With ``quantization`` the decoder layers' linear layers are 4-bit: a local checkpoint is loaded
    layer by layer straight onto ``device`` (``fastalign.quant.load_4bit_model``), so neither host nor
    device ever holds the full-precision model; the rest (frozen too) is in ``quantization.dtype``.
    ``materialize=False`` returns a local checkpoint (4-bit or not) as a meta-device skeleton instead,
    for ``materialize_model`` to fill after LoRA and sharding: each rank then only ever holds its shard
    (a model bigger than one GPU never has to fit on one)."""
    if name_or_path in BUILTIN_MODELS:
        model, tokenizer = tiny_model(name_or_path.removeprefix("tiny-")), tiny_tokenizer()
        if quantization is not None:
            quantize_model(model.to(device), quantization).to(quantization.dtype)
    else:
        path = Path(name_or_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model_name_or_path {name_or_path!r} is neither a local model directory (with a "
                f"config.json) nor a built-in model ({', '.join(BUILTIN_MODELS)}); nothing is downloaded"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not materialize:
            model = empty_model(AutoConfig.from_pretrained(path), _dtype(quantization), quantization)
        elif quantization is not None:
            model = load_4bit_model(path, quantization, device=device)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model, tokenizer


def _dtype(quantization: QuantOptions | None) -> torch.dtype:
    """fp32 weights, or with 4-bit layers the dtype of the frozen rest."""
    return torch.float32 if quantization is None else quantization.dtype


def materialize_model(
    model: torch.nn.Module,
    name_or_path: str,
    quantization: QuantOptions | None,
    device: torch.device,
    seed: int,
) -> torch.nn.Module:
    """Fill a skeleton from ``load_model_and_tokenizer(..., materialize=False)`` (maybe LoRA-wrapped and
    sharded since) from its checkpoint: every rank reads (and quantizes) each layer and keeps its own
    shard. A model that is already materialized is returned as it is."""
    if not any(param.is_meta for param in model.parameters()):
        return model
    return fill_model(
        model, checkpoint_tensors(name_or_path), dtype=_dtype(quantization),
        quantization=quantization, device=device, source=f"checkpoint {name_or_path}", seed=seed,
    )  # fmt: skip


def load_dataset_rows(name_or_path: str) -> list[dict]:
    """Rows of a built-in data set, or of local JSONL/JSON/Parquet files (``fastalign.data``)."""
    if name_or_path in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name_or_path]()
    from fastalign.data import load_rows

    return list(load_rows(name_or_path))
