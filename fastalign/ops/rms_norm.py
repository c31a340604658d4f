"""RMSNorm: ``fastalign.ops.rms_norm`` dispatch and its PyTorch reference.

Two casting conventions, matching Hugging Face: ``gemma=False`` (Llama, Mistral, Qwen, Phi-3) normalises
in fp32, casts to the input dtype and multiplies by the weight (output dtype: the promotion of input and
weight dtypes); ``gemma=True`` (Gemma 1/2/3) computes ``x̂ · (1 + w)`` in fp32 and casts to the input
dtype. The Triton kernel is in ``fastalign/kernels/rms_norm.py``.
"""

from __future__ import annotations

import functools

import torch

from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.recompute import recompute_in_backward


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> torch.Tensor:
    """The PyTorch implementation (and the CPU backend): Hugging Face's arithmetic, op for op."""
    x32 = x.float()
    x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (x_hat * (1.0 + weight.float())).type_as(x)
    return weight * x_hat.to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool):
        from fastalign.kernels import rms_norm as kernels

        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
        y, rstd = kernels.rms_norm_forward(x2d, weight, eps, gemma, out_dtype)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.gemma = gemma
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        from fastalign.kernels import rms_norm as kernels

        x2d, weight, rstd = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        dx, dw = kernels.rms_norm_backward(dy2d, x2d, weight, rstd, ctx.gemma)
        return dx.view(dy.shape), dw.to(weight.dtype), None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    gemma: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm of ``x`` [..., D] with ``weight`` [D]; see the module docstring for ``gemma``."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape [D] = ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if resolve_backend(backend, x) == "torch":  # the reference's values, keeping only x for backward
        return recompute_in_backward(functools.partial(rms_norm_reference, eps=eps, gemma=gemma), x, weight)
    return _RMSNormFunction.apply(x, weight, float(eps), gemma)
