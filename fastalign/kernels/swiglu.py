"""Triton gated activations for the MLP ``down(act(gate(x)) * up(x))``: SwiGLU and GeGLU (tanh).

    forward:  h = act(a) · b
    backward: da = dh · b · act'(a),  db = dh · act(a)
    silu(a) = a·σ(a),                     silu'(a) = σ(a)·(1 + a·(1 − σ(a)))
    gelu_tanh(a) = ½a(1 + t), t = tanh(k(a + 0.044715a³)), k = √(2/π)
    gelu_tanh'(a) = ½(1 + t) + ½a(1 − t²)·k(1 + 3·0.044715a²)

Elementwise over contiguous tensors, computed in fp32 and rounded once. Floor: memory traffic, forward
reads a, b and writes h (3 elements each); backward reads a, b, dh and writes da, db (5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals read inside @triton.jit code must be tl.constexpr: the compiler refuses plain Python floats
# (the interpreter does not, so tests/kernels/test_jit_globals.py checks this on CPU).
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_COEF = tl.constexpr(0.044715)


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _act_and_grad(a, GELU: tl.constexpr):
    """act(a) and act'(a), fp32."""
    if GELU:
        inner = SQRT_2_OVER_PI * (a + GELU_COEF * a * a * a)
        t = _tanh(inner)
        act = 0.5 * a * (1.0 + t)
        grad = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * a * a)
    else:
        sig = 1.0 / (1.0 + tl.exp(-a))
        act = a * sig
        grad = sig * (1.0 + a * (1.0 - sig))
    return act, grad


@triton.jit
def _glu_forward_kernel(a_ptr, b_ptr, h_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(a, GELU)
    tl.store(h_ptr + offsets, (act * b).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    act, grad = _act_and_grad(a, GELU)
    tl.store(da_ptr + offsets, (dh * b * grad).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offsets, (dh * act).to(db_ptr.dtype.element_ty), mask=mask)


def _grid(n: int, block: int) -> tuple[int]:
    return (triton.cdiv(n, block),)


def _block(n: int) -> int:
    return min(4096, triton.next_power_of_2(n))


def glu_forward(a: torch.Tensor, b: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(a) * b for contiguous a, b of one shape and dtype."""
    h = torch.empty_like(a)
    block = _block(a.numel())
    _glu_forward_kernel[_grid(a.numel(), block)](a, b, h, a.numel(), GELU=gelu, BLOCK=block)
    return h


def glu_backward(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) for contiguous dh, a, b."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    block = _block(a.numel())
    _glu_backward_kernel[_grid(a.numel(), block)](dh, a, b, da, db, a.numel(), GELU=gelu, BLOCK=block)
    return da, db
