"""Cross-entropy and per-token log-probs straight from hidden states and the LM-head weight.

``logits = hidden @ weight.T + bias`` is never materialised for all tokens: the tokens are walked in
chunks of C rows, each chunk's [C, V] logits are built, reduced to per-token statistics (and, when a
gradient is due, overwritten in place by the gradient w.r.t. those logits), and dropped. Extra memory:
one logits chunk (``chunk_size``; by default 32 MiB of logits on CPU, 1 GiB on CUDA) plus an fp32
weight-gradient accumulator when the weight is in a low-precision dtype (the gradient is summed over
chunks in fp32, never in bf16).

Two autograd paths share the chunk loop ``_sweep``:

- scalar loss (``reduction='mean'|'sum'``) with gradients enabled: the gradient is formed during the
  forward pass (the upstream gradient of a scalar is a single number applied in backward), so the
  logits are built once: 6·N·V·D FLOPs in all.
- per-token outputs (``reduction='none'``, ``token_logprobs``) take an arbitrary upstream gradient per
  token: forward keeps only per-token statistics, backward rebuilds each chunk's logits: 8·N·V·D FLOPs.

Ignored tokens (``targets == ignore_index``) contribute exact zeros everywhere, as with
``F.cross_entropy``: their hidden rows are zeroed before each chunk's matmul, so NaN/inf hidden states at
padding reach neither the loss, the per-token outputs, nor the gradients.

The row math (softmax statistics, gradient of the logits) runs as Triton kernels
(``fastalign/kernels/linear_cross_entropy.py``) or as PyTorch (``fastalign/ops/softmax_rows.py``);
everything else, including the matmuls (cuBLAS / CPU BLAS), is shared.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from fastalign.ops import softmax_rows, validation
from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.softmax_rows import GradCoefficients, SoftmaxRowStats

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")

#: Default size of one chunk of logits, in bytes of the logits' dtype. Each chunk adds the fp32 weight
#: gradient's read-modify-write (8·V·D bytes) to its 6·rows·V·D FLOPs, so a chunk must have enough rows
#: for the matmuls to hide it: rows ≳ 8·FLOP/s / (6·bytes/s) / overhead. CPU (~0.2 TFLOP/s, ~10 GB/s):
#: 32 MiB keeps the PyTorch path near the matmul floor. CUDA (H100: ~700 TFLOP/s, ~3 TB/s, so ~3000
#: rows for 10 %): 1 GiB; 64 MiB chunks (256 rows at V=128k) measured 2.9× the floor on an H100
#: (benchmarks/RESULTS.md). Pass ``chunk_size`` to trade speed for memory.
DEFAULT_CHUNK_BYTES = {"cpu": 32 * 2**20, "cuda": 2**30}


class LinearCrossEntropyStats(NamedTuple):
    """Per-token extras of ``linear_cross_entropy(..., return_stats=True)``, shaped like ``targets``.

    Detached (no gradient); 0 / False where the target is ignored.
    """

    lse: torch.Tensor  # log Σ exp(logits), fp32
    entropy: torch.Tensor  # entropy of softmax(logits), fp32
    accuracy: torch.Tensor  # argmax(logits) == target, bool


@dataclass(frozen=True)
class _Spec:
    """How each chunk's logits are formed, transformed and reduced; fixed for one call."""

    backend: Literal["triton", "torch"]
    chunk_size: int
    ignore_index: int
    softcap: float | None
    inv_temperature: float
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    with_entropy: bool = False  # per-token entropy wanted (costs the PyTorch path one more buffer)


# --------------------------------------------------------------------------------------------------
# Row operations: one dispatch point per backend.


def _row_stats(
    logits: torch.Tensor, targets: torch.Tensor, spec: _Spec
) -> tuple[SoftmaxRowStats, torch.Tensor | None]:
    """Row statistics, and the PyTorch path's exp buffer for ``_row_grad_`` (None for Triton)."""
    kwargs = dict(ignore_index=spec.ignore_index, softcap=spec.softcap, inv_temperature=spec.inv_temperature)
    if spec.backend == "torch":
        return softmax_rows.softmax_row_stats(logits, targets, with_entropy=spec.with_entropy, **kwargs)
    from fastalign.kernels import linear_cross_entropy as kernels

    return SoftmaxRowStats(*kernels.softmax_row_stats(logits, targets, **kwargs)), None


