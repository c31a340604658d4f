"""``linear_pair_objective``: a loss of preference pairs' sequence log-probs, from the policy's hidden
states, with its gradient formed in the forward pass.

A pairwise loss (DPO and its family, SimPO, CPO, ORPO) is ``Σ_i f(c_i, r_i, u_i)``: ``c_i``/``r_i`` the
(weighted) sequence log-probs of pair i's chosen and rejected completions, ``u_i`` the chosen one's
plain token sum (for an NLL term). A token's log-prob reaches the loss only through its own pair, so
when a chunk of tokens holds whole pairs, the chunk knows ``∂f/∂c_i`` as soon as its log-probs are
summed: the gradient of its logits is formed right there, and the logits are built once.

That is the DPO head at 6·N·V·D FLOPs for the policy (logits, then the gradients of the hidden states
and of the weight), where per-token log-probs with an arbitrary upstream gradient
(``token_logprobs``) need 8·N·V·D: their backward rebuilds every chunk's logits. With the reference's
forward (2·N·V·D) a DPO step's head is 8·N·V·D instead of 10.

The price is the chunk: it holds at least one whole pair's loss tokens ([rows, V] logits), where
``token_logprobs`` can cut anywhere. Only loss tokens are swept (prompts and padding cost nothing).
The row math (softmax statistics, the gradient w.r.t. the logits) is the fused cross-entropy's
(``fastalign.ops.linear_cross_entropy_chunks``), Triton or PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastalign.ops.backend import Backend
from fastalign.ops.chunked_head import GradientInForward, InputGrads, input_grads_needed
from fastalign.ops.linear_cross_entropy import prepare
from fastalign.ops.linear_cross_entropy_chunks import ChunkSpec, row_grad_, row_stats
from fastalign.ops.linear_cross_entropy_torch import GradCoefficients
from fastalign.ops.preference import log_sum_sq_probs


class PairSums(NamedTuple):
    """What a chunk's pairs are made of (each [k], fp32): ``chosen``, ``rejected`` and
    ``chosen_tokens`` carry gradients; ``aligned_*`` (Σ over loss tokens of log p − log Σ_v p_v², WPO's
    statistic) are constants, present only when asked for."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    aligned_chosen: torch.Tensor | None
    aligned_rejected: torch.Tensor | None


#: ``pair_loss(pairs, sums)`` → the loss of those pairs (a differentiable scalar), ``pairs`` their
#: indices [k]; summed over chunks, so a mean over all P pairs is ``Σ … / P``.
PairLoss = Callable[[torch.Tensor, PairSums], torch.Tensor]


class PairObjectiveResult(NamedTuple):
    loss: torch.Tensor  # Σ over chunks of pair_loss: differentiable w.r.t. hidden, weight, bias
    logps: torch.Tensor  # [2P] Σ weight·log p of each sequence (chosen rows, then rejected), detached
    token_sums: torch.Tensor  # [2P] Σ log p of each sequence, unweighted, detached
    entropy: torch.Tensor  # [2P, T] per-token entropy (0 where ignored; all 0 unless asked for)
    aligned: torch.Tensor | None  # [2P] WPO's Σ (log p − log Σ_v p_v²), when asked for


def pair_chunks(counts: list[int], chunk_size: int) -> list[list[int]]:
    """Consecutive pairs grouped so that each group's loss tokens fit ``chunk_size`` (at least one pair
    per group); ``counts`` [2P]: loss tokens of the chosen rows, then of the rejected ones."""
    pairs = len(counts) // 2
    groups: list[list[int]] = []
    size = 0
    for pair in range(pairs):
        rows = counts[pair] + counts[pairs + pair]
        if groups and size + rows <= chunk_size:
            groups[-1].append(pair)
            size += rows
        else:
            groups.append([pair])
            size = rows
    return groups


class _Plan(NamedTuple):
    """The call's non-tensor inputs, fixed before the sweep."""

    pair_loss: PairLoss
    token_weights: torch.Tensor | None  # [N] flat, or None (all 1)
    sequence_rows: list[torch.Tensor]  # per sequence, its loss tokens' flat row indices
    groups: list[list[int]]
    with_aligned: bool


def _pair_grads(plan: _Plan, pairs: torch.Tensor, sums: PairSums) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's loss and its gradients w.r.t. the weighted [2k] and plain [2k] sequence sums."""
    leaves = [sums.chosen, sums.rejected, sums.chosen_tokens]
    with torch.enable_grad():
        leaves = [value.detach().requires_grad_() for value in leaves]
        chosen, rejected, tokens = leaves
        loss = plan.pair_loss(pairs, sums._replace(chosen=chosen, rejected=rejected, chosen_tokens=tokens))
        grads = (
            torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else (None, None, None)
        )
    grad_c, grad_r, grad_u = (
        torch.zeros_like(leaf) if grad is None else grad.float()
        for grad, leaf in zip(grads, leaves, strict=True)
    )
    return loss.detach(), torch.cat([grad_c, grad_r]), torch.cat([grad_u, torch.zeros_like(grad_u)])


