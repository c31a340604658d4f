"""Distillation from a teacher's top-k log-probs (offline or served), fused with the student's LM head,
and the teacher's side of it: its top-k log-probs straight from its hidden states and head.

``linear_sparse_divergence`` is TRL 1.16's ``ServerDistillationTrainer`` loss (``trl.experimental.
server_distillation``): the divergence between the student's and the teacher's distributions restricted
to a sparse support of a few token ids per position (the teacher's top-k; for β > 0 TRL's top-1 and the
completion's own token). Each side's log-probs at the support are renormalised over it (no tail) or
completed by a (k+1)-th bucket holding the rest of the mass, ``log(1 − Σ exp(top-k))`` (``add_tail``:
``_add_tail_bucket``), and the generalized JSD of TRL's ``_jsd_divergence`` (β 0: forward KL(teacher ‖
student)) is taken over that support. ``sparse_divergence_rows`` below is that math, written as TRL
writes it, on [C, K] tensors.

The student's log-probs at the support need its log-sum-exp over the whole vocabulary: the tokens are
walked in chunks of C rows (``fastalign.ops.chunked_head``); for each, the chunk's [C, V] logits are
built in fp32, reduced to the log-sum-exp and the logits at the K support ids, the sparse divergence and
its gradient w.r.t. those K + 1 numbers are taken with autograd on the small [C, K] tensors, and the
gradient w.r.t. the logits, ``g_lse·softmax + scatter(g_support)``, formed in place in the logits' one
buffer (4 bytes per logit of an fp32 head, as ``linear_cross_entropy``'s chunk: the same chunk size),
becomes the gradients of the hidden states, weight and bias by two matmuls (gradient in forward, as
``linear_cross_entropy``: the logits are built once, 6·N·V·D FLOPs, an SFT step's head).
No [N, V] tensor exists.

``linear_topk_logprobs`` is the teacher's scoring pass: per token, its top-k token ids and log-probs at a
temperature, the log of the mass outside them and the log-prob of a given token (the completion's),
walking the tokens in chunks and each chunk's vocabulary in slices, with a running merge of the top-k
and an online log-sum-exp: at most one [C, V_slice] block of logits at a time. Optionally also M draws
from the tail (outside the top-k), which ``tail_sample_support`` turns into a support whose loss has
full-logit distillation's gradient in expectation (fastalign's, not TRL's: see there).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fastalign.ops import validation
from fastalign.ops.chunked_head import (
    GradientInForward,
    InputGrads,
    input_grads_needed,
    loss_row_chunks,
    upcasts_for_fp32_sum,
)
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes
from fastalign.ops.linear_cross_entropy import autocast_aware
from fastalign.ops.linear_cross_entropy_torch import exp_with_dot_, softcap_, softcap_slope
from fastalign.ops.linear_divergence import _fp32_logits

#: TRL's clamp of the top-k mass's log below 0 (``_add_tail_bucket``): the tail stays a real log.
TAIL_CLAMP = -1e-7


# --------------------------------------------------------------------------------------------------
# The sparse math (TRL's, on [C, K] log-probs).


def add_tail_bucket(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (K+1)-th element ``log(1 − Σ exp(log_probs))`` (TRL's ``_add_tail_bucket``), and its mask."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=TAIL_CLAMP)
    tail = torch.log(-torch.expm1(log_sum))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)


def masked_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``_jsd_divergence`` with a support mask: per element, 0 off the support."""
    zero = torch.zeros_like(student)
    safe_s, safe_t = torch.where(mask, student, zero), torch.where(mask, teacher, zero)
    p_s, p_t = torch.where(mask, student.exp(), zero), torch.where(mask, teacher.exp(), zero)
    if beta == 0:
        return torch.nan_to_num(p_t * (safe_t - safe_s), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(p_s * (safe_s - safe_t), nan=0.0)
    tiny = torch.finfo(p_s.dtype).tiny
    mixture = (1 - beta) * p_s + beta * p_t
    safe_m = torch.where(mask, torch.log(mixture.clamp_min(tiny)), zero)
    kl_teacher = torch.nan_to_num(p_t * (safe_t - safe_m), nan=0.0)
    kl_student = torch.nan_to_num(p_s * (safe_s - safe_m), nan=0.0)
    return beta * kl_teacher + (1 - beta) * kl_student


def sparse_divergence_rows(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    add_tail: bool,
) -> torch.Tensor:
    """Per-row divergence [C] of the student's and teacher's log-probs [C, K] at a support (``mask``
    [C, K]: which of the K entries belong to it), as TRL's server path computes it. An entry whose
    teacher log-prob is −inf is off the support, as TRL's forward-KL path masks it (``valid =
    teacher_topk_logprobs > -inf``): a teacher with fewer than K finite logits (a −inf bias, a masked
    vocabulary) or a log-prob an fp16 store overflowed. Its student log-prob then leaves the
    renormalisation (no tail) or goes to the tail bucket, and a row of no entry is 0 with no NaN."""
    mask = mask & (teacher_logprobs > -math.inf)
    neg_inf = torch.full((), float("-inf"), dtype=student_logprobs.dtype, device=student_logprobs.device)
    student = torch.where(mask, student_logprobs, neg_inf)
    teacher = torch.where(mask, teacher_logprobs.to(student.dtype), neg_inf)
    if add_tail:
        student, support = add_tail_bucket(student, mask)
        teacher, _ = add_tail_bucket(teacher, mask)
    else:
        support = mask
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    return masked_jsd(student, teacher, beta, support).sum(-1)


def tail_sample_support(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, tail: torch.Tensor, sample_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The support ids [..., k + M] of the teacher's top-k ``top_ids`` [..., k] and M draws from its tail
    ``sample_ids`` [..., M] (``linear_topk_logprobs``'s), the teacher's log-probs there and the support
    mask, for ``linear_sparse_divergence`` with ``add_tail`` and β 0. A draw stands for r·c/M of the mass
    (r = exp(``tail``) the tail's mass, c how often the id was drawn), on its first copy (the others
    masked); a row whose tail is empty (−inf: its draws are id 0) has every draw masked.

    Why (fastalign's, not TRL's): TRL's tail bucket ``log(1 − Σ top-k)`` moves only the tail's total
    mass, never its shape (its gradient on a tail logit is S_j·(1 − r_T/r_S)). Here the teacher's mass
    over the support sums to 1, so the bucket is ~0 (``TAIL_CLAMP``) and the loss is KL(T̂ ‖ S), S the
    student's distribution over the whole vocabulary: its gradient on the student's logits, S − T̂, is an
    unbiased estimate of full-logit forward KL's S − T (E[c] = M·T_j / r at a tail id). Forward KL only:
    JSD's mixture is not linear in T. Sparse logit sampling (Anshumann et al., ACL 2025) on the tail."""
    m = sample_ids.shape[-1]
    same = sample_ids[..., :, None] == sample_ids[..., None, :]  # [..., M, M]
    first = ~torch.tril(same, diagonal=-1).any(-1)
    pseudo = tail.float()[..., None] + torch.log(same.sum(-1).float() / m)
    mask = torch.cat([torch.ones_like(top_ids, dtype=torch.bool), first & (tail[..., None] > -math.inf)], -1)
    return torch.cat([top_ids, sample_ids], -1), torch.cat([top_logprobs.float(), pseudo], -1), mask


# --------------------------------------------------------------------------------------------------
# The student's fused head.


def logit_bytes(dtype: torch.dtype, device: torch.device, softcap: bool = False) -> int:
    """Bytes a chunk holds at once per element of its [C, V] logits, for the workspace budget
    (``fastalign.ops.head_workspace``): the fp32 logits, which become exp(z − max), the softmax and the
    gradient in place (an fp32 head's chunk: 4 bytes, as ``linear_cross_entropy``'s); the gradient's copy
    in a low-precision head's dtype and its fp32 copy where the weight gradient's sum upcasts
    (``upcasts_for_fp32_sum``); the slope of a softcap (``softcap``). Not counted, as the per-token
    outputs are not: the entropy's fp32 [16, V] exp block
    (``linear_cross_entropy_torch.ENTROPY_BLOCK_ROWS``; 3 MiB at V = 49,152), one tenth of a 160-row CPU
    chunk."""
    size = 4 + (dtype.itemsize if dtype != torch.float32 else 0)
    size += 4 if upcasts_for_fp32_sum(device, dtype) else 0
    return size + (4 if softcap else 0)


class _Sparse(NamedTuple):
    """What no gradient reaches: the support and the teacher's side of it."""

    support_ids: torch.Tensor  # [N, K] long
    teacher_logprobs: torch.Tensor  # [N, K]
    support_mask: torch.Tensor  # [N, K] bool
    valid: torch.Tensor  # [N] bool: counted tokens


class _Spec(NamedTuple):
    beta: float
    inv_temperature: float
    add_tail: bool
    chunk_size: int
    with_entropy: bool
    softcap: float | None  # the student's final-logit softcap (Gemma-2's): s·tanh(logits/s)


def _sweep(hidden, weight, bias, sparse: _Sparse, spec: _Spec, upstream, needs):
    n = hidden.shape[0]
    token_loss = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    grads = InputGrads(hidden, weight, bias, needs) if upstream is not None and any(needs) else None
    for rows in loss_row_chunks(sparse.valid, spec.chunk_size)[1]:
        hidden_chunk = hidden[rows]
        # One [C, V] fp32 buffer, turned in place into exp(z − max), the softmax, then the gradient.
        logits = softcap_(_fp32_logits(hidden_chunk, weight, bias), spec.softcap)
        # the softcap's slope 1 − (z/s)², for the chain rule at the end
        slope = None
        if grads is not None and spec.softcap is not None:
            slope = softcap_slope(logits, spec.softcap)
        if spec.inv_temperature != 1.0:
            logits.mul_(spec.inv_temperature)
        ids = sparse.support_ids[rows]
        at_ids = logits.gather(1, ids)
        top = logits.amax(dim=-1, keepdim=True)
        shifted = logits.sub_(top)  # x = z − max, in place
        if spec.with_entropy:
            e_dot_x = exp_with_dot_(shifted)[:, None]  # H = log Σe − Σ e·x / Σe, e = exp(x)
        else:
            shifted.exp_()  # e = exp(x), in place
        total = shifted.sum(dim=-1, keepdim=True)
        log_total = total.log()
        if spec.with_entropy:
            entropy[rows] = (log_total - e_dot_x / total).squeeze(1)
        lse = top + log_total
        at_support = (at_ids - lse).requires_grad_(grads is not None)
        with torch.enable_grad():
            div = sparse_divergence_rows(
                at_support,
                sparse.teacher_logprobs[rows].float(),
                sparse.support_mask[rows],
                spec.beta,
                spec.add_tail,
            )
            if grads is not None:
                (g_support,) = torch.autograd.grad((div * upstream[rows]).sum(), at_support)
        token_loss[rows] = div.detach()
        if grads is not None:
            # d(log p_j)/dz = onehot_j − softmax: the gradient w.r.t. the chunk's logits, then /T
            grad = shifted.mul_(-g_support.sum(-1, keepdim=True) / total)
            grad.scatter_add_(1, ids, g_support)
            if spec.inv_temperature != 1.0:
                grad.mul_(spec.inv_temperature)
            if slope is not None:
                grad.mul_(slope)
            grads.add_chunk(rows, grad.to(weight.dtype), hidden_chunk, weight)
            del grad
        del logits, shifted, slope
    finished = grads.finish(weight, bias) if grads is not None else (None,) * 3
    return token_loss, entropy, finished


class _ScalarSparseDivergence(GradientInForward):
    @staticmethod
    def forward(ctx, hidden, weight, bias, sparse, spec, upstream, needs):
        token_loss, entropy, grads = _sweep(hidden, weight, bias, sparse, spec, upstream, needs)
        ctx.grads = grads
        ctx.mark_non_differentiable(entropy)
        return (token_loss * upstream).sum(), entropy


@autocast_aware
def linear_sparse_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    support_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    support_mask: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    add_tail: bool = True,
    bias: torch.Tensor | None = None,
    reduction: str = "sum",
    return_entropy: bool = False,
    workspace_bytes: int | None = None,
    softcap: float | None = None,
):
    """The sparse-support divergence (TRL's server distillation loss) of the student whose final hidden
    states are ``hidden`` [..., D] and head ``weight`` [V, D] (and ``bias`` [V]), against the teacher's
    log-probs ``teacher_logprobs`` [..., K] at the token ids ``support_ids`` [..., K] (``support_mask``
    [..., K]: entries of the support, default all; an entry whose teacher log-prob is −inf never is,
    as in TRL's forward-KL path: ``sparse_divergence_rows``), over the tokens where ``valid`` [...] holds
    (default all). ``reduction`` 'sum' or 'mean' (over valid tokens). The student's distribution is
    ``softmax(logits / temperature)``; the teacher's log-probs are taken as given (scored at the same
    temperature). With ``return_entropy`` also the student's per-token entropy at the temperature
    (fp32 [...], 0 at tokens not counted, no gradient). ``softcap``: the student's final-logit softcap
    (Gemma-2's), its logits ``s·tanh(logits/s)`` before the temperature."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if softcap is not None:
        softcap = validation.positive_finite("softcap", softcap)
    lead = hidden.shape[:-1]
    if support_ids.shape[:-1] != lead or teacher_logprobs.shape != support_ids.shape:
        raise ValueError(
            f"support_ids {tuple(support_ids.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} "
            f"must both be [..., K] with hidden's leading dimensions {tuple(lead)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, D] with hidden's D = {hidden.shape[-1]}")
    k = support_ids.shape[-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    n = flat_hidden.shape[0]
    valid = torch.ones(n, dtype=torch.bool, device=hidden.device) if valid is None else valid.reshape(n)
    mask = (
        torch.ones(n, k, dtype=torch.bool, device=hidden.device)
        if support_mask is None
        else support_mask.reshape(n, k)
    )
    ids = support_ids.reshape(n, k).long()
    vocab = weight.shape[0]
    if ids.numel() and bool(((ids < 0) | (ids >= vocab))[valid].any()):
        raise ValueError(f"support_ids must be token ids in [0, {vocab})")
    budget = head_workspace_bytes(hidden.device.type, workspace_bytes, weight)
    spec = _Spec(
        float(beta),
        1.0 / temperature,
        bool(add_tail),
        chunk_rows(vocab, logit_bytes(weight.dtype, weight.device, softcap is not None), budget),
        bool(return_entropy),
        softcap,
    )
    sparse = _Sparse(ids, teacher_logprobs.reshape(n, k), mask, valid)
    count = valid.sum()
    scale = 1.0 / count.clamp_min(1).float() if reduction == "mean" else torch.ones((), device=hidden.device)
    upstream = torch.where(valid, scale, 0.0).float()
    needs = input_grads_needed(flat_hidden, weight, bias)
    loss, entropy = _ScalarSparseDivergence.apply(flat_hidden, weight, bias, sparse, spec, upstream, needs)
    return (loss, entropy.reshape(lead)) if return_entropy else loss


# --------------------------------------------------------------------------------------------------
# The teacher's scoring pass.


class TopK(NamedTuple):
    """Per token: the top-k ids [N, k] (long) and log-probs [N, k] (fp32, descending), the log of the
    mass outside them [N] and the log-prob of the given token [N] (fp32), and ``sample_ids`` [N, M]
    (long): M draws from the tail, the distribution outside the top-k ([N, 0] when none are asked for)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    tail: torch.Tensor
    token_logprobs: torch.Tensor
    sample_ids: torch.Tensor


#: Vocabulary slice of the scoring pass's logits blocks.
VOCAB_SLICE = 16384


def _logits_block(
    hidden, weight, bias, v0: int, v1: int, inv_t: float, softcap: float | None
) -> torch.Tensor:
    """The fp32 logits [C, v1 − v0] of vocabulary ids [v0, v1), capped at ``softcap`` (Gemma-2's
    final-logit softcap; None: not), at temperature 1 / ``inv_t``."""
    logits = softcap_(_fp32_logits(hidden, weight[v0:v1], None if bias is None else bias[v0:v1]), softcap)
    return logits.mul_(inv_t) if inv_t != 1.0 else logits


@autocast_aware
@torch.no_grad()
def linear_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    tokens: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_slice: int = VOCAB_SLICE,
    workspace_bytes: int | None = None,
    tail_samples: int = 0,
    uniforms: torch.Tensor | None = None,
    softcap: float | None = None,
) -> TopK:
    """The top-``k`` next-token log-probs of ``softmax((hidden·weightᵀ + bias) / temperature)`` for every
    row of ``hidden`` [N, D], their ids, the log of the mass outside them, and the log-prob of ``tokens``
    [N] (0 where not given). Never more than one [C, vocab_slice] block of logits. Inside an autocast
    region the head runs as ``F.linear`` would there (``autocast_aware``: hidden states, weight and bias
    in the autocast dtype), its logits accumulated in fp32 all the same: a teacher scored under ``bf16``
    is scored as training's online teacher is. ``softcap``: the model's final-logit softcap (Gemma-2's),
    applied to the logits before the temperature.

    With ``tail_samples`` M > 0, also M draws per row from its tail (the distribution renormalised over
    the ids outside its top-k), by inverse CDF at ``uniforms`` [N, M] in [0, 1) (the caller's, so that
    the caller decides the seeding: ``tail_sample_support`` turns them into an unbiased estimate of the
    tail for the loss): see ``_tail_draws``. A row whose tail is empty (its tail −inf: every other logit
    −inf) gets draws of id 0, which the loss masks out by that tail."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, D] and weight {tuple(weight.shape)} [V, D]"
        )
    n, vocab = hidden.shape[0], weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    if tail_samples < 0:
        raise ValueError(f"tail_samples must be 0 or more, got {tail_samples}")
    if (uniforms is None) != (tail_samples == 0) or (
        uniforms is not None and tuple(uniforms.shape) != (n, tail_samples)
    ):
        shape = None if uniforms is None else tuple(uniforms.shape)
        raise ValueError(
            f"uniforms must be [N, tail_samples] = [{n}, {tail_samples}] (None for 0), got {shape}"
        )
    slice_width = min(vocab, vocab_slice)
    budget = head_workspace_bytes(hidden.device.type, workspace_bytes)
    # per logit: the fp32 block and the top-k pass's fp32 temporaries, or the draws' float64 cumulative
    # sum of half the rows at a time (``_tail_draws``): the same chunks with draws as without
    rows_per_chunk = chunk_rows(slice_width, 4 * 2, budget)
    device = hidden.device
    out_ids = torch.empty(n, k, dtype=torch.long, device=device)
    out_lp = torch.empty(n, k, dtype=torch.float32, device=device)
    out_tail = torch.empty(n, dtype=torch.float32, device=device)
    out_token = torch.zeros(n, dtype=torch.float32, device=device)
    out_samples = torch.zeros(n, tail_samples, dtype=torch.long, device=device)
    inv_t = 1.0 / temperature
    for start in range(0, n, rows_per_chunk):
        rows = slice(start, min(n, start + rows_per_chunk))
        h = hidden[rows]
        c = h.shape[0]
        best_val = torch.full((c, 0), float("-inf"), device=device)
        best_ids = torch.empty((c, 0), dtype=torch.long, device=device)
        # log of the mass of every logit left out of the running top-k: summed exactly (no 1 − Σ top-k)
        rest = torch.full((c,), float("-inf"), device=device)
        token_logit = torch.zeros(c, device=device)
        chunk_tokens = tokens[rows] if tokens is not None else None
        for v0 in range(0, vocab, slice_width):
            v1 = min(vocab, v0 + slice_width)
            logits = _logits_block(h, weight, bias, v0, v1, inv_t, softcap)
            if chunk_tokens is not None:
                inside = (chunk_tokens >= v0) & (chunk_tokens < v1)
                local = (chunk_tokens - v0).clamp(0, v1 - v0 - 1)
                token_logit = torch.where(inside, logits.gather(1, local[:, None]).squeeze(1), token_logit)
            val, idx = logits.topk(min(k, v1 - v0), dim=-1)
            rest = torch.logaddexp(rest, torch.logsumexp(logits.scatter_(1, idx, float("-inf")), dim=-1))
            merged_val, order = torch.cat([best_val, val], dim=-1).sort(dim=-1, descending=True)
            merged_ids = torch.cat([best_ids, idx + v0], dim=-1).gather(1, order)
            keep = min(k, merged_val.shape[1])
            if merged_val.shape[1] > keep:
                rest = torch.logaddexp(rest, torch.logsumexp(merged_val[:, keep:], dim=-1))
            best_val, best_ids = merged_val[:, :keep], merged_ids[:, :keep]
            del logits
        lse = torch.logaddexp(rest, torch.logsumexp(best_val, dim=-1))
        out_ids[rows], out_lp[rows] = best_ids, best_val - lse[:, None]
        out_tail[rows] = rest - lse  # -inf when the top-k hold it all
        if chunk_tokens is not None:
            out_token[rows] = token_logit - lse
        if tail_samples:
            out_samples[rows] = _tail_draws(
                h, weight, bias, best_ids, rest, uniforms[rows], slice_width, inv_t, softcap
            )
    return TopK(out_ids, out_lp, out_tail, out_token, out_samples)


def _tail_draws(
    hidden, weight, bias, top_ids, rest, uniforms, slice_width: int, inv_t: float, softcap: float | None
) -> torch.Tensor:
    """Draws [C, M] from each row's tail by inverse CDF: draw i is the first id, in vocabulary order with
    the row's ``top_ids`` left out, where the tail's cumulative probability exceeds ``uniforms[:, i]``.

    A second walk over the same vocabulary slices as the top-k's (which had to find the top-k and the
    tail's log-mass ``rest`` first): each slice's logits again, the top-k ids' set to −inf, the tail's
    probabilities ``exp(z − rest)`` (relative to the tail's own mass, so a tail of 1e-40 of the row's
    mass draws as exactly as any other), their cumulative sum in float64 (half the chunk's rows at a
    time: a float64 block the size of the fp32 logits) with each row's running total carried from slice
    to slice, and ``torch.searchsorted`` for the draws that land in the slice. A draw at a uniform beyond
    the walk's own float64 total (it differs from 1 by the float32 rounding of ``rest``, ~1e-6) takes the
    last tail id of nonzero probability; a row with an empty tail (``rest`` −inf) has no such id and
    keeps id 0."""
    vocab, c = weight.shape[0], hidden.shape[0]
    device = hidden.device
    targets = uniforms.to(torch.float64)
    shift = torch.where(rest.isfinite(), rest, 0.0)[:, None]
    draws = torch.zeros(targets.shape, dtype=torch.long, device=device)
    pending = torch.ones(targets.shape, dtype=torch.bool, device=device)
    last = torch.zeros(c, 1, dtype=torch.long, device=device)  # the last tail id of nonzero mass
    below = torch.zeros(c, 1, dtype=torch.float64, device=device)  # the earlier slices' tail mass
    half = max(1, (c + 1) // 2)
    for v0 in range(0, vocab, slice_width):
        v1 = min(vocab, v0 + slice_width)
        logits = _logits_block(hidden, weight, bias, v0, v1, inv_t, softcap)
        local = top_ids - v0
        inside = (local >= 0) & (local < v1 - v0)
        # −inf onto the top-k ids of this slice; the others add 0 at a clamped index (exact in any order)
        logits.scatter_add_(1, local.clamp(0, v1 - v0 - 1), torch.where(inside, float("-inf"), 0.0))
        probs = logits.sub_(shift).exp_()
        for r0 in range(0, c, half):
            rows = slice(r0, r0 + half)
            cumulative = torch.cumsum(probs[rows], dim=1, dtype=torch.float64)  # from the slice's start
            ahead = targets[rows] - below[rows]
            total = cumulative[:, -1:].contiguous()
            lands = pending[rows] & (ahead < total)
            found = torch.searchsorted(cumulative, ahead, right=True).clamp_(max=v1 - v0 - 1) + v0
            draws[rows] = torch.where(lands, found, draws[rows])
            pending[rows] &= ~lands
            last_here = torch.searchsorted(cumulative, total, right=False) + v0
            last[rows] = torch.where(total > 0, last_here, last[rows])
            below[rows] += total
            del cumulative
        del logits, probs
    return torch.where(pending, last, draws)
