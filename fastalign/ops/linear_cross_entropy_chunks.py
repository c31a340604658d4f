"""The chunk engine behind ``fastalign.ops.linear_cross_entropy``: the sweep over token chunks and the
autograd Functions built on it. Inputs arrive checked and flattened (hidden [N, D], targets [N]).

For each chunk of C rows, ``_sweep`` builds the [C, V] logits, reduces them to per-token statistics (and,
when a gradient is due, overwrites them in place by the gradient w.r.t. those logits, which two matmuls
turn into the gradients of hidden, weight and bias), and drops them. Two autograd paths share it:

- scalar loss (``reduction='mean'|'sum'``) and ``token_objective``: the gradient is formed during the
  forward pass (the upstream gradient of a scalar is a single number applied in backward), so the
  logits are built once: 6·N·V·D FLOPs in all.
- per-token outputs (``reduction='none'``, ``token_logprobs``) take an arbitrary upstream gradient per
  token: forward keeps only per-token statistics, backward rebuilds each chunk's logits: 8·N·V·D FLOPs.

The chunks, the fp32 accumulation of the input gradients and the gradient-in-forward autograd contract
are ``fastalign.ops.chunked_head``'s (shared with ``fastalign.ops.linear_divergence``). The row math
(softmax statistics, gradient of the logits) runs as Triton kernels
(``fastalign/kernels/linear_cross_entropy.py``) or as their PyTorch twin
(``fastalign/ops/linear_cross_entropy_torch.py``); everything else, including the matmuls (cuBLAS / CPU
BLAS), is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fastalign.ops import linear_cross_entropy_torch as torch_rows
from fastalign.ops.chunked_head import GradientInForward, InputGrads, loss_row_chunks, upcasts_for_fp32_sum
from fastalign.ops.linear_cross_entropy_torch import GradCoefficients, LogitTransform, SoftmaxRowStats


@dataclass(frozen=True)
class ChunkSpec:
    """How each chunk's logits are formed, transformed and reduced; fixed for one call."""

    backend: Literal["triton", "torch"]
    chunk_size: int
    ignore_index: int
    transform: LogitTransform
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    with_entropy: bool = False  # per-token entropy wanted (costs the PyTorch path one more buffer)


def logit_bytes(
    dtype: torch.dtype,
    backend: Literal["triton", "torch"],
    transform: LogitTransform,
    with_entropy: bool,
    device: torch.device,
) -> int:
    """Bytes a chunk holds at once per element of its [C, V] logits, for the workspace budget
    (``fastalign.ops.head_workspace``): the logits (the Triton kernels and the PyTorch path both turn
    them into their gradient in place), plus the PyTorch path's fp32 buffers at their most: the
    transformed logits when they are a copy (low precision, temperature or softcap), the transform's
    temporaries (one for a temperature, two for a softcap's tanh), and with entropy the exp buffer's
    copy and the entropy gradient's two temporaries; plus the fp32 copy of the gradient chunk where the
    weight gradient's fp32 sum upcasts (``upcasts_for_fp32_sum``: off CUDA, low precision)."""
    size = dtype.itemsize
    if backend == "torch":
        identity = transform.softcap is None and transform.inv_temperature == 1.0
        buffers = int(dtype != torch.float32 or not identity)
        buffers += 2 if transform.softcap is not None else int(transform.inv_temperature != 1.0)
        buffers += 3 if with_entropy else 0
        size += 4 * buffers
    if upcasts_for_fp32_sum(device, dtype):
        size += 4
    return size


# --------------------------------------------------------------------------------------------------
# Row operations: one dispatch point per backend.


def row_stats(
    logits: torch.Tensor, targets: torch.Tensor, spec: ChunkSpec
) -> tuple[SoftmaxRowStats, torch.Tensor | None]:
    """Row statistics, and the PyTorch path's exp buffer for ``row_grad_`` (None for Triton)."""
    if spec.backend == "torch":
        return torch_rows.softmax_row_stats(
            logits, targets, spec.ignore_index, spec.transform, spec.with_entropy
        )
    from fastalign.kernels import linear_cross_entropy as kernels

    stats = kernels.softmax_row_stats(
        logits, targets, ignore_index=spec.ignore_index, **spec.transform._asdict()
    )
    return SoftmaxRowStats(*stats), None


