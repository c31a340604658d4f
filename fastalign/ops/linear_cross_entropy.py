"""Cross-entropy and per-token log-probs straight from hidden states and the LM-head weight: the public
API, with its input checks.

``logits = hidden @ weight.T + bias`` is never materialised for all tokens: the tokens are walked in
chunks of C rows (``fastalign.ops.linear_cross_entropy_chunks``), each chunk's [C, V] logits are built,
reduced to per-token statistics (and, when a gradient is due, overwritten in place by the gradient w.r.t.
those logits), and dropped. Extra memory: one chunk's buffers (``chunk_size`` rows; by default as many as
fit the head workspace budget of ``fastalign.ops.head_workspace``: 256 MiB on CUDA, 32 MiB on CPU,
``workspace_bytes=`` per call) plus an fp32 weight-gradient accumulator when the weight is in a
low-precision dtype (the gradient is summed over chunks in fp32, never in bf16).

Ignored tokens (``targets == ignore_index``) contribute exact zeros everywhere, as with
``F.cross_entropy``: their hidden rows are zeroed before each chunk's matmul, so NaN/inf hidden states at
padding reach neither the loss, the per-token outputs, nor the gradients.

Each call checks everything it is given here, before any chunk runs: one ``ValueError`` naming the
argument, and at most one host sync for the checks of tensor values.
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal, NamedTuple

import torch

from fastalign.ops import validation
from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.chunked_head import input_grads_needed
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes
from fastalign.ops.linear_cross_entropy_chunks import (
    ChunkSpec,
    ScalarLossFunction,
    TokenObjective,
    TokenObjectiveFunction,
    TokenwiseFunction,
    logit_bytes,
    token_entropy,
)
from fastalign.ops.linear_cross_entropy_torch import LogitTransform, SoftmaxRowStats

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")


class LinearCrossEntropyStats(NamedTuple):
    """Per-token extras of ``linear_cross_entropy(..., return_stats=True)``, shaped like ``targets``.

    Detached (no gradient); 0 / False where the target is ignored.
    """

    lse: torch.Tensor  # log Σ exp(logits), fp32
    entropy: torch.Tensor  # entropy of softmax(logits), fp32
    #: argmax(logits) == target, bool: the first maximal logit, as ``torch.argmax`` (and TRL's token
    #: accuracy) picks it, so a target tied with an earlier token for the maximum is not counted
    accuracy: torch.Tensor
    #: mean over the vocabulary of the logits, fp32: TRL's ``logits/*`` metrics average it over tokens. The
    #: row sum comes with the softmax statistics (label smoothing needs it), so it costs no extra pass.
    mean_logit: torch.Tensor


class TokenObjectiveResult(NamedTuple):
    """What ``token_objective`` returns."""

    loss: torch.Tensor  # differentiable w.r.t. hidden, weight, bias
    logprobs: torch.Tensor  # shaped like targets, detached; 0 where ignored
    entropy: torch.Tensor  # shaped like targets, detached (0 unless return_entropy)
    aux: torch.Tensor  # the objective's auxiliary sums over all chunks


# --------------------------------------------------------------------------------------------------
# Input checks.


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


def prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    softcap: float | None,
    temperature: float,
    with_entropy: bool,
    chunk_size: int | None,
    backend: Backend,
    *,
    workspace_bytes: int | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    checks: validation.DeferredChecks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ChunkSpec]:
    """Validate everything (the caller's ``checks`` of tensor values too, in the call's one host sync);
    return hidden [N, D], targets [N] and the call's ``ChunkSpec``.

    The options every public op shares come positionally, in one order: each op passes them on as its
    signature lists them."""
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
    resolved = resolve_backend(backend, hidden)
    transform = LogitTransform(softcap, 1.0 / temperature)
    rows = budget_chunk_rows(weight, weight.dtype, resolved, transform, with_entropy, workspace_bytes)
    spec = ChunkSpec(
        backend=resolved,
        chunk_size=chunk_size or rows,
        ignore_index=ignore_index,
        transform=transform,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        with_entropy=with_entropy,
    )
    checks.raise_first()
    return flat_hidden, flat_targets, spec


def budget_chunk_rows(
    weight: torch.Tensor,
    dtype: torch.dtype,
    backend: Literal["triton", "torch"],
    transform: LogitTransform,
    with_entropy: bool,
    workspace_bytes: int | None = None,
) -> int:
    """Tokens per chunk of the head ``weight`` [V, D] run in ``dtype`` that keep one chunk's buffers
    (``logit_bytes``) within the workspace budget (``fastalign.ops.head_workspace``)."""
    budget = head_workspace_bytes(weight.device.type, workspace_bytes, weight)
    per_logit = logit_bytes(dtype, backend, transform, with_entropy, weight.device)
    return chunk_rows(weight.shape[0], per_logit, budget)


# --------------------------------------------------------------------------------------------------
# The public ops.


def _stats_for_user(
    stats: torch.Tensor, targets: torch.Tensor, spec: ChunkSpec, shape, vocab: int
) -> LinearCrossEntropyStats:
    fields = SoftmaxRowStats(*stats.detach())
    valid = targets != spec.ignore_index
    return LinearCrossEntropyStats(
        lse=torch.where(valid, fields.lse, 0.0).view(shape),
        entropy=token_entropy(fields, valid, spec).view(shape),
        accuracy=((fields.top1 > 0) & valid).view(shape),
        mean_logit=torch.where(valid, fields.sum_logits / vocab, 0.0).view(shape),
    )


def autocast_aware(op):
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


@autocast_aware
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
    workspace_bytes: int | None = None,
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
            count of the whole accumulated batch, so gradient accumulation is exact (as in transformers);
            any finite number >= 0 (transformers' ``Trainer`` may pass a fraction under tensor or context
            parallelism), 0 only with every target ignored (the loss is then 0, where transformers'
            is NaN).
        return_stats: also return detached per-token ``LinearCrossEntropyStats`` (lse, entropy, accuracy).
        chunk_size: tokens per logits chunk (default: as many as fit ``workspace_bytes``); larger
            chunks are faster and cost memory.
        workspace_bytes: the bytes one chunk's buffers may take (default: the process-wide budget of
            ``fastalign.ops.head_workspace``: ``set_head_workspace``, ``FASTALIGN_HEAD_WORKSPACE_MIB``,
            else 256 MiB on CUDA and 32 MiB on CPU); ignored when ``chunk_size`` is given.
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
        num_items_in_batch = _checked_divisor(num_items_in_batch, targets, ignore_index, checks)
    flat_hidden, flat_targets, spec = prepare(
        hidden,
        weight,
        targets,
        bias,
        ignore_index,
        softcap,
        temperature,
        return_stats,
        chunk_size,
        backend,
        workspace_bytes=workspace_bytes,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        checks=checks,
    )

    if reduction == "none":
        loss, _, stats = TokenwiseFunction.apply(flat_hidden, weight, bias, flat_targets, spec)
        loss = loss.view(targets.shape)
    else:
        scale = _mean_scale(flat_targets, ignore_index, num_items_in_batch) if reduction == "mean" else None
        scale = torch.ones((), device=hidden.device) if scale is None else scale
        needs = input_grads_needed(hidden, weight, bias)
        loss, stats = ScalarLossFunction.apply(flat_hidden, weight, bias, flat_targets, spec, scale, needs)
    if return_stats:
        return loss, _stats_for_user(stats, flat_targets, spec, targets.shape, weight.shape[0])
    return loss


def token_mean_scale(
    targets: torch.Tensor, ignore_index: int, num_items_in_batch: int | float | torch.Tensor | None
) -> torch.Tensor:
    """1 / the divisor of a token mean of a loss over ``targets`` (fp32 scalar), with
    ``linear_cross_entropy``'s rules: ``num_items_in_batch`` any finite count >= 0, 0 only without a
    target (then the scale, and the mean of nothing, is 0); else this call's target count. For a head
    that builds its logits (``fastalign.patching``'s fallback), so that it divides as the fused one."""
    checks = validation.DeferredChecks()
    if num_items_in_batch is not None:
        num_items_in_batch = _checked_divisor(num_items_in_batch, targets, ignore_index, checks)
    checks.raise_first()
    return _mean_scale(targets, ignore_index, num_items_in_batch)


def _checked_divisor(
    num_items_in_batch, targets: torch.Tensor, ignore_index: int, checks: validation.DeferredChecks
) -> int | float | torch.Tensor:
    """``num_items_in_batch`` as a divisor: its type checked now, its value (>= 0, 0 only where ``targets``
    has none to count) in ``checks``' one sync."""
    num_items_in_batch = validation.item_count("num_items_in_batch", num_items_in_batch, whole=False)
    divisor = torch.as_tensor(num_items_in_batch, device=targets.device)
    checks.divisor("num_items_in_batch", divisor, (targets != ignore_index).sum())
    return num_items_in_batch


def _mean_scale(
    targets: torch.Tensor, ignore_index: int, num_items_in_batch: int | torch.Tensor | None
) -> torch.Tensor:
    """1 / divisor of the mean: the non-ignored token count (at least 1) or ``num_items_in_batch``."""
    if num_items_in_batch is None:
        count = (targets != ignore_index).sum().clamp_min(1)
        return 1.0 / count.float()
    # checked >= 0 already, 0 only without a target (a tensor's value in the call's one sync): the loss is
    # then a sum of nothing, 0 with zero gradients as a mean over zero tokens is, not 0/0
    divisor = torch.as_tensor(num_items_in_batch, device=targets.device).float().reshape(())
    return torch.where(divisor > 0, 1.0 / divisor, torch.zeros_like(divisor))


@autocast_aware
def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    return_stats: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
    backend: Backend = "auto",
):
    """Per-token ``log softmax(logits / temperature)[target]`` without building the logits.

    Differentiable w.r.t. hidden, weight and bias for any upstream gradient per token (DPO and GRPO
    weight tokens differently); so is the entropy when ``return_entropy=True``.

    Returns:
        fp32 log-probs shaped like ``targets`` (0 where ``targets == ignore_index``), then the per-token
        entropy of the same distribution (0 where ignored) when ``return_entropy``, then the detached
        ``LinearCrossEntropyStats`` when ``return_stats`` (the metrics TRL logs of a preference batch:
        token accuracy, mean logit; from the statistics the sweep keeps anyway, no extra pass). Just
        the log-probs when neither is asked for.
    """
    flat_hidden, flat_targets, spec = prepare(
        hidden,
        weight,
        targets,
        bias,
        ignore_index,
        softcap,
        temperature,
        return_entropy,
        chunk_size,
        backend,
        workspace_bytes=workspace_bytes,
    )
    nll, entropy, stats = TokenwiseFunction.apply(flat_hidden, weight, bias, flat_targets, spec)
    logprobs = (-nll).view(targets.shape)
    outputs = (logprobs,)
    if return_entropy:
        outputs += (entropy.view(targets.shape),)
    if return_stats:
        outputs += (_stats_for_user(stats, flat_targets, spec, targets.shape, weight.shape[0]),)
    return outputs if len(outputs) > 1 else logprobs


@autocast_aware
def token_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    objective: TokenObjective,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
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
    flat_hidden, flat_targets, spec = prepare(
        hidden,
        weight,
        targets,
        bias,
        ignore_index,
        softcap,
        temperature,
        return_entropy,
        chunk_size,
        backend,
        workspace_bytes=workspace_bytes,
    )
    needs = input_grads_needed(hidden, weight, bias)
    loss, logprobs, entropy, aux = TokenObjectiveFunction.apply(
        flat_hidden, weight, bias, flat_targets, spec, objective, needs
    )
    return TokenObjectiveResult(loss, logprobs.view(targets.shape), entropy.view(targets.shape), aux)
