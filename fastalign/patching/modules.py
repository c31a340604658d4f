"""Replacement ``forward`` functions for the decoder's modules, bound per instance by ``patch_model``.

Each is built by a factory that closes over what the module's class does not say (the family's norm
convention, the activation, the backend), so a bound method needs no extra state on the module.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastalign.ops import apply_rotary_pos_emb, geglu, glu_linear, rms_norm, swiglu
from fastalign.ops.backend import Backend


def rms_norm_forward(gemma: bool, backend: Backend) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        return rms_norm(
            hidden_states, self.weight, self.eps if eps is None else eps, gemma=gemma, backend=backend
        )

    return forward


def gated_mlp_forward(layout: str, gelu: bool, dropout: bool, backend: Backend) -> Callable:
    """``down(act(gate) · up)``; with ``dropout``, followed by the module's
    ``dropout(p=self.residual_dropout)`` (the same call on the same tensor: the same mask)."""
    glu = geglu if gelu else swiglu

    def gate_up(self: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout == "fused_gate_up":
            return self.gate_up_proj(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(self, x)
        down = self.down_proj
        if (
            _plain_linear(down)
            and down.weight.dtype == gate.dtype
            and not torch.is_autocast_enabled(x.device.type)
        ):
            out = glu_linear(
                gate, up, down.weight, down.bias, gelu=gelu, backend=backend
            )  # keeps gate, up only
        else:  # LoRA, 4-bit, hooked or autocast projections: the module itself
            out = down(glu(gate, up, backend=backend))
        return F.dropout(out, p=self.residual_dropout, training=self.training) if dropout else out

    return forward


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``F.linear`` of its own parameters: no subclass, no hooks
    (accelerate's device-map ``_hf_hook`` included), so calling ``F.linear`` directly is the same call."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not hasattr(module, "_hf_hook")
        and "forward" not in module.__dict__
    )


def _fused_rope(original: Callable, backend: Backend) -> Callable:
    def fused(q, k, cos, sin, unsqueeze_dim: int = 1):
        if unsqueeze_dim != 1:  # a layout the kernel does not take: the model's own function
            return original(q, k, cos, sin, unsqueeze_dim)
        return apply_rotary_pos_emb(q, k, cos, sin, backend=backend)

    return fused


ROPE_FUNCTION = "apply_rotary_pos_emb"


def uses_module_rope(module: nn.Module) -> bool:
    """Whether the module's forward calls the module-level ``apply_rotary_pos_emb``."""
    forward = type(module).forward
    return ROPE_FUNCTION in forward.__code__.co_names and ROPE_FUNCTION in forward.__globals__


def _module_with_fused_rope(original_module: str, scope: dict, backend: Backend) -> types.ModuleType:
    """A module importable by name whose namespace is ``scope`` with the fused ``apply_rotary_pos_emb``.

    Registered in ``sys.modules`` so that whatever resolves a function's globals by module name (as
    ``torch.compile``'s guards do) finds the fused function there.
    """
    name = f"{original_module}__fastalign_rope_{backend}"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update(scope)
        module.__dict__["__name__"] = name
        module.__dict__[ROPE_FUNCTION] = _fused_rope(scope[ROPE_FUNCTION], backend)
        sys.modules[name] = module
    return sys.modules[name]


def attention_forward_with_fused_rope(module: nn.Module, backend: Backend) -> Callable:
    """The attention class's own forward, with ``apply_rotary_pos_emb`` resolved to the fused op.

    The same code over a copy of its module's namespace: this instance changes, the class and the
    transformers module do not (so other models in the process are untouched).
    """
    forward = type(module).forward
    scope = _module_with_fused_rope(forward.__module__, forward.__globals__, backend).__dict__
    patched = types.FunctionType(
        forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__
    )
    patched.__kwdefaults__ = forward.__kwdefaults__
    patched.__doc__ = forward.__doc__
    return patched
