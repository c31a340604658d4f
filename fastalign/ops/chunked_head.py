"""What every chunked LM-head op shares (``fastalign.ops.linear_cross_entropy``'s chunk engine,
``fastalign.ops.linear_divergence``): the token chunks, the fp32 accumulation of the head's input
gradients across them, and the autograd contract of a scalar whose gradients the forward pass forms.

Such an op walks the tokens in chunks of C rows; for each it builds the chunk's [C, V] logits, reduces
them to per-token values and, when a gradient is due, overwrites them with the gradient w.r.t. those
logits, which two matmuls turn into the gradients of the hidden states, weight and bias
(``InputGrads.add_chunk``). The weight and bias gradients are sums over every chunk: they are kept in
fp32 (``addmm_fp32_``), whatever the inputs' dtype, and cast once at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch


def chunks(n: int, chunk_size: int) -> Iterator[slice]:
    """The row slices of ``n`` tokens in chunks of ``chunk_size`` (the last may be shorter)."""
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


def loss_row_chunks(valid: torch.Tensor, chunk_size: int) -> tuple[bool, list[slice | torch.Tensor]]:
    """The chunks of the rows where ``valid`` [N] holds, and whether that is every row.

    Only loss tokens are swept: a prompt, padding or other ignored row costs no [V, D] matmul, and
    whatever it holds (NaN/inf hidden states at padding, say) reaches neither a loss nor a gradient
    (0·NaN would be NaN). With every row valid the chunks are plain slices (no gather, no scatter);
    otherwise each is a tensor of row indices. One host sync (the count of valid rows)."""
    rows = valid.nonzero().squeeze(1)
    if rows.numel() == valid.numel():
        return True, list(chunks(rows.numel(), chunk_size))
    return False, [rows[span] for span in chunks(rows.numel(), chunk_size)]


@functools.cache
def _cuda_mixed_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(fp32, low, low, out_dtype=fp32)`` runs and is right on this device."""
    a = torch.randn(16, 8, device=device).to(dtype)
    b = torch.randn(8, 16, device=device).to(dtype)
    acc = torch.ones(16, 16, device=device)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-3)


def upcasts_for_fp32_sum(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm_fp32_`` copies its ``dtype`` operands to fp32 on ``device`` (the chunk's
    gradient, 4 bytes per element more, which the workspace budget counts)."""
    if dtype == torch.float32:
        return False
    return not (device.type == "cuda" and _cuda_mixed_addmm_works(device, dtype))


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with an fp32 ``acc``: bf16 tensor-core math where the device can, never a
    low-precision sum across calls."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif upcasts_for_fp32_sum(a.device, a.dtype):
        acc.addmm_(a.float(), b.float())
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


class InputGrads:
    """Gradients of hidden [N, D], weight [V, D] and bias [V], filled chunk by chunk (only those in
    ``needs``); the weight's and bias's are fp32 sums until ``finish``."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]):
        # zeros: rows that no chunk covers (ignored tokens left out of the sweep) have no gradient
        self.hidden = torch.zeros_like(hidden) if needs[0] else None
        self.weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        )
        self.bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs[2] else None
        )

    def add_chunk(self, rows: slice | torch.Tensor, grad_logits, hidden_chunk, weight) -> None:
        """Add the chunk ``rows``' share (a slice of the rows, or their indices) from the gradient
        w.r.t. its logits [C, V]."""
        if self.hidden is not None:
            if isinstance(rows, slice):
                torch.mm(grad_logits, weight, out=self.hidden[rows])
            else:
                self.hidden.index_copy_(0, rows, torch.mm(grad_logits, weight))
        if self.weight is not None:
            addmm_fp32_(self.weight, grad_logits.t(), hidden_chunk)
        if self.bias is not None:
            self.bias += grad_logits.sum(dim=0, dtype=torch.float32)

    def finish(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """(hidden, weight, bias) gradients in their inputs' dtypes, None where not needed."""
        grad_weight = None if self.weight is None else self.weight.to(weight.dtype)
        grad_bias = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, grad_weight, grad_bias


def input_grads_needed(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) a forward-formed gradient must be computed for (asked before
    ``Function.apply``: inside ``forward`` gradients are off)."""
    grad_on = torch.is_grad_enabled()
    return (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )


class GradientInForward(torch.autograd.Function):
    """A scalar whose gradients w.r.t. (hidden, weight, bias) the forward pass already formed (the
    logits are built once: 6·N·V·D for a cross-entropy); backward only scales them by the upstream
    gradient.

    Subclasses' forward takes (hidden, weight, bias, then four non-differentiable inputs), stores the
    gradients in ``ctx.grads`` and returns (loss, *non-differentiable extras).
    """

    @staticmethod
    def backward(ctx, grad_loss, *_grad_extras):
        if ctx.grads is None:
            raise RuntimeError(
                "fastalign: a second backward through the same fused loss (retain_graph=True) is not "
                "supported: its gradients are formed in forward and were handed out by the first "
                "backward. Compute the loss again instead."
            )
        grads, ctx.grads = ctx.grads, None
        # In place: a [V, D] temporary here would add a full weight-sized buffer to the peak.
        scaled = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None for g in grads]
        return *scaled, None, None, None, None
