"""The divergence between a student's and a teacher's next-token distributions straight from their
hidden states and LM heads (knowledge distillation): the public op, its checks, and its chunk loop.

Neither model's [tokens, vocab] logits exist for the whole batch: the tokens are walked in chunks of C
rows; for each, both heads' [C, V] logits are built in fp32 (the teacher's never enter autograd), one row
kernel (``fastalign/kernels/linear_divergence.py``, or its PyTorch twin
``fastalign.ops.linear_divergence_torch``) reduces them to per-token divergence and cross-entropy and,
when a gradient is due, overwrites the student's logits with the gradient w.r.t. them, which two
matmuls turn into the gradients of the student's hidden states, weight and bias; then both are dropped.

- A scalar loss (``reduction='mean'|'sum'``) has its gradient formed in the forward pass and backward
  only scales it: the student's logits are built once (2·N·V·(3·Ds + Dt) FLOPs with the teacher's).
- ``reduction='none'`` takes an arbitrary upstream gradient per token: backward rebuilds both heads'
  logits (2·N·V·(4·Ds + 2·Dt) FLOPs in all).

The chunks, the fp32 accumulation of the gradients across them and the gradient-in-forward autograd
contract are ``fastalign.ops.chunked_head``'s, shared with ``fastalign.ops.linear_cross_entropy``.
With ``return_entropy`` the rows also give the student's entropy at the temperature (TRL's
DistillationTrainer ``entropy`` metric), one more running sum of their first pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from fastalign.ops import linear_divergence_torch as torch_rows
from fastalign.ops import validation
from fastalign.ops.backend import resolve_backend
from fastalign.ops.chunked_head import (
    GradientInForward,
    InputGrads,
    addmm_fp32_,
    input_grads_needed,
    loss_row_chunks,
    upcasts_for_fp32_sum,
)
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes
from fastalign.ops.linear_cross_entropy import REDUCTIONS, Reduction
from fastalign.ops.linear_cross_entropy_torch import softcap_, softcap_slope
from fastalign.ops.linear_divergence_torch import FORWARD_KL, GENERALIZED_JSD, REVERSE_KL, RowMath


@dataclass(frozen=True)
class DivergenceSpec:
    """How one call's chunks are built and reduced."""

    backend: Literal["triton", "torch"]
    chunk_size: int
    row_math: RowMath
    hard_label_weight: float
    student_softcap: float | None = None  # final-logit softcaps (Gemma-2's): s·tanh(logits/s)
    teacher_softcap: float | None = None


class _Constants(NamedTuple):
    """The inputs no gradient reaches, passed to the autograd Functions as one argument: the teacher's
    head (a constant of distillation, as in TRL), the labels and the mask of counted tokens."""

    teacher_hidden: torch.Tensor  # [N, Dt]
    teacher_weight: torch.Tensor  # [V, Dt]
    teacher_bias: torch.Tensor | None
    labels: torch.Tensor | None  # [N] long
    valid: torch.Tensor  # [N] bool


#: fp32 [C, V] buffers the PyTorch row math holds at its most next to the two heads' logits (both
#: log-softmaxes, p, and the divergence's temporaries; counted with the tracker of
#: tests/kernels/test_head_workspace.py).
_TORCH_ROW_BUFFERS = 7


def logit_bytes(
    dtype: torch.dtype, backend: Literal["triton", "torch"], device: torch.device, softcap: bool = False
) -> int:
    """Bytes a chunk holds at once per element of its [C, V] logits, for the workspace budget
    (``fastalign.ops.head_workspace``): both heads' fp32 logits, the gradient's copy in the student's
    dtype (low precision), its fp32 copy where the weight gradient's sum upcasts
    (``upcasts_for_fp32_sum``), the slope of the student's softcap (``softcap``), and the PyTorch row
    math's buffers."""
    size = 8 + (dtype.itemsize if dtype != torch.float32 else 0)
    size += 4 if upcasts_for_fp32_sum(device, dtype) else 0
    size += 4 if softcap else 0
    return size + (4 * _TORCH_ROW_BUFFERS if backend == "torch" else 0)


# --------------------------------------------------------------------------------------------------
# The chunk loop.


