"""Elementwise ops that keep only their inputs for backward: the PyTorch backends' memory diet.

On CPU (and wherever the ``torch`` backend runs) RMSNorm and the gated activations are Hugging Face's
own arithmetic, op for op, so their values are the model's exactly. Run eagerly, autograd would keep
each op's intermediates until backward: RMSNorm its fp32 input and its normalised output, a gated MLP
``silu(gate)`` beside ``gate`` and ``up`` — per layer, one or two more [tokens, hidden] or
[tokens, intermediate] tensors than the inputs, which are the layer's largest activations after the
attention's. ``recompute_in_backward`` keeps the inputs only and, in backward, runs the same ops again
under autograd (in the autocast state of the forward) and differentiates them: the eager op's gradient,
bit for bit, for one more elementwise pass (a small fraction of a layer's matmuls).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _RecomputedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        device = inputs[0].device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wanted = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, wanted, strict=True)]
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            output = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(output, [t for t in inputs if t.requires_grad], grad))
        return None, *(next(grads) if t.requires_grad else None for t in inputs)


def recompute_in_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``, keeping only ``inputs`` for backward (see the module docstring). Without a
    gradient to compute (inference, frozen inputs) it is just ``fn(*inputs)``."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return fn(*inputs)
    return _RecomputedInBackward.apply(fn, *inputs)
