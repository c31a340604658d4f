"""Triton rotary position embedding, forward and backward, for q and k in one launch.

With the model's own ``cos``/``sin`` [B or 1, S, R] (R = rotary dim ≤ head dim; whatever scaling the
model's rotary embedding applied is already in them) and x split as (x1, x2, pass) = (x[:R/2],
x[R/2:R], x[R:]):

    forward:   y1 = x1·c1 − x2·s1,   y2 = x2·c2 + x1·s2,   pass unchanged
    backward:  dx1 = dy1·c1 + dy2·s2,   dx2 = dy2·c2 − dy1·s1   (the transposed rotation)

This is Hugging Face's ``q·cos + rotate_half(q)·sin`` (c1 = c2 and s1 = s2 there, but nothing here
relies on it). One program per (batch, position) rotates every q and k head of that token, so GQA head
counts (Hq ≠ Hk) and any strides of q, k ([B, H, S, D], unit stride in D) are fine; position_ids
(packed sequences restarting positions) only enter through cos/sin. Floor: memory traffic, reading and
writing q and k once (plus cos/sin, shared across heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, sx_b, sx_h, sx_s, sy_b, sy_h, sy_s, b, s, n_heads, c1, c2, s1, s2,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    x_base = x_ptr + b * sx_b + s * sx_s + heads * sx_h
    y_base = y_ptr + b * sy_b + s * sy_s + heads * sy_h
    x1 = tl.load(x_base + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_base + dims, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_base + HALF + dims, y2.to(y_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:
        rest = tl.arange(0, BLOCK_PASS)[None, :]
        rest_mask = (heads < n_heads) & (rest < PASS)
        kept = tl.load(x_base + 2 * HALF + rest, mask=rest_mask, other=0.0)
        tl.store(y_base + 2 * HALF + rest, kept, mask=rest_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s, sc_b, sc_s,
    S, HQ, HK,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    s = token % S
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < HALF
    cs_base = b * sc_b + s * sc_s
    c1 = tl.load(cos_ptr + cs_base + dims, mask=dim_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_base + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs_base + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_base + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, sq_b, sq_h, sq_s, sqo_b, sqo_h, sqo_s, b, s, HQ, c1, c2, s1, s2,
        HALF, PASS, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, BACKWARD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, sk_b, sk_h, sk_s, sko_b, sko_h, sko_s, b, s, HK, c1, c2, s1, s2,
        HALF, PASS, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, BACKWARD,
    )  # fmt: skip


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hk, S, D] (or their gradients, ``backward=True``) by cos/sin
    [B or 1, S, R]; outputs have the inputs' strides."""
    batch, heads_q, seq, head_dim = q.shape
    heads_k = k.shape[1]
    rotary = cos.shape[-1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    cos_b = cos.stride(0) if cos.shape[0] > 1 else 0
    half, passed = rotary // 2, head_dim - rotary
    _rope_kernel[(batch * seq,)](
        q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_b, cos.stride(1), seq, heads_q, heads_k,
        HALF=half, PASS=passed,
        BLOCK_HQ=triton.next_power_of_2(heads_q), BLOCK_HK=triton.next_power_of_2(heads_k),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(max(passed, 1)),
        BACKWARD=backward,
    )  # fmt: skip
    return q_out, k_out