def row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: SoftmaxRowStats,
    coefs: GradCoefficients,
    spec: ChunkSpec,
    workspace: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient w.r.t. the chunk's raw logits, in their dtype (may reuse ``logits``' storage)."""
    if spec.backend == "torch":
        return torch_rows.softmax_row_grad_(
            logits, targets, stats, coefs, spec.ignore_index, spec.transform, workspace
        )
    from fastalign.kernels import linear_cross_entropy as kernels

    zeros = torch.zeros_like(coefs.p)
    return kernels.softmax_row_grad_(
        logits,
        targets,
        stats.lse,
        stats.mean_pz,
        coefs.p,
        coefs.target,
        zeros if coefs.uniform is None else coefs.uniform,
        zeros if coefs.entropy is None else coefs.entropy,
        **spec.transform._asdict(),
    )


# --------------------------------------------------------------------------------------------------
# The chunk loop.


#: ``coefficients(rows, stats)``: the gradient weights of one chunk's rows (a slice of the flattened
#: tokens, or their indices when ignored tokens were left out).
CoefficientFn = Callable[[slice | torch.Tensor, SoftmaxRowStats], GradCoefficients]


def _sweep(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    spec: ChunkSpec,
    *,
    coefficients: CoefficientFn | None = None,
    needs: tuple[bool, bool, bool] = (False, False, False),
    saved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple]:
    """Walk the token chunks once.

    Returns the per-token statistics as a [6, N] fp32 tensor (fields of ``SoftmaxRowStats``; ``saved``
    when given, which skips computing them) and the gradients w.r.t. (hidden, weight, bias) of
    ``Σ outputs`` weighted by ``coefficients`` (None for inputs not in ``needs``; ``coefficients`` is
    not called when nothing is needed).
    """
    n = hidden.shape[0]
    every_row, row_chunks = loss_row_chunks(targets != spec.ignore_index, spec.chunk_size)
    # rows no chunk covers (ignored tokens) keep statistics of 0
    fill = torch.empty if every_row else torch.zeros
    fields = len(SoftmaxRowStats._fields)
    all_stats = fill((fields, n), dtype=torch.float32, device=hidden.device) if saved is None else saved
    grads = InputGrads(hidden, weight, bias, needs) if coefficients is not None and any(needs) else None
    for rows in row_chunks:
        targets_chunk = targets[rows]
        hidden_chunk = hidden[rows]
        logits = F.linear(hidden_chunk, weight, bias)
        if saved is None:
            stats, workspace = row_stats(logits, targets_chunk, spec)
            all_stats[:, rows] = torch.stack(stats)
        else:
            stats, workspace = SoftmaxRowStats(*saved[:, rows]), None
        if grads is not None:
            coefs = coefficients(rows, stats)
            grad_logits = row_grad_(logits, targets_chunk, stats, coefs, spec, workspace)
            workspace = None  # the exp buffer, once the gradient is in the logits: freed before the matmuls
            grads.add_chunk(rows, grad_logits, hidden_chunk, weight)
            del grad_logits
        # Drop this chunk's buffers before the next one is allocated: one chunk alive, not two.
        del logits, workspace
    return all_stats, (grads.finish(weight, bias) if grads is not None else (None, None, None))


# --------------------------------------------------------------------------------------------------
# Per-token outputs from the statistics, and the gradient weights of the loss.


def _token_loss(stats: SoftmaxRowStats, valid: torch.Tensor, spec: ChunkSpec, vocab: int) -> torch.Tensor:
    """Per-token (1−ε)·(lse − z_t) + ε·(lse − mean z) + ζ·lse², 0 where ignored."""
    lse = stats.lse
    loss = lse - (1.0 - spec.label_smoothing) * stats.target_logit
    if spec.label_smoothing:
        loss = loss - spec.label_smoothing / vocab * stats.sum_logits
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    return torch.where(valid, loss, 0.0)


def token_entropy(stats: SoftmaxRowStats, valid: torch.Tensor, spec: ChunkSpec) -> torch.Tensor:
    """Per-token entropy lse − Σ p·z, 0 where ignored (all 0 unless ``spec.with_entropy``)."""
    if not spec.with_entropy:
        return torch.zeros_like(stats.lse)
    return torch.where(valid, stats.lse - stats.mean_pz, 0.0)


def _loss_coefficients(
    loss_grad: torch.Tensor,
    entropy_grad: torch.Tensor | None,
    stats: SoftmaxRowStats,
    spec: ChunkSpec,
    vocab: int,
) -> GradCoefficients:
    """Gradient weights of Σ loss_grad·token_loss + Σ entropy_grad·entropy (see the kernel docstring)."""
    coef_p = loss_grad * (1.0 + 2.0 * spec.z_loss * stats.lse) if spec.z_loss else loss_grad
    return GradCoefficients(
        p=coef_p,
        target=-(1.0 - spec.label_smoothing) * loss_grad,
        uniform=-spec.label_smoothing / vocab * loss_grad if spec.label_smoothing else None,
        entropy=entropy_grad,
    )


# --------------------------------------------------------------------------------------------------
# The autograd Functions.


class ScalarLossFunction(GradientInForward):
    """Sum of per-token cross-entropy losses times ``scale``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: ChunkSpec, scale: torch.Tensor, needs):
        valid = targets != spec.ignore_index
        vocab = weight.shape[0]
        upstream = valid * scale

        def coefficients(rows: slice, stats: SoftmaxRowStats) -> GradCoefficients:
            return _loss_coefficients(upstream[rows], None, stats, spec, vocab)

        stats, grads = _sweep(hidden, weight, bias, targets, spec, coefficients=coefficients, needs=needs)
        # Not a view (callers scale it in place).
        loss = _token_loss(SoftmaxRowStats(*stats), valid, spec, vocab).sum() * scale
        ctx.grads = grads
        ctx.mark_non_differentiable(stats)
        return loss, stats


