"""``FourBitLinear``: a frozen linear layer whose weight is stored in 4 bits (bitsandbytes' NF4/FP4
layout, quantized by bitsandbytes), which FSDP2 can shard without losing it.

Why not bitsandbytes' own ``Linear4bit`` under FSDP2: its quantization state lives on a ``Params4bit``
attribute, and ``fully_shard`` replaces every parameter by a plain DTensor — the state is dropped and
the 4-bit bytes are then read as if they were the weight (the pitfall that silently turns 4-bit
weights into full-size ones, or garbage). Here the packed bytes are an ordinary ``uint8`` parameter:
FSDP2 shards and all-gathers it like any other (mixed precision never casts a non-float parameter, so
the bytes survive a bf16 policy), and the small per-block scales (``quant_state``) stay whole on every
rank. The forward dequantizes inside an autograd function that saves only the packed bytes, so no
full-precision copy of the weight outlives the layer's forward.

It subclasses ``nn.Linear`` (``in_features``/``out_features``, no dense ``weight``) so that peft wraps
it with its ordinary LoRA layer, and ``compute_dtype`` tells peft to keep the adapters in fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fastalign.models.structure import decoder_layers
from fastalign.ops.backend import Backend
from fastalign.ops.nf4 import FourBitState, linear_4bit, quantize_4bit

QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")


@dataclass(frozen=True)
class QuantOptions:
    """How linear layers are quantized (bitsandbytes' names in the comments)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"  # bnb_4bit_quant_type
    double_quant: bool = True  # bnb_4bit_use_double_quant: the scales quantized too (~0.37 bit/param saved)
    blocksize: int = 64
    backend: Backend = "auto"
    dtype: torch.dtype = torch.float32  # what stays unquantized (embeddings, head, norms): frozen in QLoRA

    def __post_init__(self):
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"quantization must be one of {QUANT_TYPES}, got {self.quant_type!r}")

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, FourBitState]:
        """(packed bytes, state) of ``weight`` under these options (by bitsandbytes)."""
        return quantize_4bit(
            weight, quant_type=self.quant_type, blocksize=self.blocksize, double_quant=self.double_quant
        )


def _map_state(state, fn):
    """``state`` with ``fn`` applied to every tensor in it (nested dataclasses included)."""
    changes = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            changes[field.name] = fn(value)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = _map_state(value, fn)
    return dataclasses.replace(state, **changes)


def _same_dtype(fn, tensor: torch.Tensor) -> torch.Tensor:
    """``fn(tensor)`` (a move or ``to_empty``), but never a dtype change: a cast to bf16 and back would
    round the scales, and the weights would no longer be bitsandbytes' bits."""
    moved = fn(tensor)
    return moved if moved.dtype == tensor.dtype else tensor.to(moved.device)


class FourBitLinear(nn.Linear):
    """y = x · dequantize(W)ᵀ + b with W frozen in 4 bits; see the module docstring."""

    def __init__(
        self, packed: torch.Tensor, state: FourBitState, bias: torch.Tensor | None, backend: Backend
    ):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a dense weight
        self.out_features, self.in_features = state.shape
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bias.requires_grad)
        self.quant_state = state
        self.backend = backend
        self.compute_dtype = torch.float32  # read by peft: adapters stay fp32 (autocast computes in bf16)

    @classmethod
    def placeholder(cls, linear: nn.Linear, options: QuantOptions) -> FourBitLinear:
        """A meta-device stand-in for ``linear`` in 4 bits: its bytes and scales are filled later
        (``fastalign.quant.fill_4bit_model``), after LoRA wrapping and FSDP2 sharding if any."""
        meta = torch.device("meta")
        state = FourBitState(
            absmax=torch.empty(0, device=meta),
            code=torch.empty(16, device=meta),
            shape=(linear.out_features, linear.in_features),
            dtype=options.dtype,
            blocksize=options.blocksize,
            quant_type=options.quant_type,
        )
        packed = torch.empty(
            (linear.in_features * linear.out_features + 1) // 2, dtype=torch.uint8, device=meta
        )
        bias = (
            None
            if linear.bias is None
            else torch.empty(linear.out_features, dtype=options.dtype, device=meta)
        )
        return cls(packed, state, bias, options.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_4bit(x, self.weight, self.quant_state, self.bias, backend=self.backend)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out_features, in_features] in ``dtype`` (default: the dtype it was quantized from)."""
        return self.quant_state.dequantize(self.weight, dtype, backend=self.backend)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the scales with the bytes; .to(dtype) leaves them (and the bytes) as they are
        super()._apply(fn, recurse)
        self.quant_state = _map_state(self.quant_state, lambda t: _same_dtype(fn, t))
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quant_type={self.quant_state.quant_type}"
        )


@torch.no_grad()
def quantize_linear(linear: nn.Linear, options: QuantOptions) -> FourBitLinear:
    """A ``FourBitLinear`` of ``linear`` (quantized on ``linear``'s device, frozen)."""
    packed, state = options.quantize(linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach().clone().requires_grad_(False)
    return FourBitLinear(packed, state, bias, options.backend)


def is_quantized_target(name: str, module: nn.Module, layer_prefixes: set[str]) -> bool:
    """The linear layers of the decoder layers (attention and MLP projections) are quantized; the
    embeddings and the LM head stay as they are (as bitsandbytes' and TRL's QLoRA keep them)."""
    return isinstance(module, nn.Linear) and any(name.startswith(prefix + ".") for prefix in layer_prefixes)


def layer_prefixes(model: nn.Module) -> set[str]:
    """The module names of ``model``'s decoder layers."""
    layers = {id(layer) for layer in decoder_layers(model)}
    return {name for name, module in model.named_modules() if id(module) in layers}


def quantize_model(model: nn.Module, options: QuantOptions) -> nn.Module:
    """Replace the decoder layers' linear layers of ``model`` by ``FourBitLinear``s, in place (for a
    model already in memory; ``fastalign.quant.load_4bit_model`` never holds the dense one)."""
    prefixes = layer_prefixes(model)
    for name, module in list(model.named_modules()):
        if is_quantized_target(name, module, prefixes) and not isinstance(module, FourBitLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantize_linear(module, options))
    return model


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every ``FourBitLinear`` by a dense ``nn.Linear`` of its dequantized weight, in place:
    the base of a merged export (LoRA merged into dense weights)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FourBitLinear):
            dense = nn.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                device=module.weight.device,
                dtype=dtype,
            )
            with torch.no_grad():
                dense.weight.copy_(module.dequantize(dtype))
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, dense)
    return model