def _row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: SoftmaxRowStats,
    coefs: GradCoefficients,
    spec: _Spec,
    workspace: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient w.r.t. the chunk's raw logits, in their dtype (may reuse ``logits``' storage)."""
    if spec.backend == "torch":
        return softmax_rows.softmax_row_grad_(
            logits,
            targets,
            stats,
            coefs,
            ignore_index=spec.ignore_index,
            softcap=spec.softcap,
            inv_temperature=spec.inv_temperature,
            exp=workspace,
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
        softcap=spec.softcap,
        inv_temperature=spec.inv_temperature,
    )


# --------------------------------------------------------------------------------------------------
# Gradient accumulation across chunks.


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


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with an fp32 ``acc``: bf16 tensor-core math where the device can, never a
    low-precision sum across calls."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and _cuda_mixed_addmm_works(a.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


class _InputGrads:
    """Gradients of hidden [N, D], weight [V, D] and bias [V], filled chunk by chunk."""

    def __init__(self, hidden, weight, bias, needs: tuple[bool, bool, bool]):
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        )
        self.bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs[2] else None
        )

    def add_chunk(self, rows: slice, grad_logits, hidden_chunk, weight) -> None:
        if self.hidden is not None:
            torch.mm(grad_logits, weight, out=self.hidden[rows])
        if self.weight is not None:
            _addmm_fp32_(self.weight, grad_logits.t(), hidden_chunk)
        if self.bias is not None:
            self.bias += grad_logits.sum(dim=0, dtype=torch.float32)

    def finish(self, weight: torch.Tensor, bias: torch.Tensor | None):
        grad_weight = None if self.weight is None else self.weight.to(weight.dtype)
        grad_bias = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, grad_weight, grad_bias


# --------------------------------------------------------------------------------------------------
# The chunk loop.


def _chunks(n: int, chunk_size: int) -> Iterator[slice]:
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


CoefficientFn = Callable[[slice, SoftmaxRowStats], GradCoefficients]


def _sweep(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    spec: _Spec,
    *,
    coefficients: CoefficientFn | None = None,
    needs: tuple[bool, bool, bool] = (False, False, False),
    saved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple]:
    """Walk the token chunks once.

    Returns the per-token statistics as a [5, N] fp32 tensor (fields of ``SoftmaxRowStats``; ``saved``
    when given, which skips computing them) and the gradients w.r.t. (hidden, weight, bias) of
    ``Σ outputs`` weighted by ``coefficients`` (None for inputs not in ``needs``; ``coefficients`` is
    not called when nothing is needed).
    """
    n = hidden.shape[0]
    all_stats = torch.empty((5, n), dtype=torch.float32, device=hidden.device) if saved is None else saved
    grads = _InputGrads(hidden, weight, bias, needs) if coefficients is not None and any(needs) else None
    for rows in _chunks(n, spec.chunk_size):
        targets_chunk = targets[rows]
        # Ignored rows are zeroed before the matmul: whatever they hold (NaN/inf hidden states at padding,
        # say) must not reach the loss, the statistics or the weight gradient (0·NaN is NaN). A [C, D]
        # select per chunk, next to the chunk's [C, V] matmuls.
        hidden_chunk = torch.where((targets_chunk != spec.ignore_index)[:, None], hidden[rows], 0)
        logits = F.linear(hidden_chunk, weight, bias)
        if saved is None:
            stats, workspace = _row_stats(logits, targets_chunk, spec)
            for dst, src in zip(all_stats[:, rows], stats, strict=True):
                dst.copy_(src)
        else:
            stats, workspace = SoftmaxRowStats(*saved[:, rows]), None
        if grads is not None:
            coefs = coefficients(rows, stats)
            grad_logits = _row_grad_(logits, targets_chunk, stats, coefs, spec, workspace)
            grads.add_chunk(rows, grad_logits, hidden_chunk, weight)
            del grad_logits
        # Drop this chunk's buffers before the next one is allocated: one chunk alive, not two.
        del logits, workspace
    return all_stats, (grads.finish(weight, bias) if grads is not None else (None, None, None))


def _token_loss(stats: SoftmaxRowStats, valid: torch.Tensor, spec: _Spec, vocab: int) -> torch.Tensor:
    """Per-token (1−ε)·(lse − z_t) + ε·(lse − mean z) + ζ·lse², 0 where ignored."""
    lse = stats.lse
    loss = lse - (1.0 - spec.label_smoothing) * stats.target_logit
    if spec.label_smoothing:
        loss = loss - spec.label_smoothing / vocab * stats.sum_logits
    if spec.z_loss:
        loss = loss + spec.z_loss * lse * lse
    return torch.where(valid, loss, 0.0)


def _entropy(stats: SoftmaxRowStats, valid: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Per-token entropy lse − Σ p·z, 0 where ignored (all 0 unless ``spec.with_entropy``)."""
    if not spec.with_entropy:
        return torch.zeros_like(stats.lse)
    return torch.where(valid, stats.lse - stats.mean_pz, 0.0)