#: ``objective(rows, logprobs)`` → (its loss over those tokens, ∂loss/∂logprobs, auxiliary sums): a
#: loss made of per-token terms, each a function of that token's log-prob only.
TokenObjective = Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class TokenObjectiveFunction(GradientInForward):
    """Σ over chunks of ``objective`` applied to the chunk's log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: ChunkSpec, objective: TokenObjective, needs):
        valid = targets != spec.ignore_index
        logprobs = torch.zeros(targets.shape[0], dtype=torch.float32, device=hidden.device)
        totals: list[torch.Tensor] = []

        def evaluate(rows: slice, stats: SoftmaxRowStats) -> torch.Tensor:
            logprobs[rows] = torch.where(valid[rows], stats.target_logit - stats.lse, 0.0)
            loss, d_logprobs, aux = objective(rows, logprobs[rows])
            totals.append(torch.cat([loss.reshape(1), aux.reshape(-1)]))
            return torch.where(valid[rows], d_logprobs, 0.0)

        def coefficients(rows: slice, stats: SoftmaxRowStats) -> GradCoefficients:
            upstream = evaluate(rows, stats)  # log p_t = z_t − lse: ∂/∂z = δ_t − p
            return GradCoefficients(p=-upstream, target=upstream, uniform=None, entropy=None)

        stats, grads = _sweep(hidden, weight, bias, targets, spec, coefficients=coefficients, needs=needs)
        if not totals:  # nothing differentiated (or no loss token): the objective once, over all tokens
            evaluate(slice(0, targets.shape[0]), SoftmaxRowStats(*stats))
        total = torch.stack(totals).sum(dim=0)
        entropy = token_entropy(SoftmaxRowStats(*stats), valid, spec)
        ctx.grads = grads
        ctx.mark_non_differentiable(logprobs, entropy, total)
        return total[0].clone(), logprobs, entropy, total[1:]


class TokenwiseFunction(torch.autograd.Function):
    """Per-token losses and entropies; backward rebuilds the logits (8·N·V·D) of the rows with an upstream
    gradient (the others: 2·N·V·D, forward only)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: ChunkSpec):
        stats, _ = _sweep(hidden, weight, bias, targets, spec)
        fields = SoftmaxRowStats(*stats)
        valid = targets != spec.ignore_index
        token_loss = _token_loss(fields, valid, spec, weight.shape[0])
        entropy = token_entropy(fields, valid, spec)
        ctx.save_for_backward(hidden, weight, bias, targets, stats)
        ctx.spec = spec
        ctx.mark_non_differentiable(stats)
        return token_loss, entropy, stats

    @staticmethod
    def backward(ctx, grad_token_loss, grad_entropy, _grad_stats):
        hidden, weight, bias, targets, stats = ctx.saved_tensors
        spec: ChunkSpec = ctx.spec
        valid = targets != spec.ignore_index
        # torch.where, not a product: an upstream gradient that is NaN at an ignored token is dropped.
        loss_grad = (
            torch.where(valid, grad_token_loss.float(), 0.0)
            if grad_token_loss is not None
            else torch.zeros_like(stats[0])
        )
        # Without with_entropy the entropy output is a constant 0 and its gradient is ignored.
        entropy_grad = (
            torch.where(valid, grad_entropy.float(), 0.0)
            if spec.with_entropy and grad_entropy is not None
            else None
        )

        def coefficients(rows: slice, row_stats: SoftmaxRowStats) -> GradCoefficients:
            return _loss_coefficients(
                loss_grad[rows],
                None if entropy_grad is None else entropy_grad[rows],
                row_stats,
                spec,
                weight.shape[0],
            )

        # A row whose upstream gradients are all 0 adds nothing to any gradient: it is left out of the
        # sweep as an ignored token is (no [V, D] matmul rebuilds its logits). TRL's fused head on CPU
        # scores every position and zeroes the masked ones' outputs (a prompt's rows, padding).
        active = loss_grad != 0
        if entropy_grad is not None:
            active |= entropy_grad != 0
        swept = torch.where(active, targets, spec.ignore_index)
        needs = ctx.needs_input_grad[:3]
        _, grads = _sweep(
            hidden, weight, bias, swept, spec, coefficients=coefficients, needs=needs, saved=stats
        )
        return *grads, None, None
