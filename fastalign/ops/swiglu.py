"""Gated MLP activations: ``fastalign.ops.swiglu`` / ``geglu`` dispatch and their PyTorch reference.

``swiglu(gate, up) = silu(gate) * up`` (Llama, Mistral, Qwen, Phi-3) and
``geglu(gate, up) = gelu_tanh(gate) * up`` (Gemma). The Triton kernel is in
``fastalign/kernels/swiglu.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


def _glu(gate: torch.Tensor, up: torch.Tensor, gelu: bool, backend: Backend) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )
    if resolve_backend(backend, gate) == "torch":  # the reference's values, keeping gate and up only
        return recompute_in_backward(functools.partial(glu_reference, gelu=gelu), gate, up)
    return _GLUFunction.apply(gate, up, gelu)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``silu(gate) * up``, fused in one kernel forward and one backward."""
    return _glu(gate, up, False, backend)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``gelu_tanh(gate) * up``, fused in one kernel forward and one backward."""
    return _glu(gate, up, True, backend)
