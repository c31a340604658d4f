"""``linear_sequence_objective``: a loss of sequence log-probs, from the policy's hidden states, with its
gradient formed in the forward pass.

Many alignment losses are ``Σ_u f(s_u)``: ``s_u`` the sequence log-prob sums of a unit ``u`` of
sequences that the loss couples (a preference pair for DPO and its family; a single completion for KTO,
whose reference point is a constant). A token's log-prob reaches the loss only through its own unit, so
when a chunk of tokens holds whole units, the chunk knows ``∂f/∂s`` as soon as its log-probs are summed:
the gradient of its logits is formed right there, and the logits are built once.

That is the policy's head at 6·N·V·D FLOPs (logits, then the gradients of the hidden states and of the
weight), where per-token log-probs with an arbitrary upstream gradient (``token_logprobs``) need
8·N·V·D: their backward rebuilds every chunk's logits. With a reference's forward (2·N·V·D) a DPO or KTO
step's head is 8·N·V·D instead of 10.

The price is the chunk: it holds at least one whole unit's loss tokens ([rows, V] logits), where
``token_logprobs`` can cut anywhere (``fits_whole_units`` says when that is too many). Only loss tokens
are swept (prompts and padding cost nothing). The row math (softmax statistics, the gradient w.r.t. the
logits) is the fused cross-entropy's (``fastalign.ops.linear_cross_entropy_chunks``), Triton or PyTorch.
``fastalign.ops.linear_pair_objective`` is this with units of two (chosen, rejected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.chunked_head import GradientInForward, InputGrads, input_grads_needed
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes
from fastalign.ops.linear_cross_entropy import autocast_aware, budget_chunk_rows, prepare
from fastalign.ops.linear_cross_entropy_chunks import ChunkSpec, row_grad_, row_stats
from fastalign.ops.linear_cross_entropy_torch import GradCoefficients, LogitTransform
from fastalign.ops.preference import log_sum_sq_bytes, log_sum_sq_probs

#: A unit whose loss tokens exceed this many chunks is not run whole (its logits would be alive at once).
MAX_CHUNKS_PER_UNIT = 4


class SequenceSums(NamedTuple):
    """What a chunk's sequences are made of (each [k], fp32): ``logps`` (Σ weight·log p over loss tokens)
    and ``tokens`` (Σ log p, unweighted) carry gradients; ``aligned`` (Σ log p − log Σ_v p_v², WPO's
    statistic) is a constant, present only when asked for."""

    logps: torch.Tensor
    tokens: torch.Tensor
    aligned: torch.Tensor | None


#: ``sequence_loss(sequences, sums)`` → the loss of those sequences (a differentiable scalar),
#: ``sequences`` their indices [k] in the batch; summed over chunks, so a mean over all S sequences is
#: ``Σ … / S``. A chunk's sequences come member-major: its units' first sequences, then their second, ...
SequenceLoss = Callable[[torch.Tensor, SequenceSums], torch.Tensor]


class SequenceObjectiveResult(NamedTuple):
    loss: torch.Tensor  # Σ over chunks of sequence_loss: differentiable w.r.t. hidden, weight, bias
    logps: torch.Tensor  # [S] Σ weight·log p of each sequence, detached
    token_sums: torch.Tensor  # [S] Σ log p of each sequence, unweighted, detached
    entropy: torch.Tensor  # [S, T] per-token entropy (0 where ignored; all 0 unless asked for)
    aligned: torch.Tensor | None  # [S] WPO's Σ (log p − log Σ_v p_v²), when asked for
    #: [S] Σ over loss tokens of the mean logit (Σ_v z_v / V) and [S] how many loss tokens have their
    #: target as the argmax, detached: TRL's ``logits/*`` and ``mean_token_accuracy`` over a sequence's
    #: tokens (the argmax is the first maximal logit, as ``torch.argmax``). Both come from the row
    #: statistics every chunk computes (Σ_v z_v, the argmax), no extra pass.
    logit_sums: torch.Tensor
    top1: torch.Tensor


def unit_chunks(units: Sequence[Sequence[int]], counts: list[int], chunk_size: int) -> list[list[int]]:
    """Consecutive units grouped so that each group's loss tokens fit ``chunk_size`` (at least one unit
    per group); ``counts`` [S]: each sequence's loss tokens. Each group lists its sequences member-major
    (every unit's first sequence, then every unit's second, ...); units are of one size."""
    groups: list[list[Sequence[int]]] = []
    size = 0
    for unit in units:
        rows = sum(counts[s] for s in unit)
        if groups and size + rows <= chunk_size:
            groups[-1].append(unit)
            size += rows
        else:
            groups.append([unit])
            size = rows
    return [[unit[member] for member in range(len(group[0])) for unit in group] for group in groups]


def fits_whole_units(
    unit_tokens: torch.Tensor,
    weight: torch.Tensor,
    chunk_size: int | None,
    backend: Backend = "auto",
    workspace_bytes: int | None = None,
    softcap: float | None = None,
) -> bool:
    """Whether the largest unit's loss tokens (``unit_tokens`` [U]) fit ``MAX_CHUNKS_PER_UNIT`` chunks
    of the head ``weight`` [V, D] (``chunk_size``, or the workspace budget's with the entropy on and the
    logits capped at ``softcap``): when not, run per-token log-probs."""
    device = weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    transform = LogitTransform(softcap, 1.0)
    resolved = resolve_backend(backend, weight)
    chunk = chunk_size or budget_chunk_rows(weight, dtype, resolved, transform, True, workspace_bytes)
    return unit_tokens.numel() == 0 or int(unit_tokens.max()) <= MAX_CHUNKS_PER_UNIT * chunk


class _Plan(NamedTuple):
    """The call's non-tensor inputs, fixed before the sweep."""

    sequence_loss: SequenceLoss
    token_weights: torch.Tensor | None  # [N] flat, or None (all 1)
    sequence_rows: list[torch.Tensor]  # per sequence, its loss tokens' flat row indices
    groups: list[list[int]]  # per chunk, its sequences
    with_aligned: bool