def _loss_coefficients(
    loss_grad: torch.Tensor,
    entropy_grad: torch.Tensor | None,
    stats: SoftmaxRowStats,
    spec: _Spec,
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


class _GradientInForward(torch.autograd.Function):
    """A scalar whose gradients w.r.t. (hidden, weight, bias) the forward pass already formed (the
    logits are built once: 6·N·V·D); backward only scales them by the upstream gradient.

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


class _ScalarLossFunction(_GradientInForward):
    """Sum of per-token cross-entropy losses times ``scale``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _Spec, scale: torch.Tensor, needs):
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


class _TokenObjectiveFunction(_GradientInForward):
    """Σ over chunks of ``objective`` applied to the chunk's log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _Spec, objective: TokenObjective, needs):
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
        if not any(needs):  # nothing to differentiate: the objective once, over all tokens
            evaluate(slice(0, targets.shape[0]), SoftmaxRowStats(*stats))
        total = torch.stack(totals).sum(dim=0)
        entropy = _entropy(SoftmaxRowStats(*stats), valid, spec)
        ctx.grads = grads
        ctx.mark_non_differentiable(logprobs, entropy, total)
        return total[0].clone(), logprobs, entropy, total[1:]


class _TokenwiseFunction(torch.autograd.Function):
    """Per-token losses and entropies; backward rebuilds the logits (8·N·V·D)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: _Spec):
        stats, _ = _sweep(hidden, weight, bias, targets, spec)
        fields = SoftmaxRowStats(*stats)
        valid = targets != spec.ignore_index
        token_loss = _token_loss(fields, valid, spec, weight.shape[0])
        entropy = _entropy(fields, valid, spec)
        ctx.save_for_backward(hidden, weight, bias, targets, stats)
        ctx.spec = spec
        ctx.mark_non_differentiable(stats)
        return token_loss, entropy, stats

    @staticmethod
    def backward(ctx, grad_token_loss, grad_entropy, _grad_stats):
        hidden, weight, bias, targets, stats = ctx.saved_tensors
        spec: _Spec = ctx.spec
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

        needs = ctx.needs_input_grad[:3]
        _, grads = _sweep(
            hidden, weight, bias, targets, spec, coefficients=coefficients, needs=needs, saved=stats
        )
        return *grads, None, None


# --------------------------------------------------------------------------------------------------
# Validation and the public API.


def _validate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    checks: validation.DeferredChecks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes, dtypes and devices; return hidden [N, D] and targets [N]. The target range is
    added to ``checks`` (its values cost a host sync on a GPU)."""
    for name, tensor in (("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)):
        validation.require_tensor(name, tensor, optional=name == "bias")
    validation.integer("ignore_index", ignore_index)
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., D], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, D], got {tuple(weight.shape)}")
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal weight's D ({dim}); "
            f"got hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if dim == 0:
        raise ValueError(
            f"hidden size D is 0: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} have no "
            "features"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if bias is not None:
        if bias.shape != (vocab,):
            raise ValueError(f"bias must have shape [V] = ({vocab},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match hidden dtype {hidden.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of token ids, got dtype {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading dimensions "
            f"{tuple(hidden.shape[:-1])}"
        )
    for name, tensor in (("weight", weight), ("targets", targets), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but hidden is on {hidden.device}")
    if targets.numel() == 0:
        raise ValueError(f"empty input: hidden has shape {tuple(hidden.shape)} (no tokens)")
    if vocab == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")

    # Out-of-range ids are an error on every device: the Triton kernels would read outside the row
    # (garbage logits) and torch's gather would hit a device-side assert on CUDA. Checking costs one
    # host sync per call, shared with every other value check of the call (``DeferredChecks``).
    flat_targets = targets.reshape(-1).long()
    out_of_range = (flat_targets != ignore_index) & ((flat_targets < 0) | (flat_targets >= vocab))

    def out_of_range_message() -> str:
        position = int(out_of_range.nonzero()[0, 0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(position), targets.shape))
        return (
            f"targets{list(index)} = {int(flat_targets[position])} is outside the vocabulary "
            f"[0, {vocab}) and is not ignore_index ({ignore_index})"
        )

    checks.add(out_of_range.any(), out_of_range_message)
    return hidden.reshape(-1, dim).contiguous(), flat_targets.contiguous()


def _prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    backend: Backend,
    chunk_size: int | None,
    ignore_index: int,
    softcap: float | None,
    temperature: float,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    with_entropy: bool = False,
    checks: validation.DeferredChecks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, _Spec]:
    """Validate everything (the caller's ``checks`` of tensor values too, in the call's one host sync);
    return hidden [N, D], targets [N] and the call's ``_Spec``."""
    checks = validation.DeferredChecks() if checks is None else checks
    flat_hidden, flat_targets = _validate(hidden, weight, targets, bias, ignore_index, checks)
    temperature = validation.positive_finite("temperature", temperature)
    if softcap is not None:
        softcap = validation.positive_finite("softcap", softcap)
    label_smoothing = validation.real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    z_loss = validation.real("z_loss", z_loss)
    if not z_loss >= 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if chunk_size is not None:
        chunk_size = validation.positive_int("chunk_size", chunk_size, "a positive number of tokens")
    spec = _Spec(
        backend=resolve_backend(backend, hidden),
        chunk_size=chunk_size or default_chunk_size(weight.shape[0], weight.dtype, weight.device),
        ignore_index=ignore_index,
        softcap=softcap,
        inv_temperature=1.0 / temperature,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        with_entropy=with_entropy,
    )
    checks.raise_first()
    return flat_hidden, flat_targets, spec


