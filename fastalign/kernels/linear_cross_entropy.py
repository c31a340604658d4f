"""Triton row kernels of the fused linear cross-entropy / per-token log-prob op.

The op (``fastalign.ops.linear_cross_entropy``) walks the tokens in chunks
(``fastalign.ops.linear_cross_entropy_chunks``). For one chunk of C tokens it builds the raw logits
``x = h_c @ W.T + b`` ([C, V], input dtype, cuBLAS), then calls the two kernels of this file (or their
PyTorch twin, ``fastalign.ops.linear_cross_entropy_torch``), one program per row, each looping over the
vocabulary in ``BLOCK_V`` tiles:

1. ``softmax_row_stats``: online (single pass) statistics of the transformed logits
   ``z = softcap · tanh(x / softcap) / temperature`` (``z = x / temperature`` without softcap):
   ``lse = log Σ_j exp z_j``, the target logit ``z_t``, ``Σ_j z_j`` (label smoothing),
   ``μ = Σ_j p_j z_j`` (entropy ``H = lse − μ``), ``max_j z_j`` and whether the target is the argmax
   (token accuracy: the first maximal index, as ``torch.argmax``; a tile's maximum replaces the running
   one's index only when strictly greater).
2. ``softmax_row_grad_``: overwrites the chunk, in place, with the gradient w.r.t. the raw logits of
   ``Σ_i [a_i·lse_i + b_i·z_{i,t} + c_i·Σ_j z_ij − e_i·H_i]``-shaped outputs. With ``p = softmax(z)``:

       ∂/∂z_j = p_j · (a − e·(z_j − μ)) + c + b·[j = t]          (∂H/∂z_j = −p_j (z_j − μ))
       ∂/∂x_j = ∂/∂z_j · (1 − tanh²(x_j / softcap)) / temperature

   Every loss of fastalign is such a combination: cross-entropy with label smoothing ε and z-loss ζ has
   a = g(1 + 2ζ·lse), b = −g(1 − ε), c = −g·ε/V; a log-prob has a = −g, b = g; an ignored token has 0.

The chunk's gradient then feeds two more matmuls (``dh_c = G @ W``, ``dW += G.T @ h_c`` accumulated in
fp32). Floor: the three matmuls, 6·N·V·D FLOPs, when the gradient is formed in the forward pass
(scalar loss); 8·N·V·D when the logits are recomputed in backward (per-token outputs with an arbitrary
upstream gradient). The kernels add ~3 passes over a C×V tile (read, read, write) per chunk.

Written for the Triton interpreter too: every load is upcast to fp32, ``tanh`` is built from ``exp``,
and the tile size is a plain argument (one config, no autotune).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _transform_logits(x, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """Raw logits -> softcapped, temperature-scaled logits, and d z / d x."""
    if HAS_SOFTCAP:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits ±1 for |y| -> inf, no libdevice needed.
        th = 1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0)
        return softcap * th * inv_temperature, (1.0 - th * th) * inv_temperature
    return x * inv_temperature, inv_temperature + tl.zeros_like(x)


@triton.jit
def _this_row(logits_ptr, stride_row):
    """This program's row and a pointer to its first logit (64-bit: row · stride may pass 2**31)."""
    row = tl.program_id(0)
    return row, logits_ptr + row.to(tl.int64) * stride_row


