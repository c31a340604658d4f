"""Models that never exist whole in memory: a checkpoint streamed into a skeleton, one module at a time.

``empty_model`` builds the model on the meta device (no memory); ``fill_model`` then materializes it,
one module at a time as its tensors arrive — read one at a time from the safetensors shards
(``checkpoint_tensors``, memory-mapped), or drawn at random — converting each tensor on arrival where a
caller asks (``fastalign.quant`` quantizes each linear layer as soon as its weight is there). Peak host
memory stays near one shard and one layer, and device memory near the final footprint.

Checkpoints on disk may name and split tensors otherwise than the model holds them: a mixture-of-experts
checkpoint (the Hub's, and what ``save_pretrained`` writes) has one ``gate_proj``/``up_proj``/``down_proj``
(Mixtral: ``w1``/``w3``/``w2``) per expert, where transformers 5 holds each layer's experts as two 3-D
parameters. ``fill_model`` converts as ``from_pretrained`` does, with transformers' own conversion
mapping (``get_model_conversion_mapping``): a fused parameter is built as soon as the last of its
checkpoint tensors arrives (which ones, the checkpoint's names tell up front), so at most one layer's
experts are held at a time.

Between the two, the skeleton can be wrapped with LoRA and sharded with FSDP2 (the trainer does): each
rank then reads every layer but keeps only its own shard, so no rank ever holds the whole model — not
70B in fp32, nor even in NF4 (~37 GB: more than a 24 GB GPU). Rank 0 loading and broadcasting would read
the disk once instead of N times, but needs a broadcast per tensor and rank 0's host memory for each
layer; reading is the cheaper side on a local or cached file system.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from fastalign.models.structure import base_model

_INDEX = "model.safetensors.index.json"

#: ``convert(module, attribute, tensor)``: what ``module.<attribute>`` stores for a checkpoint tensor
#: that arrived (already on the device, in the model's dtype) — e.g. 4-bit bytes for a quantized layer's
#: weight; anything it does not convert it returns as it is.
Convert = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]


def empty_model(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the meta device (no memory until ``fill_model``): parameters on
    the meta device; buffers (rotary tables, embedding scales: computed, not loaded) real, as the model's
    constructor computes them."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _tie_embeddings(model)  # init_empty_weights gives the head a meta Parameter of its own
    # transformers finds a model's conversions by its classes, which FSDP2 replaces by classes of its own
    # (FSDPMixtralForCausalLM, defined in torch: "custom code", which transformers skips): looked up now
    model._checkpoint_conversions = get_model_conversion_mapping(model)
    return model


def _tie_embeddings(model: nn.Module) -> None:
    """With ``tie_word_embeddings`` the LM head's weight *is* the input embedding's, one Parameter (so
    ``named_parameters``, FSDP2 and the optimizer see it once). ``init_empty_weights`` and ``to_empty``
    both create a separate tensor per module and so untie them: this ties them again (the embedding's
    Parameter is the one kept: FSDP2 manages a tied weight under its first owner, the embedding)."""
    base = base_model(model)
    if not getattr(base.config, "tie_word_embeddings", False):
        return
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    # under LoRA on the embedding peft wraps both (its weight tying): the weights are the base layers'
    head, embedding = getattr(head, "base_layer", head), getattr(embedding, "base_layer", embedding)
    if head is not None and head.weight is not embedding.weight:
        head.weight = embedding.weight


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


class CheckpointTensors:
    """Every tensor of a checkpoint, one at a time when iterated, file by file (each file opened once,
    memory-mapped); ``names``, all of them, known before any is read (what ``fill_model`` needs to know
    when the last tensor of a fused parameter has arrived). Errors name a missing shard, a tensor the
    index promises but the shard lacks, or an unreadable file."""

    def __init__(self, path: str | Path):
        self.files = _shard_files(Path(path))
        self.names: list[str] = list(self.files)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, file in self.files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            yield from _file_tensors(file, names)


def checkpoint_tensors(path: str | Path) -> CheckpointTensors:
    """The tensors of the checkpoint at ``path`` (one safetensors file or the shards of an index)."""
    return CheckpointTensors(path)


def _file_tensors(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``names`` of one safetensors file, in that order."""
    if not file.is_file():
        raise ValueError(f"checkpoint shard {file.name} (holding {names[0]}, ...) is missing")
    try:
        with safe_open(str(file), framework="pt") as handle:
            available = set(handle.keys())
            for name in names:
                if name not in available:
                    raise ValueError(f"checkpoint shard {file.name} does not hold {name} as its index says")
                yield name, handle.get_tensor(name)
    except SafetensorError as error:
        raise ValueError(f"cannot read safetensors file {file}: {error}") from None


