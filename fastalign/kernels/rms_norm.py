"""Triton RMSNorm forward/backward, with Llama-style and Gemma-style casting.

    x̂ = x · rstd,  rstd = 1 / sqrt(mean(x²) + eps)               (fp32)
    llama:  y = w · cast(x̂)            (normalise in fp32, cast to the input dtype, scale in that dtype)
    gemma:  y = cast(x̂ · (1 + w))      (fp32 throughout, weight stored as an offset from 1)

Backward, with g = dy · w_eff (w_eff = w or 1 + w):
    dx = rstd · (g − x̂ · mean(g · x̂)),    dw = Σ_rows dy · x̂   (x̂ as cast for llama)
The weight gradient is reduced in fp32: each program sums its rows into one fp32 row of a
[programs, D] buffer, which is then summed in fp32.

One program per row (forward) or per group of rows (backward), the whole row in one tile: D up to
16k fits. Floor: memory traffic, forward reads x, writes y (2·M·D elements); backward reads x, dy,
writes dx (3·M·D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    D,
    eps,
    GEMMA: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x_hat = x * rstd
    if GEMMA:
        y = x_hat * (1.0 + w)
    else:
        y = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    D,
    rows_per_program,
    GEMMA: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w_eff = 1.0 + w if GEMMA else w
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        # The last program may have fewer rows: past M, every column is masked and adds 0 to dw.
        row_mask = cols < tl.where(row < M, D, 0)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=row_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # an in-bounds address for masked rows
        x_hat = x * rstd
        g = dy * w_eff
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / D))
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
        if GEMMA:
            dw += dy * x_hat
        else:
            dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_partial_ptr + pid * D + cols, dw, mask=mask)


def _num_warps(block_d: int) -> int:
    return min(max(block_d // 256, 1), 16)


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D] in ``out_dtype``, rstd [M] fp32) for x [M, D] with a unit-stride last dimension."""
    rows, dim = x.shape
    y = torch.empty_like(x, dtype=out_dtype)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(dim)
    _rms_norm_forward_kernel[(rows,)](
        x, weight, y, rstd, x.stride(0), y.stride(0), dim, eps, GEMMA=gemma, BLOCK_D=block,
        num_warps=_num_warps(block),
    )  # fmt: skip
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, D] in x's dtype, dw [D] fp32)."""
    rows, dim = x.shape
    dx = torch.empty_like(x)
    if x.is_cuda:
        programs = min(rows, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    else:
        programs = min(rows, 4)  # the interpreter: few programs, long loops
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dw_partial = torch.empty((programs, dim), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(dim)
    _rms_norm_backward_kernel[(programs,)](
        dy, x, weight, rstd, dx, dw_partial, dy.stride(0), x.stride(0), dx.stride(0), rows, dim,
        rows_per_program, GEMMA=gemma, BLOCK_D=block, num_warps=_num_warps(block),
    )  # fmt: skip
    return dx, dw_partial.sum(dim=0)
