"""``linear_pair_objective``: a loss of preference pairs' sequence log-probs, from the policy's hidden
states, with its gradient formed in the forward pass.

A pairwise loss (DPO and its family, SimPO, CPO, ORPO) is ``Σ_i f(c_i, r_i, u_i)``: ``c_i``/``r_i`` the
(weighted) sequence log-probs of pair i's chosen and rejected completions, ``u_i`` the chosen one's
plain token sum (for an NLL term). It is ``fastalign.ops.linear_sequence_objective`` with units of two
sequences (chosen, rejected), each run whole in one chunk: the head at 6·N·V·D FLOPs instead of 8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fastalign.ops.backend import Backend
from fastalign.ops.linear_sequence_objective import (
    SequenceObjectiveResult,
    SequenceSums,
    linear_sequence_objective,
)


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
    softcap: float | None = None,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
    backend: Backend = "auto",
) -> SequenceObjectiveResult:
    """``Σ pair_loss`` over the pairs of hidden [2P, T, D] (P chosen rows, then their P rejected ones)
    predicting ``targets`` [2P, T], through the LM head (weight [V, D], bias [V]), without logits.

    ``token_weights`` [2P, T] weight the sequence log-probs ``PairSums.chosen``/``rejected`` (LD-DPO);
    ``chosen_tokens`` stays the plain sum. ``return_entropy``: the per-token entropy (from the softmax
    statistics); ``return_aligned``: WPO's per-sequence Σ (log p − log Σ_v p_v²) in ``PairSums`` and the
    result. ``softcap``: Gemma-2's final-logit softcap (see ``linear_sequence_objective``). The result's
    per-sequence values are [2P]: chosen rows, then rejected. A chunk holds
    ``chunk_size`` loss tokens (default: as many as fit ``workspace_bytes``), or one pair when a pair has
    more.
    """
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(
            f"hidden must have shape [2P, T, D] (chosen rows, then rejected), got {tuple(hidden.shape)}"
        )
    pairs = hidden.shape[0] // 2

    def sequence_loss(sequences: torch.Tensor, sums: SequenceSums) -> torch.Tensor:
        k = len(sequences) // 2  # member-major: the chunk's chosen rows, then their rejected ones
        aligned = (None, None) if sums.aligned is None else (sums.aligned[:k], sums.aligned[k:])
        return pair_loss(sequences[:k], PairSums(sums.logps[:k], sums.logps[k:], sums.tokens[:k], *aligned))

    return linear_sequence_objective(
        hidden,
        weight,
        targets,
        sequence_loss,
        bias,
        units=[[pair, pairs + pair] for pair in range(pairs)],
        token_weights=token_weights,
        return_entropy=return_entropy,
        return_aligned=return_aligned,
        ignore_index=ignore_index,
        softcap=softcap,
        chunk_size=chunk_size,
        workspace_bytes=workspace_bytes,
        backend=backend,
    )
