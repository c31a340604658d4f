"""``autocast_linear``: a linear layer under autocast that keeps no low-precision copy of its weight.

Under ``torch.autocast`` (bf16 or fp16 over fp32 weights: single-process mixed precision), ``F.linear``
casts the weight to bf16 and that copy is what the matmul saves for backward (autocast also caches it
for the rest of the forward). So from the forward to the end of the backward a whole bf16 copy of the
model's linear weights is alive next to the fp32 ones: +2 bytes per parameter (16 GB for an 8B model;
on SmolLM2-135M 203 MiB of a 3.9 GB step). A frozen weight (LoRA's base layer) is cast per call and its
copy saved the same way.

Here the forward casts the weight, multiplies and drops the copy; the backward casts it again from the
weight itself (which the model holds anyway): a cast, i.e. one read of the weight and one write of the
copy, per layer and backward, against a saved copy per layer for the whole step. The arithmetic is
autocast's: the same casts of input, weight and bias, the same low-precision matmuls (the input
gradient ``grad · W``, the weight gradient ``gradᵀ · x`` rounded to the low precision, then widened to
the weight's dtype, as autocast's cast back does; the bias gradient likewise).

The input's cast is shared: q, k and v (gate and up) read one normalized tensor, and autocast casts
it, and saves the cast, once per projection; here consecutive calls on the same unmodified tensor reuse
the last call's cast while an earlier projection keeps it for backward (``_cast_input``), so one
low-precision copy is saved instead of three (two). The values are the same casts, so outputs and
gradients are unchanged. As autograd's matmul does, the input is kept only for the weight's gradient:
a frozen weight's projection (LoRA's base layers) keeps none, and casts its input itself. (Until
2026-11-25 it kept it regardless: on SmolLM2-135M a bf16 DPO LoRA step saved 2,154 MiB for backward,
now 1,784.)
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

#: (input, its version, dtype, its cast) of the last ``_cast_input``, all weak: a reused cast is one that
#: is still alive (saved for backward by an earlier projection).
_last_cast: tuple[weakref.ref, int, torch.dtype, weakref.ref] | None = None


def _cast_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, or the previous call's cast when ``x`` is the same tensor, unmodified since
    (its version), and that cast is still alive."""
    global _last_cast
    if x.dtype == dtype:
        return x
    if _last_cast is not None:
        source, version, cast_dtype, cast = _last_cast
        low = cast() if source() is x and version == x._version and cast_dtype == dtype else None
        if low is not None:
            return low
    low = x.to(dtype)
    _last_cast = (weakref.ref(x), x._version, dtype, weakref.ref(low))
    return low


def cast_linear(x_low: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """Autocast's projection of ``x_low`` (already in ``dtype``): the weight and bias cast to ``dtype``,
    autocast off, no cast kept (``cast_linear_backward`` casts the weight again)."""
    with torch.autocast(x_low.device.type, enabled=False):
        return F.linear(x_low, weight.to(dtype), None if bias is None else bias.to(dtype))


def cast_linear_backward(
    grad_out: torch.Tensor,
    x_low: torch.Tensor,
    weight: torch.Tensor,
    bias_dtype: torch.dtype | None,
    dtype: torch.dtype,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``cast_linear`` that ``needs`` asks for, as autocast forms them: w.r.t. its input
    (in ``dtype``, shaped like it), its weight (in ``dtype``, widened to the weight's) and its bias
    (widened to ``bias_dtype``; None without a bias)."""
    needs_x, needs_weight, needs_bias = needs
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
    grad_x = flat_grad.mm(weight.to(dtype)).view(*grad_out.shape[:-1], -1) if needs_x else None
    grad_weight = (
        flat_grad.t().mm(x_low.reshape(-1, x_low.shape[-1])).to(weight.dtype) if needs_weight else None
    )
    grad_bias = flat_grad.sum(0).to(bias_dtype) if needs_bias and bias_dtype is not None else None
    return grad_x, grad_weight, grad_bias


class _AutocastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x_low = _cast_input(x, dtype)
        # The input is read only by the weight's gradient: a frozen weight (LoRA's base layer) keeps none.
        ctx.save_for_backward(x_low if ctx.needs_input_grad[1] else None, weight)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, dtype)
        return cast_linear(x_low, weight, bias, dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_low, weight = ctx.saved_tensors
        x_dtype, bias_dtype, dtype = ctx.dtypes
        grad_x, grad_weight, grad_bias = cast_linear_backward(
            grad_out, x_low, weight, bias_dtype, dtype, ctx.needs_input_grad[:3]
        )
        return None if grad_x is None else grad_x.to(x_dtype), grad_weight, grad_bias, None


def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as autocast runs it, without the saved low-precision weight copy
    (see the module docstring). Outside autocast, or where nothing needs a gradient, it is ``F.linear``."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    dtype = torch.get_autocast_dtype(device)
    if not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return F.linear(x, weight, bias)
    return _AutocastLinear.apply(x, weight, bias, dtype)
