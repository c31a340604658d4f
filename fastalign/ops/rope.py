"""Rotary position embedding of q and k: ``fastalign.ops.apply_rotary_pos_emb`` and its reference.

Same contract as Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: q [B, Hq, S, D],
k [B, Hk, S, D], and the cos/sin [B or 1, S, R] that the model's rotary embedding computed from
``position_ids`` (so rope scaling variants and packed sequences keep working). R < D rotates only the
first R dimensions (partial rotary, as Phi-3 variants do). The Triton kernel is in
``fastalign/kernels/rope.py``.
"""

from __future__ import annotations

import torch

from fastalign.ops.backend import Backend, resolve_backend


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch implementation (and the CPU backend): Hugging Face's arithmetic."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        return torch.cat(((x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass), dim=-1)

    return rotate(q), rotate(k)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from fastalign.kernels import rope as kernels

        ctx.save_for_backward(cos, sin)
        return kernels.rope(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        from fastalign.kernels import rope as kernels

        cos, sin = ctx.saved_tensors
        dq, dk = kernels.rope(_unit_last_stride(dq), _unit_last_stride(dk), cos, sin, backward=True)
        return dq, dk, None, None


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the model's cos/sin; differentiable w.r.t. q and k (cos/sin carry no grad)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q and k must be [B, H, S, D] with equal B, S, D; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    rotary = cos.shape[-1]
    if (
        cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[1] != q.shape[2]
        or cos.shape[0] not in (1, q.shape[0])
    ):
        raise ValueError(
            f"cos and sin must be [B or 1, S, R] with S = {q.shape[2]}; "
            f"got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if rotary % 2 or rotary > q.shape[-1]:
        raise ValueError(
            f"the rotary dimension R = {rotary} must be even and at most the head dim {q.shape[-1]}"
        )
    if resolve_backend(backend, q) == "torch":
        return rope_reference(q, k, cos, sin)
    return _RopeFunction.apply(
        _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(cos), _unit_last_stride(sin)
    )