class _PairObjectiveFunction(GradientInForward):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, spec: ChunkSpec, plan: _Plan, needs):
        device = hidden.device
        sequences = len(plan.sequence_rows)
        pairs = sequences // 2
        logps = torch.zeros(sequences, dtype=torch.float32, device=device)
        token_sums = torch.zeros_like(logps)
        aligned = torch.zeros_like(logps)
        entropy = torch.zeros(targets.shape[0], dtype=torch.float32, device=device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        grads = InputGrads(hidden, weight, bias, needs) if any(needs) else None
        for group in plan.groups:
            seqs = group + [pairs + pair for pair in group]
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
            log_sum_sq = log_sum_sq_probs(logits, spec.backend) if plan.with_aligned else None
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
            k = len(group)
            sums = PairSums(
                chunk_logps[:k],
                chunk_logps[k:],
                chunk_sums[:k],
                None if chunk_aligned is None else chunk_aligned[:k],
                None if chunk_aligned is None else chunk_aligned[k:],
            )
            loss, grad_weighted, grad_plain = _pair_grads(plan, torch.tensor(group, device=device), sums)
            total += loss
            index = torch.tensor(seqs, device=device)
            logps[index], token_sums[index] = chunk_logps, chunk_sums
            if chunk_aligned is not None:
                aligned[index] = chunk_aligned
            if spec.with_entropy:
                entropy[rows] = stats.lse - stats.mean_pz
            if grads is not None:
                upstream = grad_weighted[local] * (1.0 if weights is None else weights) + grad_plain[local]
                coefs = GradCoefficients(p=-upstream, target=upstream, uniform=None, entropy=None)
                grad_logits = row_grad_(logits, targets_chunk, stats, coefs, spec, workspace)
                grads.add_chunk(rows, grad_logits, hidden_chunk, weight)
                del grad_logits
            # Drop this chunk's buffers before the next one is allocated: one chunk alive, not two.
            del logits, workspace
        ctx.grads = grads.finish(weight, bias) if grads is not None else (None, None, None)
        ctx.mark_non_differentiable(logps, token_sums, entropy, aligned)
        return total, logps, token_sums, entropy, aligned


def linear_pair_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    pair_loss: PairLoss,
    bias: torch.Tensor | None = None,
    *,
    token_weights: torch.Tensor | None = None,
    return_entropy: bool = False,
    return_aligned: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> PairObjectiveResult:
    """``Σ pair_loss`` over the pairs of hidden [2P, T, D] (P chosen rows, then their P rejected ones)
    predicting ``targets`` [2P, T], through the LM head (weight [V, D], bias [V]), without logits.

    ``token_weights`` [2P, T] weight the sequence log-probs ``PairSums.chosen``/``rejected`` (LD-DPO);
    ``chosen_tokens`` stays the plain sum. ``return_entropy``: the per-token entropy (from the softmax
    statistics); ``return_aligned``: WPO's per-sequence Σ (log p − log Σ_v p_v²) in ``PairSums`` and the
    result. A chunk holds ``chunk_size`` loss tokens, or one pair when a pair has more.
    """
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(
            f"hidden must have shape [2P, T, D] (chosen rows, then rejected), got {tuple(hidden.shape)}"
        )
    if token_weights is not None and token_weights.shape != targets.shape:
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} must equal targets shape "
            f"{tuple(targets.shape)}"
        )
    flat_hidden, flat_targets, spec = prepare(
        hidden, weight, targets, bias, ignore_index, None, 1.0, return_entropy, chunk_size, backend
    )
    valid = targets != ignore_index
    counts = valid.sum(-1).tolist()
    sequence_rows = list(valid.reshape(-1).nonzero().squeeze(1).split(counts))
    plan = _Plan(
        pair_loss,
        None if token_weights is None else token_weights.reshape(-1).float(),
        sequence_rows,
        pair_chunks(counts, spec.chunk_size),
        return_aligned,
    )
    needs = input_grads_needed(hidden, weight, bias)
    loss, logps, token_sums, entropy, aligned = _PairObjectiveFunction.apply(
        flat_hidden, weight, bias, flat_targets, spec, plan, needs
    )
    entropy = entropy.view(targets.shape)
    return PairObjectiveResult(loss, logps, token_sums, entropy, aligned if return_aligned else None)