def _fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[C, V] logits in fp32, never rounded to the inputs' low precision: between close distributions
    the divergence is of the order of bf16's rounding of the logits (TRL's DistillationTrainer projects
    to fp32 for the same reason). On CUDA the matmul keeps its bf16/fp16 tensor-core inputs and writes
    fp32; elsewhere the chunk's operands are upcast."""
    if hidden.dtype == torch.float32:
        return F.linear(hidden, weight, bias)
    shape = (hidden.shape[0], weight.shape[0])
    if bias is None:
        logits = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    else:
        logits = bias.float().expand(shape).clone()
    addmm_fp32_(logits, hidden, weight.t())
    return logits


def _divergence_rows_(student_logits, teacher_logits, labels, coef_div, coef_ce, spec: DivergenceSpec):
    if spec.backend == "torch":
        return torch_rows.divergence_rows_(
            student_logits, teacher_logits, labels, coef_div, coef_ce, spec.row_math
        )
    from fastalign.kernels import linear_divergence as kernels

    return kernels.divergence_rows_(
        student_logits, teacher_logits, labels, coef_div, coef_ce, **spec.row_math._asdict()
    )


def _sweep(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    constants: _Constants,
    spec: DivergenceSpec,
    *,
    upstream: torch.Tensor | None = None,
    needs: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Walk the token chunks once.

    Returns the per-token loss ``(1 − w)·D + w·CE`` and the student's entropy (fp32 [N], 0 where not
    counted; the entropy 0 everywhere unless ``spec.row_math.with_entropy``) and the gradients w.r.t.
    (student hidden, weight, bias) of ``Σ upstream·loss`` (None for inputs not in ``needs``, all None
    without ``upstream``, which must be 0 at tokens not counted).
    """
    teacher_hidden, teacher_weight, teacher_bias, labels, valid = constants
    w = spec.hard_label_weight
    n = student_hidden.shape[0]
    token_loss = torch.zeros(n, dtype=torch.float32, device=student_hidden.device)
    entropy = torch.zeros(n, dtype=torch.float32, device=student_hidden.device)
    grads = (
        InputGrads(student_hidden, student_weight, student_bias, needs)
        if upstream is not None and any(needs)
        else None
    )
    for rows in loss_row_chunks(valid, spec.chunk_size)[1]:
        hidden_chunk = student_hidden[rows]
        teacher_logits = softcap_(
            _fp32_logits(teacher_hidden[rows], teacher_weight, teacher_bias), spec.teacher_softcap
        )
        student_logits = softcap_(
            _fp32_logits(hidden_chunk, student_weight, student_bias), spec.student_softcap
        )
        # the softcap's slope 1 − (z/s)², for the chain rule once the rows hold the gradient w.r.t. z
        slope = None
        if grads is not None and spec.student_softcap is not None:
            slope = softcap_slope(student_logits, spec.student_softcap)
        coef_div = coef_ce = None
        if grads is not None:
            coef_div = (1.0 - w) * upstream[rows]
            coef_ce = w * upstream[rows] if w else None
        # The rows read labels only for the cross-entropy, which needs them: ``valid`` stands in.
        chunk_labels = labels[rows] if labels is not None else valid[rows]
        div, ce, chunk_entropy = _divergence_rows_(
            student_logits, teacher_logits, chunk_labels, coef_div, coef_ce, spec
        )
        token_loss[rows] = (1.0 - w) * div + w * ce
        if spec.row_math.with_entropy:
            entropy[rows] = chunk_entropy
        if grads is not None:
            if slope is not None:
                student_logits.mul_(slope)
            # The gradient matmuls run in the student's dtype (tensor cores); the sums stay fp32.
            grads.add_chunk(rows, student_logits.to(student_weight.dtype), hidden_chunk, student_weight)
        # Drop this chunk's buffers before the next one is allocated: one chunk alive, not two.
        del student_logits, teacher_logits, slope
    finished = grads.finish(student_weight, student_bias) if grads is not None else (None,) * 3
    return token_loss, entropy, finished


# --------------------------------------------------------------------------------------------------
# The autograd Functions.


class _ScalarDivergence(GradientInForward):
    """Σ_i upstream_i·loss_i with its gradient formed in the forward pass (``upstream``: the mean's
    1/count or 1 at counted tokens, 0 elsewhere), and the per-token entropy."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, constants, spec, upstream, needs):
        token_loss, entropy, grads = _sweep(
            student_hidden, student_weight, student_bias, constants, spec, upstream=upstream, needs=needs
        )
        ctx.grads = grads
        ctx.mark_non_differentiable(entropy)
        return (token_loss * upstream).sum(), entropy


