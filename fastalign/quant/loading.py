"""4-bit models that never exist whole in memory: checkpoints loaded layer by layer in 4 bits, and
random-weight models of any published shape built directly in 4 bits.

The dense streaming loader (``fastalign.models.streaming``) does the work: ``empty_4bit_model`` is its
meta-device skeleton with ``FourBitLinear`` placeholders in the decoder layers, and ``fill_4bit_model``
its ``fill_model`` quantizing each placeholder's weight as soon as it arrives, so no layer is ever held
in full precision longer than it takes to quantize it, and device memory stays near the final 4-bit
footprint. Between the two, the skeleton may be wrapped with LoRA and sharded with FSDP2.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from fastalign.models.streaming import checkpoint_tensors, empty_model, fill_model
from fastalign.quant.four_bit_linear import FourBitLinear, QuantOptions, is_quantized_target, layer_prefixes


def empty_4bit_model(config: PretrainedConfig, options: QuantOptions) -> nn.Module:
    """``empty_model`` of ``config`` in ``options.dtype``, its decoder layers' linear layers
    ``FourBitLinear`` placeholders (their bytes and scales come with ``fill_4bit_model``)."""
    model = empty_model(config, options.dtype)
    prefixes = layer_prefixes(model)
    for name, module in list(model.named_modules()):
        if is_quantized_target(name, module, prefixes):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, FourBitLinear.placeholder(module, options))
    return model


def _quantize_on_arrival(
    options: QuantOptions, module: nn.Module, attribute: str, tensor: torch.Tensor
) -> torch.Tensor:
    """A ``FourBitLinear``'s weight as its packed bytes (its scales set on the module); anything else as
    it is."""
    if not (isinstance(module, FourBitLinear) and attribute == "weight"):
        return tensor
    packed, module.quant_state = options.quantize(tensor)
    return packed


def fill_4bit_model(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    options: QuantOptions,
    *,
    device: torch.device | str,
    source: str,
    seed: int = 0,
) -> nn.Module:
    """``fill_model`` for a skeleton of ``empty_4bit_model`` (maybe LoRA-wrapped and sharded since):
    each ``FourBitLinear`` quantized with ``options`` as its weight arrives, the rest in ``options.dtype``."""
    quantize = functools.partial(_quantize_on_arrival, options)
    return fill_model(
        model, tensors, dtype=options.dtype, device=device, source=source, seed=seed, convert=quantize
    )


def load_4bit_model(
    path: str | Path, options: QuantOptions, *, device: torch.device | str = "cpu", seed: int = 0
) -> nn.Module:
    """The causal LM saved at ``path`` (config.json + safetensors, one file or sharded) with its
    decoder layers' linear layers in 4 bits, loaded layer by layer (the rest in ``options.dtype``).
    Errors name a missing shard, a tensor missing from the checkpoint, or an unreadable file."""
    model = empty_4bit_model(AutoConfig.from_pretrained(path), options)
    return fill_4bit_model(
        model, checkpoint_tensors(path), options, device=device, source=f"checkpoint {path}", seed=seed
    )


def _random_tensors(model: nn.Module, config: PretrainedConfig, device: torch.device):
    """A random tensor for every parameter of ``model`` in checkpoint naming, drawn on ``device``: norms
    1, biases 0, the rest normal with the config's ``initializer_range``."""
    std = getattr(config, "initializer_range", 0.02)
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        packed = isinstance(owner, FourBitLinear) and name.endswith("weight")
        shape = (owner.out_features, owner.in_features) if packed else param.shape
        if "norm" in type(owner).__name__.lower():
            yield name, torch.ones(shape, device=device)
        elif name.endswith("bias"):
            yield name, torch.zeros(shape, device=device)
        else:
            yield name, torch.randn(shape, device=device) * std


def random_4bit_model(
    config: PretrainedConfig, options: QuantOptions, *, device: torch.device | str = "cpu", seed: int = 0
) -> nn.Module:
    """A random-weight causal LM of ``config``'s shape (e.g. Llama-3-70B's) built directly in 4 bits,
    one module at a time, for benchmarks without downloads: never more than one layer in full precision."""
    torch.manual_seed(seed)
    model = empty_4bit_model(config, options)
    tensors = _random_tensors(model, config, torch.device(device))
    source = f"random {config.model_type} model"
    return fill_4bit_model(model, tensors, options, device=device, source=source, seed=seed)
