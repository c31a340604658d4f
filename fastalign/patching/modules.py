"""Replacement ``forward`` functions for the decoder's modules, bound per instance by ``patch_model``.

Each is built by a factory that closes over what the module's class does not say (the family's norm
convention, the activation, the backend), so a bound method needs no extra state on the module; the
factories are ``rebuildable``, so that a pickled patched model is patched again as it loads.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastalign.ops import apply_rotary_pos_emb, geglu, glu_linear, rms_norm, swiglu
from fastalign.ops.autocast_linear import autocast_linear
from fastalign.ops.backend import Backend
from fastalign.ops.tiled import tile_tokens, tiled_mlp
from fastalign.patching.bound import rebuildable
from fastalign.patching.lora import is_lora_linear


@rebuildable
def rms_norm_forward(gemma: bool, backend: Backend) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        return rms_norm(
            hidden_states, self.weight, self.eps if eps is None else eps, gemma=gemma, backend=backend
        )

    return forward


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` that, under autocast, keeps no low-precision copy of the weight for
    backward (``fastalign.ops.autocast_linear``)."""
    return autocast_linear(x, self.weight, self.bias)


@rebuildable
def gated_mlp_forward(
    layout: str, gelu: bool, dropout: bool, backend: Backend, tile_budget: int | None = None
) -> Callable:
    """``down(act(gate) · up)``; with ``dropout``, followed by the module's
    ``dropout(p=self.residual_dropout)`` (the same call on the same tensor: the same mask).

    With ``tile_budget`` (bytes), a sequence longer than one tile runs in token tiles of about that
    working set each, forward and backward (``fastalign.ops.tiled``); a shorter one runs as without."""
    glu = geglu if gelu else swiglu

    def gate_up(self: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout == "fused_gate_up":
            return self.gate_up_proj(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)

    def mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(self, x)
        down = self.down_proj
        if plain_linear(down) and (
            down.weight.dtype == gate.dtype or torch.is_autocast_enabled(x.device.type)
        ):
            # keeps gate, up only
            return glu_linear(gate, up, down.weight, down.bias, gelu=gelu, backend=backend)
        return down(glu(gate, up, backend=backend))  # LoRA, 4-bit or hooked projections: the module itself

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        size = None if tile_budget is None else mlp_tile_tokens(self, x, tile_budget)
        if size is None or x.numel() // x.shape[-1] <= size:
            out = mlp(self, x)
        else:
            trained = [p for p in self.parameters() if p.requires_grad]
            out = tiled_mlp(lambda tile: mlp(self, tile), x, size, trained)
        return F.dropout(out, p=self.residual_dropout, training=self.training) if dropout else out

    return forward


def mlp_tile_tokens(module: nn.Module, x: torch.Tensor, budget: int) -> int:
    """Tokens per tile of a gated MLP within ``budget`` bytes: a token's gate and up outputs and its
    output (``2·intermediate + hidden`` elements of the compute dtype), twice for backward (their
    gradients beside them), and twice again with LoRA adapters (each adapted projection's dropped-out
    input and update beside its base output)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    intermediate = getattr(module, "intermediate_size", None) or module.down_proj.in_features
    lora = any(is_lora_linear(child) for child in module.children())
    per_token = (2 * intermediate + x.shape[-1]) * dtype.itemsize * 2 * (2 if lora else 1)
    return tile_tokens(budget, per_token)


@rebuildable
def experts_forward(gelu: bool, backend: Backend) -> Callable:
    """The forward of a transformers 5 ``*Experts`` module (3-D ``gate_up_proj`` [E, 2I, D] and
    ``down_proj`` [E, D, I], ``[gate; up]`` concatenated, no biases) with the fused activation.

    With ``experts_implementation`` "eager" (transformers' own loop over the hit experts), each expert's
    ``down(act(gate) · up)`` is ``glu_linear``, which keeps only gate and up for backward; the tokens are
    sorted by expert once (one host sync per layer, not one per expert) and each expert's weighted output
    is accumulated as the loop does (``index_add_`` in the hidden dtype, experts in order), so the
    forward computes the same sums. With "grouped_mm"/"batched_mm" (transformers' default) the class's
    dispatch runs and calls the module's ``_apply_gate``, which ``fused_gate`` replaces.
    """

    def loop(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden)
        top_k = top_k_index.shape[-1]
        expert_of_slot = top_k_index.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        # Index num_experts is expert parallelism's "not on this rank": sorted last, skipped as the loop does.
        counts = torch.bincount(expert_of_slot, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        tokens, weights = order // top_k, top_k_weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            token = tokens[rows]
            gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            out = glu_linear(gate, up, self.down_proj[expert], gelu=gelu, backend=backend)
            final.index_add_(0, token, (out * weights[rows, None]).to(final.dtype))
        return final

    def forward(self: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        if self.config._experts_implementation in (None, "eager"):
            return loop(self, hidden_states, top_k_index, top_k_weights)
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)

    return forward


@rebuildable
def fused_gate(gelu: bool, backend: Backend) -> Callable:
    """``_apply_gate`` of a ``*Experts`` module, which transformers' grouped and batched expert matmuls
    call on the ``[tokens, 2I]`` gate_up output: ``act(gate) · up`` fused (kept for backward: gate, up)."""
    glu = geglu if gelu else swiglu

    def _apply_gate(self: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return glu(gate, up, backend=backend)

    return _apply_gate


def plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose call is ``F.linear`` of its own parameters in hand, so that a fused kernel
    may take its weight instead of calling it: ``nn.Linear``'s forward (a subclass that keeps it, too),
    or fastalign's ``linear_forward`` (``F.linear`` outside autocast); no forward hooks or pre-hooks (a
    user's, or FSDP2's on a separately sharded module, whose weight is a shard until its pre-hook runs)
    and no accelerate device-map hook (``_hf_hook``: its weight may be on the meta device). Not a
    quantized or LoRA layer: those override the forward."""
    forward = module.__dict__.get("forward")
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and not hasattr(module, "_hf_hook")
        and (forward is None or getattr(forward, "__func__", None) is linear_forward)
    )


def _fused_rope(original: Callable, backend: Backend, half_tables: bool) -> Callable:
    def fused(q, k, cos, sin, unsqueeze_dim: int = 1):
        if unsqueeze_dim != 1:  # a layout the kernel does not take: the model's own function
            return original(q, k, cos, sin, unsqueeze_dim)
        if half_tables:  # (x1, x2) rotated by one table each half: the rotate-half tables repeat it
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return apply_rotary_pos_emb(q, k, cos, sin, backend=backend)

    return fused


ROPE_FUNCTION = "apply_rotary_pos_emb"


def uses_module_rope(module: nn.Module) -> bool:
    """Whether the module's forward calls the module-level ``apply_rotary_pos_emb``."""
    forward = type(module).forward
    return ROPE_FUNCTION in forward.__code__.co_names and ROPE_FUNCTION in forward.__globals__


def _module_with_fused_rope(
    original_module: str, scope: dict, backend: Backend, half_tables: bool
) -> types.ModuleType:
    """A module importable by name whose namespace is ``scope`` with the fused ``apply_rotary_pos_emb``.

    Registered in ``sys.modules`` so that whatever resolves a function's globals by module name (as
    ``torch.compile``'s guards do) finds the fused function there.
    """
    name = f"{original_module}__fastalign_rope_{backend}{'_half_tables' if half_tables else ''}"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update(scope)
        module.__dict__["__name__"] = name
        module.__dict__[ROPE_FUNCTION] = _fused_rope(scope[ROPE_FUNCTION], backend, half_tables)
        sys.modules[name] = module
    return sys.modules[name]


@rebuildable
def attention_forward_with_fused_rope(
    attention_class: type[nn.Module], backend: Backend, half_tables: bool = False
) -> Callable:
    """The attention class's own forward, with ``apply_rotary_pos_emb`` resolved to the fused op (given
    ``cat(cos, cos)``, ``cat(sin, sin)`` where the family's tables are ``half_tables``).

    The same code over a copy of its module's namespace: the instance it is bound to changes, the class
    and the transformers module do not (so other models in the process are untouched).
    """
    forward = attention_class.forward
    scope = _module_with_fused_rope(forward.__module__, forward.__globals__, backend, half_tables).__dict__
    patched = types.FunctionType(
        forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__
    )
    patched.__kwdefaults__ = forward.__kwdefaults__
    patched.__doc__ = forward.__doc__
    return patched