@triton.jit
def _load_tile(row_ptr, start, V, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """Columns [start, start + BLOCK_V) of a row: (cols, in_vocab, z, dz/dx), z = 0 outside the vocab."""
    cols = start + tl.arange(0, BLOCK_V)
    in_vocab = cols < V
    x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    z, dz_dx = _transform_logits(x, softcap, inv_temperature, HAS_SOFTCAP)
    return cols, in_vocab, z, dz_dx


@triton.jit
def _softmax_row_stats_kernel(
    logits_ptr,
    stride_row,
    V,
    softcap,
    inv_temperature,
    ignore_index,
    targets_ptr,
    lse_ptr,
    target_logit_ptr,
    sum_logits_ptr,
    mean_pz_ptr,
    max_logit_ptr,
    top1_ptr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, row_ptr = _this_row(logits_ptr, stride_row)
    running_max = float("-inf")
    running_argmax = 0  # the first column holding running_max (torch.argmax's choice among ties)
    exp_sum = 0.0  # Σ exp(z - running_max)
    exp_z_sum = 0.0  # Σ exp(z - running_max) · z
    logit_sum = 0.0
    for start in range(0, V, BLOCK_V):
        _, in_vocab, z, _ = _load_tile(row_ptr, start, V, softcap, inv_temperature, HAS_SOFTCAP, BLOCK_V)
        # the tile's maximum and its first column, in the one reduction; an earlier tile's equal maximum wins
        masked = tl.where(in_vocab, z, float("-inf"))
        tile_max, tile_argmax = tl.max(
            masked, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
        running_argmax = tl.where(tile_max > running_max, start + tile_argmax, running_argmax)
        new_max = tl.maximum(running_max, tile_max)
        rescale = tl.exp(running_max - new_max)
        e = tl.where(in_vocab, tl.exp(z - new_max), 0.0)
        exp_sum = exp_sum * rescale + tl.sum(e, axis=0)
        exp_z_sum = exp_z_sum * rescale + tl.sum(e * z, axis=0)
        logit_sum += tl.sum(z, axis=0)
        running_max = new_max

    target = tl.load(targets_ptr + row)
    is_target = target != ignore_index
    x_t = tl.load(row_ptr + target, mask=is_target, other=0.0).to(tl.float32)
    z_t, _ = _transform_logits(x_t, softcap, inv_temperature, HAS_SOFTCAP)
    tl.store(lse_ptr + row, running_max + tl.log(exp_sum))
    tl.store(target_logit_ptr + row, tl.where(is_target, z_t, 0.0))
    tl.store(sum_logits_ptr + row, logit_sum)
    tl.store(mean_pz_ptr + row, exp_z_sum / exp_sum)
    tl.store(max_logit_ptr + row, running_max)
    tl.store(top1_ptr + row, tl.where(is_target & (running_argmax == target), 1.0, 0.0))


@triton.jit
def _softmax_row_grad_kernel(
    logits_ptr,
    stride_row,
    V,
    softcap,
    inv_temperature,
    targets_ptr,
    lse_ptr,
    mean_pz_ptr,
    coef_p_ptr,
    coef_target_ptr,
    coef_uniform_ptr,
    coef_entropy_ptr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row, row_ptr = _this_row(logits_ptr, stride_row)
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    mean_pz = tl.load(mean_pz_ptr + row)
    a = tl.load(coef_p_ptr + row)
    b = tl.load(coef_target_ptr + row)
    c = tl.load(coef_uniform_ptr + row)
    e = tl.load(coef_entropy_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols, in_vocab, z, dz_dx = _load_tile(
            row_ptr, start, V, softcap, inv_temperature, HAS_SOFTCAP, BLOCK_V
        )
        p = tl.exp(z - lse)
        grad_z = p * (a - e * (z - mean_pz)) + c + tl.where(cols == target, b, 0.0)
        # In place: this tile was read above and no other program touches this row.
        tl.store(row_ptr + cols, (grad_z * dz_dx).to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _launch_per_row(kernel, logits: torch.Tensor, *args, softcap, inv_temperature, block_v) -> None:
    """One program per row of ``logits`` [C, V], each looping over the vocabulary in ``block_v`` tiles.
    Both kernels take the row layout and the logit transform first, then their own ``args``.

    By default one tile per row up to 4096 columns: that keeps the interpreter fast on test sizes, and
    4096 fp32 lanes keep a CUDA SM busy without spilling registers.
    """
    rows, vocab = logits.shape
    block = block_v if block_v is not None else min(triton.next_power_of_2(vocab), 4096)
    kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        softcap or 1.0,
        inv_temperature,
        *args,
        HAS_SOFTCAP=softcap is not None,
        BLOCK_V=block,
        num_warps=8 if block >= 2048 else 4,
    )


def softmax_row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    softcap: float | None,
    inv_temperature: float,
    block_v: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-row (lse, target logit, Σ logits, Σ p·z, max logit, target is the argmax) of ``logits`` [C, V],
    all fp32 [C]."""
    stats = torch.empty((6, logits.shape[0]), dtype=torch.float32, device=logits.device)
    _launch_per_row(
        _softmax_row_stats_kernel,
        logits,
        ignore_index,
        targets,
        *stats,
        softcap=softcap,
        inv_temperature=inv_temperature,
        block_v=block_v,
    )
    return tuple(stats)


def softmax_row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_pz: torch.Tensor,
    coef_p: torch.Tensor,
    coef_target: torch.Tensor,
    coef_uniform: torch.Tensor,
    coef_entropy: torch.Tensor,
    *,
    softcap: float | None,
    inv_temperature: float,
    block_v: int | None = None,
) -> torch.Tensor:
    """Overwrite ``logits`` [C, V] with the gradient w.r.t. the raw logits (see module docstring)."""
    _launch_per_row(
        _softmax_row_grad_kernel,
        logits,
        targets,
        lse,
        mean_pz,
        coef_p,
        coef_target,
        coef_uniform,
        coef_entropy,
        softcap=softcap,
        inv_temperature=inv_temperature,
        block_v=block_v,
    )
    return logits