def default_chunk_size(vocab_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk so that one chunk of logits takes at most ``DEFAULT_CHUNK_BYTES[device]``."""
    budget = DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["cpu"])
    rows = max(1, budget // (vocab_size * dtype.itemsize))
    return rows - rows % 16 if rows >= 16 else rows  # tensor-core friendly multiples of 16


def _stats_for_user(
    stats: torch.Tensor, targets: torch.Tensor, spec: _Spec, shape
) -> LinearCrossEntropyStats:
    fields = SoftmaxRowStats(*stats)
    valid = targets != spec.ignore_index
    return LinearCrossEntropyStats(
        lse=torch.where(valid, fields.lse, 0.0).view(shape),
        entropy=_entropy(fields, valid, spec).view(shape),
        accuracy=((fields.target_logit >= fields.max_logit) & valid).view(shape),
    )


def _autocast_aware(op):
    """Inside an autocast region, run the op as ``F.linear`` would run the head there: hidden states,
    weight and bias cast to the autocast dtype (the casts carry the gradients back to fp32 weights),
    and autocast off inside, where the chunk loop sets every dtype itself."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden")
        if not isinstance(hidden, torch.Tensor) or not torch.is_autocast_enabled(hidden.device.type):
            return op(*args, **kwargs)  # a non-tensor is reported by the op's own checks
        device_type = hidden.device.type
        bound = signature.bind(*args, **kwargs)
        dtype = torch.get_autocast_dtype(device_type)
        for name in ("hidden", "weight", "bias"):
            if isinstance(bound.arguments.get(name), torch.Tensor):
                bound.arguments[name] = bound.arguments[name].to(dtype)
        with torch.autocast(device_type, enabled=False):
            return op(*bound.args, **bound.kwargs)

    return wrapper


