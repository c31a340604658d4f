"""4-bit models without ever holding the full-precision model: checkpoints loaded layer by layer, and
random-weight models of any published shape built directly in 4 bits.

The model is built on the meta device (no memory), then each module is materialized as its tensors
arrive — read one at a time from the safetensors shards (memory-mapped), or drawn at random — and its
linear layers are quantized at once, so peak host memory stays near one layer on top of the 4-bit
model, and device memory near the final 4-bit footprint.

Under FSDP2 every rank loads the (4-bit, so small) model and ``fully_shard`` then keeps its shard:
simple, no broadcast protocol, and the full-precision tensors never exist anywhere in full. The
alternative, rank 0 loading and broadcasting, saves disk reads on a shared file system but holds a
whole layer's broadcast buffers on every rank; at 4 bits the reads are the smaller cost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from fastalign.quant.four_bit_linear import QuantOptions, is_quantized_target, layer_prefixes, quantize_linear

_INDEX = "model.safetensors.index.json"


def _empty_model(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _shard_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (one file, or the shards of an index)."""
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{path} has neither model.safetensors nor {_INDEX}")
    return {name: single for name in _keys(single)}


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as error:
        raise ValueError(f"cannot read safetensors file {file}: {error}") from None


def _tensors(files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, one at a time, file by file (each file opened once, memory-mapped)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not file.is_file():
            raise ValueError(f"checkpoint shard {file.name} (holding {names[0]}, ...) is missing")
        try:
            with safe_open(str(file), framework="pt") as handle:
                available = set(handle.keys())
                for name in names:
                    if name not in available:
                        raise ValueError(
                            f"checkpoint shard {file.name} does not hold {name} as its index says"
                        )
                    yield name, handle.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"cannot read safetensors file {file}: {error}") from None


class _Materializer:
    """Fills a meta model module by module: a module is built once all its own parameters arrived."""

    def __init__(self, model: nn.Module, options: QuantOptions, device: torch.device, dtype: torch.dtype):
        self.model, self.options, self.device, self.dtype = model, options, device, dtype
        self.layer_prefixes = layer_prefixes(model)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attribute = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        expected = {key for key, value in module.named_parameters(recurse=False) if value is not None}
        if attribute not in expected:
            return  # a tensor the model does not use (a stale rotary buffer): ignored, as transformers does
        received = self.pending.setdefault(module_name, {})
        received[attribute] = tensor
        if set(received) == expected:
            self.build(module_name, module, self.pending.pop(module_name))

    def build(self, module_name: str, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        if is_quantized_target(module_name, module, self.layer_prefixes):
            dense = nn.Linear(module.in_features, module.out_features, bias="bias" in tensors, device="meta")
            dense.weight = nn.Parameter(tensors["weight"].to(self.device, self.dtype), requires_grad=False)
            if "bias" in tensors:
                dense.bias = nn.Parameter(tensors["bias"].to(self.device, self.dtype))
            _replace(self.model, module_name, quantize_linear(dense, self.options))
            return
        for attribute, tensor in tensors.items():
            # a copy: a view would keep its whole memory-mapped shard resident for the model's lifetime
            dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
            value = tensor.to(self.device, dtype, copy=True)
            setattr(module, attribute, nn.Parameter(value, requires_grad=value.is_floating_point()))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def _finish(model: nn.Module, config: PretrainedConfig, device: torch.device, source: str) -> nn.Module:
    """Tie the head to the embeddings if the config says so, rebuild the rotary tables (buffers computed
    at construction, absent from checkpoints), and name any tensor still missing."""
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    for name, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            if "Rotary" not in type(module).__name__:
                raise ValueError(f"{source}: module {name} has buffers that no checkpoint tensor fills")
            with torch.device(device):  # rebuilt as transformers builds it, computed on the device
                _replace(model, name, type(module)(config=config))
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise ValueError(
            f"{source} is missing tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return model


def load_4bit_model(
    path: str | Path,
    options: QuantOptions,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The causal LM saved at ``path`` (config.json + safetensors, one file or sharded) with its
    decoder layers' linear layers in 4 bits, loaded layer by layer. Errors name a missing shard, a
    tensor missing from the checkpoint, or an unreadable (corrupt) safetensors file."""
    path, device = Path(path), torch.device(device)
    config = AutoConfig.from_pretrained(path)
    model = _empty_model(config, dtype)
    materializer = _Materializer(model, options, device, dtype)
    for name, tensor in _tensors(_shard_files(path)):
        materializer.add(name, tensor)
    return _finish(model, config, device, f"checkpoint {path}")


@torch.no_grad()
def random_4bit_model(
    config: PretrainedConfig, options: QuantOptions, *, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16, seed: int = 0,
) -> nn.Module:  # fmt: skip
    """A random-weight causal LM of ``config``'s shape (e.g. Llama-3-70B's) built directly in 4 bits,
    one module at a time, for benchmarks without downloads: never more than one layer's weights in
    full precision."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = _empty_model(config, dtype)
    materializer = _Materializer(model, options, device, dtype)
    std = getattr(config, "initializer_range", 0.02)
    for module_name, module in list(model.named_modules()):
        tensors = {}
        for attribute, param in module.named_parameters(recurse=False):
            if "norm" in type(module).__name__.lower():
                tensors[attribute] = torch.ones(param.shape, dtype=dtype, device=device)
            elif attribute == "bias":
                tensors[attribute] = torch.zeros(param.shape, dtype=dtype, device=device)
            else:
                tensors[attribute] = torch.randn(param.shape, dtype=dtype, device=device) * std
        if tensors:
            materializer.build(module_name, module, tensors)
    return _finish(model, config, device, f"random {config.model_type} model")