class _TokenwiseDivergence(torch.autograd.Function):
    """Per-token losses (and entropies); backward rebuilds both heads' logits for its upstream gradient."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, constants: _Constants, spec):
        token_loss, entropy, _ = _sweep(student_hidden, student_weight, student_bias, constants, spec)
        ctx.save_for_backward(student_hidden, student_weight, student_bias, *constants)
        ctx.spec = spec
        ctx.mark_non_differentiable(entropy)
        return token_loss, entropy

    @staticmethod
    def backward(ctx, grad_token_loss, _grad_entropy):
        student_hidden, student_weight, student_bias, *constants = ctx.saved_tensors
        constants = _Constants(*constants)
        # torch.where, not a product: an upstream gradient that is NaN at a left-out token is dropped.
        upstream = torch.where(constants.valid, grad_token_loss.float(), 0.0)
        _, _, grads = _sweep(
            student_hidden,
            student_weight,
            student_bias,
            constants,
            ctx.spec,
            upstream=upstream,
            needs=tuple(ctx.needs_input_grad[:3]),
        )
        return *grads, None, None


# --------------------------------------------------------------------------------------------------
# Input checks.


def _check_head(prefix: str, hidden, weight, bias) -> None:
    """``{prefix}_hidden`` [..., D], ``{prefix}_weight`` [V, D] and ``{prefix}_bias`` [V]: one float dtype."""
    names = (f"{prefix}_hidden", f"{prefix}_weight", f"{prefix}_bias")
    for name, tensor in zip(names, (hidden, weight, bias), strict=True):
        validation.require_tensor(name, tensor, optional=name == names[2])
    if not hidden.is_floating_point():
        raise ValueError(f"{names[0]} must be a floating-point tensor, got dtype {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError(f"{names[0]} must have shape [..., D], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"{names[1]} must have shape [V, D], got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{names[0]}'s last dimension ({hidden.shape[-1]}) must equal {names[1]}'s D "
            f"({weight.shape[1]}); got {names[0]} {tuple(hidden.shape)} and {names[1]} {tuple(weight.shape)}"
        )
    if weight.shape[1] == 0:
        raise ValueError(f"{names[0]} {tuple(hidden.shape)} has no features (D = 0)")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{names[1]} dtype {weight.dtype} must match {names[0]} dtype {hidden.dtype}")
    if bias is not None:
        if bias.shape != weight.shape[:1]:
            raise ValueError(
                f"{names[2]} must have shape [V] = ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != hidden.dtype:
            raise ValueError(f"{names[2]} dtype {bias.dtype} must match {names[0]} dtype {hidden.dtype}")


def _check_pair(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, tensors) -> None:
    """The two heads, the labels and their devices agree."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            "the student and teacher heads must share a vocabulary: student_weight "
            f"{tuple(student_weight.shape)} and teacher_weight {tuple(teacher_weight.shape)} differ in V"
        )
    if student_weight.shape[0] == 0:
        raise ValueError("student_weight has an empty vocabulary (V = 0)")
    tokens = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != tokens:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} and student_hidden {tuple(student_hidden.shape)} "
            "must have the same leading (token) dimensions"
        )
    if labels is not None:
        validation.require_tensor("labels", labels)
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
        if labels.shape != tokens:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal student_hidden's leading dimensions "
                f"{tuple(tokens)}"
            )
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != student_hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but student_hidden is on {student_hidden.device}")
    if math.prod(tokens) == 0:
        raise ValueError(f"empty input: student_hidden has shape {tuple(student_hidden.shape)} (no tokens)")