def _sequence_grads(plan: _Plan, sequences: torch.Tensor, sums: SequenceSums, needed: bool):
    """The chunk's loss and (when ``needed``) its gradients w.r.t. the weighted [k] and plain [k]
    sequence sums."""
    if not needed:
        return plan.sequence_loss(sequences, sums).detach(), None, None
    with torch.enable_grad():
        leaves = [sums.logps.detach().requires_grad_(), sums.tokens.detach().requires_grad_()]
        loss = plan.sequence_loss(sequences, sums._replace(logps=leaves[0], tokens=leaves[1]))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (None, None)
    grad_weighted, grad_plain = (
        torch.zeros_like(leaf) if grad is None else grad.float()
        for grad, leaf in zip(grads, leaves, strict=True)
    )
    return loss.detach(), grad_weighted, grad_plain


class _SequenceObjectiveFunction(GradientInForward):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: ChunkSpec, plan: _Plan, needs):
        device = hidden.device
        logps = torch.zeros(len(plan.sequence_rows), dtype=torch.float32, device=device)
        token_sums = torch.zeros_like(logps)
        aligned = torch.zeros_like(logps)
        logit_sums = torch.zeros_like(logps)
        top1 = torch.zeros_like(logps)
        vocab = weight.shape[0]
        entropy = torch.zeros(targets.shape[0], dtype=torch.float32, device=device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        grads = InputGrads(hidden, weight, bias, needs) if any(needs) else None
        for seqs in plan.groups:
            seq_rows = [plan.sequence_rows[s] for s in seqs]
            rows = torch.cat(seq_rows)
            # the position in ``seqs`` of each row's sequence
            local = torch.repeat_interleave(
                torch.arange(len(seqs), device=device),
                torch.tensor([r.numel() for r in seq_rows], device=device),
            )
            targets_chunk, hidden_chunk = targets[rows], hidden[rows]
            logits = F.linear(hidden_chunk, weight, bias)
            # before the statistics, which may overwrite the logits (PyTorch path)
            log_sum_sq = (
                log_sum_sq_probs(logits, spec.backend, spec.transform.softcap) if plan.with_aligned else None
            )
            stats, workspace = row_stats(logits, targets_chunk, spec)
            token = stats.target_logit - stats.lse
            weights = None if plan.token_weights is None else plan.token_weights[rows]
            weighted = token if weights is None else token * weights
            per_sequence = torch.zeros(len(seqs), dtype=torch.float32, device=device)
            chunk_logps = per_sequence.clone().index_add_(0, local, weighted)
            chunk_sums = per_sequence.clone().index_add_(0, local, token)
            chunk_aligned = (
                per_sequence.index_add_(0, local, token - log_sum_sq) if log_sum_sq is not None else None
            )
            index = torch.tensor(seqs, device=device)
            loss, grad_weighted, grad_plain = _sequence_grads(
                plan, index, SequenceSums(chunk_logps, chunk_sums, chunk_aligned), grads is not None
            )
            total += loss
            logps[index], token_sums[index] = chunk_logps, chunk_sums
            if chunk_aligned is not None:
                aligned[index] = chunk_aligned
            logit_sums[index] = per_sequence.new_zeros(len(seqs)).index_add_(
                0, local, stats.sum_logits / vocab
            )
            top1[index] = per_sequence.new_zeros(len(seqs)).index_add_(0, local, stats.top1)
            if spec.with_entropy:
                entropy[rows] = stats.lse - stats.mean_pz
            if grads is not None:
                upstream = grad_weighted[local] * (1.0 if weights is None else weights) + grad_plain[local]
                coefs = GradCoefficients(p=-upstream, target=upstream, uniform=None, entropy=None)
                grad_logits = row_grad_(logits, targets_chunk, stats, coefs, spec, workspace)
                workspace = None  # the exp buffer, once the gradient is in the logits (``logit_bytes``)
                grads.add_chunk(rows, grad_logits, hidden_chunk, weight)
                del grad_logits
            # Drop this chunk's buffers before the next one is allocated: one chunk alive, not two.
            del logits, workspace
        ctx.grads = grads.finish(weight, bias) if grads is not None else (None, None, None)
        ctx.mark_non_differentiable(logps, token_sums, entropy, aligned, logit_sums, top1)
        return total, logps, token_sums, entropy, aligned, logit_sums, top1


@autocast_aware
def linear_sequence_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sequence_loss: SequenceLoss,
    bias: torch.Tensor | None = None,
    *,
    units: Sequence[Sequence[int]] | None = None,
    token_weights: torch.Tensor | None = None,
    return_entropy: bool = False,
    return_aligned: bool = False,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
    backend: Backend = "auto",
) -> SequenceObjectiveResult:
    """``Σ sequence_loss`` over the sequences of hidden [S, T, D] predicting ``targets`` [S, T], through
    the LM head (weight [V, D], bias [V]), without logits.

    ``units``: the groups of sequences whose loss is coupled, each run in one chunk (all of one size;
    default: every sequence alone). ``token_weights`` [S, T] weight ``SequenceSums.logps`` (LD-DPO);
    ``tokens`` stays the plain sum. ``return_entropy``: the per-token entropy (from the softmax
    statistics); ``return_aligned``: WPO's per-sequence Σ (log p − log Σ_v p_v²) in ``SequenceSums`` and
    the result. A chunk holds ``chunk_size`` loss tokens (default: as many as fit ``workspace_bytes``,
    see ``linear_cross_entropy``), or one unit when a unit has more: then the chunk is over the budget,
    by at most ``MAX_CHUNKS_PER_UNIT`` times where ``fits_whole_units`` chose this op. ``softcap``: the
    logits are ``softcap·tanh(logits/softcap)`` (Gemma-2's final-logit softcap), as in
    ``linear_cross_entropy``. Under autocast the head runs in autocast's dtype, as ``F.linear`` would.
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [S, T, D], got {tuple(hidden.shape)}")
    if token_weights is not None and token_weights.shape != targets.shape:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} must equal targets shape "
            f"{tuple(targets.shape)}"
        )
    if return_aligned and chunk_size is None:  # WPO's pass may hold more than the statistics
        resolved = resolve_backend(backend, hidden)
        budget = head_workspace_bytes(weight.device.type, workspace_bytes, weight)
        transform = LogitTransform(softcap, 1.0)
        chunk_size = min(
            chunk_rows(
                weight.shape[0], log_sum_sq_bytes(weight.dtype, resolved, softcap is not None), budget
            ),
            budget_chunk_rows(weight, weight.dtype, resolved, transform, return_entropy, budget),
        )
    flat_hidden, flat_targets, spec = prepare(
        hidden,
        weight,
        targets,
        bias,
        ignore_index,
        softcap,
        1.0,
        return_entropy,
        chunk_size,
        backend,
        workspace_bytes=workspace_bytes,
    )
    valid = targets != ignore_index
    counts = valid.sum(-1).tolist()
    sequence_rows = list(valid.reshape(-1).nonzero().squeeze(1).split(counts))
    units = [[s] for s in range(len(counts))] if units is None else units
    if (
        sorted(s for unit in units for s in unit) != list(range(len(counts)))
        or len({len(u) for u in units}) > 1
    ):
        raise ValueError(f"units must split the {len(counts)} sequences into groups of one size, got {units}")
    plan = _Plan(
        sequence_loss,
        None if token_weights is None else token_weights.reshape(-1).float(),
        sequence_rows,
        unit_chunks(units, counts, spec.chunk_size),
        return_aligned,
    )
    needs = input_grads_needed(hidden, weight, bias)
    loss, logps, token_sums, entropy, aligned, logit_sums, top1 = _SequenceObjectiveFunction.apply(
        flat_hidden, weight, bias, flat_targets, spec, plan, needs
    )
    entropy = entropy.view(targets.shape)
    return SequenceObjectiveResult(
        loss, logps, token_sums, entropy, aligned if return_aligned else None, logit_sums, top1
    )