def _checkpoint_name(name: str) -> str:
    """A parameter's name as the checkpoint has it: without peft's wrapper prefix and ``base_layer``."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``param``, or, for an FSDP2-sharded parameter, only this rank's dim-0 chunk."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        chunks = full.chunk(mesh.size(), dim=0)  # FSDP2's Shard(0) layout, torch.chunk's split
        rank = mesh.get_local_rank()
        full = chunks[rank] if rank < len(chunks) else full[:0]
        param = param.to_local()
    if param.shape != full.shape:
        raise ValueError(
            f"a checkpoint tensor has shape {tuple(full.shape)}, the model expects {tuple(param.shape)}"
        )
    param.copy_(full)


class _Conversion:
    """transformers' conversion of checkpoint tensors into ``model``'s parameters, as ``from_pretrained``
    applies it (``get_model_conversion_mapping``: its renamings, e.g. Mixtral's ``block_sparse_moe`` →
    ``mlp``, and its converters, e.g. each layer's per-expert ``gate_proj``/``up_proj`` stacked and
    concatenated into ``experts.gate_up_proj``), on a stream. A fused parameter is converted when the
    last of its checkpoint tensors arrives: ``names`` (every checkpoint tensor's name, when known up front)
    tells how many it is made of; without them, the fused parameters are converted at the end. Its
    tensors are stacked in the natural order of their names (expert 2 before expert 10), as
    ``from_pretrained`` sorts a checkpoint before converting it."""

    def __init__(self, model: nn.Module, expected: Collection[str], names: Collection[str] | None):
        self.model = base_model(model)
        transforms = getattr(self.model, "_checkpoint_conversions", None)  # an ``empty_model`` skeleton's
        if transforms is None:
            transforms = get_model_conversion_mapping(self.model)
        self.transforms = transforms
        self.renamings = [entry for entry in transforms if isinstance(entry, WeightRenaming)]
        self.converters = [entry for entry in transforms if isinstance(entry, WeightConverter)]
        self.by_pattern = {pattern: entry for entry in self.converters for pattern in entry.source_patterns}
        self.expected = dict.fromkeys(expected, True)  # rename_source_key looks names up with .get
        self.sizes: dict[str, int] = {}
        for name in names or ():
            target, pattern = self.rename(name)
            if pattern is not None:
                self.sizes[target] = self.sizes.get(target, 0) + 1
        self.pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}

    def rename(self, name: str) -> tuple[str, str | None]:
        """The model's name for checkpoint tensor ``name``, and the converter source pattern it matched
        (None: a plain rename), with ``from_pretrained``'s fallback to the name as it is."""
        prefix = self.model.base_model_prefix
        target, pattern = rename_source_key(name, self.renamings, self.converters, prefix, self.expected)
        if target not in self.expected and name in self.expected:
            target, pattern = rename_source_key(name, [], [], prefix, self.expected)
        return target, pattern

    def __call__(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            target, pattern = self.rename(name)
            if pattern is None:
                yield target, tensor
            elif target in self.expected:  # a fused parameter the model lacks is dropped at once
                arrived = self.pending.setdefault(target, {})
                arrived[name] = (pattern, tensor)
                if len(arrived) == self.sizes.get(target):
                    yield from self.fuse(target)
        for target in list(self.pending):
            yield from self.fuse(target)

    def remember(self) -> None:
        """What ``from_pretrained`` leaves on the model for ``save_pretrained`` to undo: the transforms
        this checkpoint used (so an FSDP2-sharded model, whose classes transformers does not recognise,
        still saves one tensor per expert, as it was loaded)."""
        used = [transform for transform in self.transforms if transform.was_used()]
        if used:
            self.model._weight_conversions = used

    def fuse(self, target: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameter(s) ``target``'s converter builds from its arrived tensors, which it releases."""
        arrived = self.pending.pop(target)
        converter = None
        for name in sorted(arrived, key=dot_natural_key):
            pattern, tensor = arrived.pop(name)
            converter = converter or copy.deepcopy(self.by_pattern[pattern])
            converter.add_tensor(target, name, pattern, tensor)
        for fused, value in converter.convert(target, model=self.model, config=self.model.config).items():
            yield fused, value[0] if isinstance(value, list) else value


class _Filler:
    """Fills a materialized skeleton module by module: a module is written once all its own parameters
    arrived (a layer's weight and bias may come in any order, from different shards)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device, convert: Convert | None):
        self.dtype, self.device, self.convert = dtype, device, convert
        self.modules: dict[str, nn.Module] = {}
        self.expected: dict[str, set[str]] = {}
        for name, _ in model.named_parameters():
            if "lora_" in name:
                continue
            module_name, _, attribute = _checkpoint_name(name).rpartition(".")
            self.modules[module_name] = model.get_submodule(name.rpartition(".")[0])
            self.expected.setdefault(module_name, set()).add(attribute)
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.filled: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attribute = name.rpartition(".")
        if attribute not in self.expected.get(module_name, ()):
            return  # a tensor the model does not use (a stale rotary buffer): ignored, as transformers does
        received = self.pending.setdefault(module_name, {})
        received[attribute] = tensor
        if set(received) == self.expected[module_name]:
            self.write(self.modules[module_name], self.pending.pop(module_name))
            self.filled.add(module_name)

    def write(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        for attribute, tensor in tensors.items():
            target_dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
            tensor = tensor.to(self.device, target_dtype)
            if self.convert is not None:
                tensor = self.convert(module, attribute, tensor)
            _assign(getattr(module, attribute), tensor)

    def missing(self) -> list[str]:
        return [
            f"{name}.{attribute}"
            for name in self.expected
            if name not in self.filled
            for attribute in sorted(self.expected[name])
        ]


def _init_lora(model: nn.Module, seed: int) -> None:
    """peft's default LoRA initialization (A: Kaiming-uniform with a = √5, B: zeros), drawn whole on the
    CPU from ``seed`` whatever the sharding, so every process count starts from the same adapters."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if "lora_" in name and not ("lora_A" in name or "lora_B" in name):
            raise ValueError(
                f"{name}: only LoRA's A and B matrices of linear layers are initialized on a model loaded "
                "layer by layer (no embedding adapters or DoRA): check lora_target_modules"
            )
        if "lora_A" in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            full = (torch.rand(param.shape, generator=generator) * 2 - 1) * bound
        elif "lora_B" in name:
            full = torch.zeros(param.shape)
        else:
            continue
        _assign(param, full.to(param.device, param.dtype))


@torch.no_grad()
def fill_model(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    source: str,
    seed: int = 0,
    convert: Convert | None = None,
) -> nn.Module:
    """Materialize a model from ``empty_model`` — as it is, or wrapped by peft and sharded by FSDP2
    since — on ``device`` from ``tensors`` (name, full tensor) in checkpoint naming (a checkpoint's own,
    converted as ``from_pretrained`` converts it: ``_Conversion``; ``checkpoint_tensors`` names them all up
    front, so each fused parameter is built as soon as its tensors are in), in ``dtype``, each
    tensor passed through ``convert`` on arrival when given; LoRA adapters get their initialization from
    ``seed``. Errors name the first tensor ``source`` lacks."""
    device = torch.device(device)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}  # to_empty wipes them
    model.to_empty(device=device)
    _tie_embeddings(model)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    filler = _Filler(model, dtype, device, convert)
    expected = [f"{module}.{attribute}" for module, names in filler.expected.items() for attribute in names]
    conversion = _Conversion(model, expected, getattr(tensors, "names", None))
    for name, tensor in conversion(tensors):
        filler.add(name, tensor)
    conversion.remember()
    missing = filler.missing()
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source} is missing tensor {missing[0]}{more}")
    _init_lora(model, seed)
    return model