def _row_math(beta, temperature, hard_label_weight, ignore_index, labels, with_entropy) -> RowMath:
    beta = validation.real("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    temperature = validation.positive_finite("temperature", temperature)
    hard_label_weight = validation.real("hard_label_weight", hard_label_weight)
    if not 0.0 <= hard_label_weight <= 1.0:
        raise ValueError(f"hard_label_weight must be in [0, 1], got {hard_label_weight}")
    if hard_label_weight > 0 and labels is None:
        raise ValueError(f"hard_label_weight={hard_label_weight} needs labels for its cross-entropy")
    mode = FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else GENERALIZED_JSD
    jsd = mode == GENERALIZED_JSD
    return RowMath(
        mode=mode,
        beta=beta,
        log_1m_beta=math.log1p(-beta) if jsd else 0.0,
        log_beta=math.log(beta) if jsd else 0.0,
        inv_temperature=1.0 / temperature,
        ignore_index=validation.integer("ignore_index", ignore_index),
        with_ce=hard_label_weight > 0,
        with_entropy=bool(with_entropy),
    )


def _check_label_range(labels: torch.Tensor, ignore_index: int, vocab: int) -> None:
    """Label ids the cross-entropy reads must be in the vocabulary (one host sync on a GPU)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))

    def message() -> str:
        position = int(bad.nonzero()[0, 0])
        return (
            f"labels[{position}] (flattened) = {int(labels[position])} is outside the vocabulary "
            f"[0, {vocab}) and is not ignore_index ({ignore_index})"
        )

    checks = validation.DeferredChecks()
    checks.add(bad.any(), message)
    checks.raise_first()


# --------------------------------------------------------------------------------------------------
# The public op.


def linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    backend: str | None = None,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
    return_entropy: bool = False,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """TRL's generalized JSD between the student's and the teacher's next-token distributions, from
    their hidden states and LM heads, without building either model's logits for all tokens.

    Per token, with ``p = softmax(student_logits / T)``, ``q = softmax(teacher_logits / T)`` and
    ``m = (1 − β)·p + β·q``: ``D = β·KL(q ‖ m) + (1 − β)·KL(p ‖ m)``; β = 0 is the forward
    KL(q ‖ p), β = 1 the reverse KL(p ‖ q). This equals ``GKDTrainer.generalized_jsd_loss`` (TRL 1.16)
    on the [N, V] logits, and the divergence of TRL's ``DistillationTrainer``. The token's loss is
    ``(1 − w)·D + w·CE`` with ``CE`` the cross-entropy of the student's logits at temperature 1
    against ``labels`` (w = ``hard_label_weight``; no T² factor, as in TRL).

    Args:
        student_hidden: [..., Ds] the student's final hidden states (fp32, bf16 or fp16).
        student_weight: [V, Ds] the student's LM head, in ``student_hidden``'s dtype.
        teacher_hidden: [..., Dt] the teacher's, same leading dimensions (Dt may differ from Ds, and
            the teacher's dtype from the student's).
        teacher_weight: [V, Dt] the teacher's LM head (same vocabulary).
        labels: [...] token ids; tokens equal to ``ignore_index`` are left out of everything (loss,
            count, gradients). None: every token counts (then ``hard_label_weight`` must be 0). The ids
            are only read (and range-checked) when ``hard_label_weight > 0``.
        beta: in [0, 1], TRL's ``beta``.
        temperature: both heads' logits are divided by it before the divergence.
        hard_label_weight: w in [0, 1].
        student_bias, teacher_bias: optional [V] head biases.
        reduction: 'mean' over counted tokens (TRL's "batchmean" over the mask; 0 when none count),
            'sum', or 'none' (shaped like ``labels``, 0 at tokens left out).
        backend: 'auto' or None (Triton on CUDA, PyTorch elsewhere), 'triton' or 'torch'.
        chunk_size: tokens per chunk (default: as many as keep a chunk's buffers, ``logit_bytes``
            per element, within ``workspace_bytes``).
        workspace_bytes: the bytes one chunk's buffers may take (default: the process-wide budget of
            ``fastalign.ops.head_workspace``); ignored when ``chunk_size`` is given.
        return_entropy: also return the student's per-token entropy at ``temperature``,
            −Σ p·log p (fp32, shaped like ``labels``, 0 at tokens left out; no gradient): TRL's
            DistillationTrainer ``entropy`` metric, from the rows' first pass at no extra matmul.
        student_softcap, teacher_softcap: each model's final-logit softcap (Gemma-2's
            ``final_logit_softcapping``): its logits are ``s·tanh(logits/s)`` before anything else.

    Returns:
        The fp32 loss (with ``return_entropy``: the loss and the entropy). Gradients reach the
        student's hidden states, weight and bias; the teacher is a constant (nothing flows to
        teacher_hidden, teacher_weight or teacher_bias, as in TRL).
        For a scalar loss the gradients are formed in this call, so one backward is allowed.

    Inside an autocast region both heads run in the autocast dtype, as ``F.linear`` would.
    """
    validation.require_tensor("student_hidden", student_hidden)
    device_type = student_hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(tensor):
            return tensor.to(dtype) if isinstance(tensor, torch.Tensor) else tensor

        with torch.autocast(device_type, enabled=False):
            return linear_divergence(
                *map(cast, (student_hidden, student_weight, teacher_hidden, teacher_weight)),
                labels,
                beta=beta,
                temperature=temperature,
                hard_label_weight=hard_label_weight,
                student_bias=cast(student_bias),
                teacher_bias=cast(teacher_bias),
                ignore_index=ignore_index,
                reduction=reduction,
                backend=backend,
                chunk_size=chunk_size,
                workspace_bytes=workspace_bytes,
                return_entropy=return_entropy,
                student_softcap=student_softcap,
                teacher_softcap=teacher_softcap,
            )

    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    row_math = _row_math(beta, temperature, hard_label_weight, ignore_index, labels, return_entropy)
    _check_head("student", student_hidden, student_weight, student_bias)
    _check_head("teacher", teacher_hidden, teacher_weight, teacher_bias)
    tensors = {
        "student_weight": student_weight,
        "teacher_hidden": teacher_hidden,
        "teacher_weight": teacher_weight,
        "labels": labels,
        "student_bias": student_bias,
        "teacher_bias": teacher_bias,
    }
    _check_pair(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, tensors)
    if chunk_size is not None:
        chunk_size = validation.positive_int("chunk_size", chunk_size, "a positive number of tokens")
    caps = {
        name: None if cap is None else validation.positive_finite(name, cap)
        for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap))
    }
    vocab = student_weight.shape[0]
    resolved = resolve_backend("auto" if backend is None else backend, student_hidden)
    if chunk_size is None:
        budget = head_workspace_bytes(student_hidden.device.type, workspace_bytes, student_weight)
        per_logit = logit_bytes(
            student_weight.dtype, resolved, student_hidden.device, student_softcap is not None
        )
        chunk_size = chunk_rows(vocab, per_logit, budget)
    spec = DivergenceSpec(
        backend=resolved,
        chunk_size=chunk_size,
        row_math=row_math,
        hard_label_weight=float(hard_label_weight),
        **caps,
    )

    tokens = student_hidden.shape[:-1]
    flat_labels = None
    if labels is not None:
        flat_labels = labels.reshape(-1).long().contiguous()
        if row_math.with_ce:
            _check_label_range(flat_labels, row_math.ignore_index, vocab)
        valid = flat_labels != row_math.ignore_index
    else:
        valid = torch.ones(math.prod(tokens), dtype=torch.bool, device=student_hidden.device)
    constants = _Constants(
        teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]).contiguous(),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
        flat_labels,
        valid,
    )
    flat_hidden = student_hidden.reshape(-1, student_hidden.shape[-1]).contiguous()

    if reduction == "none":
        loss, entropy = _TokenwiseDivergence.apply(flat_hidden, student_weight, student_bias, constants, spec)
        loss = loss.view(tokens)
    else:
        upstream = valid.float()
        if reduction == "mean":
            upstream = upstream / valid.sum().clamp_min(1)
        needs = input_grads_needed(student_hidden, student_weight, student_bias)
        loss, entropy = _ScalarDivergence.apply(
            flat_hidden, student_weight, student_bias, constants, spec, upstream, needs
        )
    return (loss, entropy.view(tokens)) if return_entropy else loss
