"""Gated MLP activations: ``fastalign.ops.swiglu`` / ``geglu`` dispatch and their PyTorch reference.

``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen, Phi-3) and
``geglu(gate, up) = gelu_tanh(gate) * up`` (Gemma). The Triton kernel is in
``fastalign/kernels/swiglu.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastalign.ops.autocast_linear import cast_linear, cast_linear_backward
from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.recompute import recompute_in_backward


def glu_reference(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The PyTorch implementation (and the CPU backend): Hugging Face's arithmetic."""
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return act * up


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, gelu: bool):
        from fastalign.kernels import swiglu as kernels

        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        return kernels.glu_forward(gate, up, gelu)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        from fastalign.kernels import swiglu as kernels

        gate, up = ctx.saved_tensors
        d_gate, d_up = kernels.glu_backward(dh.contiguous(), gate, up, ctx.gelu)
        return d_gate, d_up, None


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )


def _glu(gate: torch.Tensor, up: torch.Tensor, gelu: bool, backend: Backend) -> torch.Tensor:
    _check_pair(gate, up)
    if resolve_backend(backend, gate) == "torch":  # the reference's values, keeping gate and up only
        return recompute_in_backward(functools.partial(glu_reference, gelu=gelu), gate, up)
    return _GLUFunction.apply(gate, up, gelu)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``silu(gate) * up``, fused in one kernel forward and one backward."""
    return _glu(gate, up, False, backend)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``gelu_tanh(gate) * up``, fused in one kernel forward and one backward."""
    return _glu(gate, up, True, backend)


class _GLULinearFunction(torch.autograd.Function):
    """``linear(act(gate) · up, weight, bias)`` keeping ``gate``, ``up`` and the weight only. The
    projection's input, act(gate)·up, is the MLP's largest activation ([tokens, intermediate]); eagerly
    the down projection keeps it for its weight gradient beside the gate and up the activation keeps.
    Backward recomputes it (one elementwise pass) instead: one [tokens, intermediate] tensor less per
    layer, the same matmuls.

    ``dtype``: the matmuls' dtype. Under autocast it is autocast's and the projection is autocast's
    (``cast_linear`` and its backward, shared with ``fastalign.ops.autocast_linear``): input, weight and
    bias cast to it, the weight cast again in backward rather than saved, the weight and bias gradients
    formed in it and widened to theirs."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, gelu: bool, torch_backend: bool, dtype: torch.dtype):
        ctx.save_for_backward(gate, up, weight)
        ctx.gelu, ctx.torch_backend, ctx.dtype = gelu, torch_backend, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return cast_linear(_glu_with_grad(gate, up, gelu, torch_backend).to(dtype), weight, bias, dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        needs_gate, needs_up, needs_weight, needs_bias = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            gate = gate.detach().requires_grad_(needs_gate)
            up = up.detach().requires_grad_(needs_up)
            hidden = _glu_with_grad(gate, up, ctx.gelu, ctx.torch_backend)
        inputs = [tensor for tensor in (gate, up) if tensor.requires_grad]
        grad_hidden, grad_weight, grad_bias = cast_linear_backward(
            grad_out,
            hidden.detach().to(ctx.dtype),
            weight,
            ctx.bias_dtype,
            ctx.dtype,
            (bool(inputs), needs_weight, needs_bias),
        )
        grads = iter(torch.autograd.grad(hidden, inputs, grad_hidden.to(hidden.dtype)) if inputs else ())
        grad_gate = next(grads) if needs_gate else None
        grad_up = next(grads) if needs_up else None
        return grad_gate, grad_up, grad_weight, grad_bias, None, None, None


def _glu_with_grad(gate: torch.Tensor, up: torch.Tensor, gelu: bool, torch_backend: bool) -> torch.Tensor:
    """The activation with its own autograd graph (none under no_grad): PyTorch's ops or the kernel's."""
    return glu_reference(gate, up, gelu) if torch_backend else _GLUFunction.apply(gate, up, gelu)


def glu_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gelu: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` (act: silu, or gelu-tanh with ``gelu``): a gated MLP's
    activation and down projection, keeping only ``gate`` and ``up`` for backward (the projection's
    input is recomputed there). Under autocast the projection is autocast's, without its saved
    low-precision weight copy (``autocast_linear``): the weight may then be of another dtype than
    ``gate``; outside autocast it must be of the same."""
    _check_pair(gate, up)
    autocast = torch.is_autocast_enabled(gate.device.type)
    if (
        weight.dim() != 2
        or weight.shape[1] != gate.shape[-1]
        or (weight.dtype != gate.dtype and not autocast)
    ):
        raise ValueError(
            f"weight must be [out, {gate.shape[-1]}] in {gate.dtype}, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or (bias.dtype != weight.dtype and not autocast)):
        raise ValueError(
            f"bias must be [{weight.shape[0]}] in {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    torch_backend = resolve_backend(backend, gate) == "torch"
    if not (
        torch.is_grad_enabled() and any(t.requires_grad for t in (gate, up, weight, bias) if t is not None)
    ):
        return F.linear(_glu_with_grad(gate, up, gelu, torch_backend), weight, bias)
    dtype = torch.get_autocast_dtype(gate.device.type) if autocast else weight.dtype
    return _GLULinearFunction.apply(gate, up, weight, bias, gelu, torch_backend, dtype)