@_autocast_aware
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_stats: bool = False,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, LinearCrossEntropyStats]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` without building the logits.

    Equal to ``F.cross_entropy((softcap·tanh(logits/softcap)) / temperature, targets, ...)`` (softcap
    applied first, as Gemma-2 does before a sampler's temperature) plus ``z_loss · lse²`` per token.

    Args:
        hidden: [..., D] hidden states (fp32, bf16 or fp16).
        weight: [V, D] LM-head weight, same dtype as ``hidden``.
        targets: [...] integer token ids in [0, V) or ``ignore_index``.
        bias: optional [V] LM-head bias.
        reduction: 'mean' (over non-ignored tokens, or over ``num_items_in_batch``), 'sum' or 'none'.
        num_items_in_batch: divisor of the 'mean' instead of this call's token count: the loss-token
            count of the whole accumulated batch, so gradient accumulation is exact (as in transformers).
        return_stats: also return detached per-token ``LinearCrossEntropyStats`` (lse, entropy, accuracy).
        chunk_size: tokens per logits chunk (default: ``DEFAULT_CHUNK_BYTES`` of logits); larger chunks
            are faster and cost memory.
        backend: 'auto' (Triton on CUDA, PyTorch elsewhere), 'triton' or 'torch'.

    Returns:
        fp32 loss: a scalar, or shaped like ``targets`` for ``reduction='none'`` (0 at ignored tokens).
        A mean over zero tokens is 0, with zero gradients.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    checks = validation.DeferredChecks()
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(f"num_items_in_batch only applies to reduction='mean', got {reduction!r}")
        num_items_in_batch = validation.item_count("num_items_in_batch", num_items_in_batch)
        if isinstance(num_items_in_batch, torch.Tensor):
            checks.positive("num_items_in_batch", num_items_in_batch)
    flat_hidden, flat_targets, spec = _prepare(
        hidden,
        weight,
        targets,
        bias,
        backend=backend,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        softcap=softcap,
        temperature=temperature,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        with_entropy=return_stats,
        checks=checks,
    )

    if reduction == "none":
        loss, _, stats = _TokenwiseFunction.apply(flat_hidden, weight, bias, flat_targets, spec)
        loss = loss.view(targets.shape)
    else:
        scale = _mean_scale(flat_targets, ignore_index, num_items_in_batch) if reduction == "mean" else None
        scale = torch.ones((), device=hidden.device) if scale is None else scale
        needs = _input_grads_needed(hidden, weight, bias)
        loss, stats = _ScalarLossFunction.apply(flat_hidden, weight, bias, flat_targets, spec, scale, needs)
    if return_stats:
        return loss, _stats_for_user(stats, flat_targets, spec, targets.shape)
    return loss


def _input_grads_needed(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) a forward-formed gradient must be computed for."""
    grad_on = torch.is_grad_enabled()
    return (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )


def _mean_scale(
    targets: torch.Tensor, ignore_index: int, num_items_in_batch: int | torch.Tensor | None
) -> torch.Tensor:
    """1 / divisor of the mean: the non-ignored token count (at least 1) or ``num_items_in_batch``."""
    if num_items_in_batch is None:
        count = (targets != ignore_index).sum().clamp_min(1)
        return 1.0 / count.float()
    # checked > 0 already (a tensor's value in the call's one sync)
    divisor = torch.as_tensor(num_items_in_batch, device=targets.device).float()
    return 1.0 / divisor.reshape(())


@_autocast_aware
def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log softmax(logits / temperature)[target]`` without building the logits.

    Differentiable w.r.t. hidden, weight and bias for any upstream gradient per token (DPO and GRPO
    weight tokens differently); so is the entropy when ``return_entropy=True``.

    Returns:
        fp32 log-probs shaped like ``targets`` (0 where ``targets == ignore_index``), and the per-token
        entropy of the same distribution (0 where ignored) when ``return_entropy``.
    """
    flat_hidden, flat_targets, spec = _prepare(
        hidden,
        weight,
        targets,
        bias,
        backend=backend,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        softcap=softcap,
        temperature=temperature,
        with_entropy=return_entropy,
    )
    nll, entropy, _ = _TokenwiseFunction.apply(flat_hidden, weight, bias, flat_targets, spec)
    logprobs = (-nll).view(targets.shape)
    if return_entropy:
        return logprobs, entropy.view(targets.shape)
    return logprobs


class TokenObjectiveResult(NamedTuple):
    loss: torch.Tensor  # differentiable w.r.t. hidden, weight, bias
    logprobs: torch.Tensor  # shaped like targets, detached; 0 where ignored
    entropy: torch.Tensor  # shaped like targets, detached (0 unless return_entropy)
    aux: torch.Tensor  # the objective's auxiliary sums over all chunks


@_autocast_aware
def token_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    objective: TokenObjective,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> TokenObjectiveResult:
    """A loss Σ_t f_t(log p_t) of per-token log-probs, with its gradient formed in the forward pass.

    For objectives whose every term depends on one token's log-prob (GRPO at token level, for
    example), the logits are built once (6·N·V·D) instead of twice as with ``token_logprobs`` and a
    separate backward (8·N·V·D). ``objective(rows, logprobs)`` sees the flattened token indices
    ``rows`` of one chunk and their log-probs, and returns (loss over those tokens, ∂loss/∂logprobs,
    a 1-D tensor of auxiliary sums); losses and sums are added over chunks. Ignored tokens reach the
    objective with log-prob 0 and their gradient is dropped: the objective should weight them 0.
    """
    flat_hidden, flat_targets, spec = _prepare(
        hidden, weight, targets, bias, backend=backend, chunk_size=chunk_size, ignore_index=ignore_index,
        softcap=softcap, temperature=temperature, with_entropy=return_entropy,
    )  # fmt: skip
    needs = _input_grads_needed(hidden, weight, bias)
    loss, logprobs, entropy, aux = _TokenObjectiveFunction.apply(
        flat_hidden, weight, bias, flat_targets, spec, objective, needs
    )
    return TokenObjectiveResult(loss, logprobs.view(targets.shape), entropy.view(targets.shape), aux)
