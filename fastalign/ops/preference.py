"""Pairwise preference losses: ``pair_loss`` (dispatch + PyTorch) and the inputs each loss type needs,
with the DPO options that reshape those inputs (f-divergence scores, LD-DPO token weights) and WPO's
per-token statistic ``token_log_sum_sq_probs``.

The per-pair math is stated in ``fastalign/kernels/preference.py``; the PyTorch versions here follow
TRL 1.16's ``DPOTrainer`` loss (and its CPO/SimPO/ORPO trainers) op for op; ``tests/parity`` runs TRL
itself against them.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from fastalign.ops.backend import Backend, resolve_backend
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes
from fastalign.ops.linear_cross_entropy_torch import softcap_

#: Loss types whose pair inputs are the chosen and rejected log-ratios π − π_ref (after the prep below).
DPO_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "sigmoid_norm", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
)  # fmt: skip


#: The DPO loss types whose formula in TRL 1.16 uses ``label_smoothing`` (ε); the others ignore it.
SMOOTHED_DPO_LOSS_TYPES: tuple[str, ...] = ("robust", "exo_pair", "aot", "aot_unpaired")
#: The DPO loss types TRL 1.16 compares on length-normalised (per completion token) log-ratios.
LENGTH_NORMALISED_DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid_norm", "ipo")
#: f-DPO's regularisers (TRL's ``f_divergence_type``); reverse_kl is DPO's own.
F_DIVERGENCE_TYPES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: The DPO loss types TRL 1.16 allows with another f-divergence than reverse_kl: those built on the
#: chosen − rejected score difference, where f-DPO's β·log Z(x) term cancels ('sft' has no scores).
F_DIVERGENCE_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft",
)  # fmt: skip
#: The DPO loss types TRL 1.16 refuses WPO weighting for: 'aot'/'aot_unpaired' sort the pairs (their
#: weights would no longer match), and 'sft' fails in TRL's in-place weighting of its expanded loss.
UNWEIGHTED_DPO_LOSS_TYPES: tuple[str, ...] = ("aot", "aot_unpaired", "sft")


def _pair_loss_torch(c, r, loss_type: str, beta: float, smoothing: float, tau: float):
    z = beta * (c - r)
    if loss_type == "sigmoid":
        return -F.logsigmoid(z) * (1 - smoothing) - F.logsigmoid(-z) * smoothing
    if loss_type == "robust":
        return (-F.logsigmoid(z) * (1 - smoothing) + F.logsigmoid(-z) * smoothing) / (1 - 2 * smoothing)
    if loss_type == "exo_pair":
        return z.sigmoid() * (F.logsigmoid(z) - math.log(1 - smoothing)) + (-z).sigmoid() * (
            F.logsigmoid(-z) - math.log(smoothing)
        )
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (c - r - 1 / (2 * beta)) ** 2
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * c) + (1 - torch.sigmoid(z))
    if loss_type == "discopop":
        modulation = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation
    if loss_type == "kto":
        return 1 - torch.sigmoid(z)
    if loss_type == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return -beta * F.logsigmoid(log_odds)
    raise ValueError(f"no pair loss {loss_type!r}")


class _PairLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, r, loss_type, beta, smoothing, tau):
        from fastalign.kernels import preference as kernels

        loss, dc, dr = kernels.pair_loss(
            c.contiguous(), r.contiguous(), loss_type, beta=beta, smoothing=smoothing, tau=tau
        )
        ctx.save_for_backward(dc, dr)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dc, dr = ctx.saved_tensors
        return grad_loss * dc, grad_loss * dr, None, None, None, None


def pair_loss(
    c: torch.Tensor,
    r: torch.Tensor,
    loss_type: str,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Per-pair loss [P] (fp32) of the prepared inputs c, r [P]; differentiable w.r.t. both."""
    c, r = c.float(), r.float()
    if resolve_backend(backend, c) == "torch":
        return _pair_loss_torch(c, r, loss_type, beta, label_smoothing, discopop_tau)
    return _PairLossFunction.apply(c, r, loss_type, float(beta), float(label_smoothing), float(discopop_tau))


def f_divergence_scores(
    logratios: torch.Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5
) -> torch.Tensor:
    """f'(π/π_ref) of the log-ratios log π/π_ref [P]: f-DPO's scores, which the losses of
    ``F_DIVERGENCE_LOSS_TYPES`` compare in place of the log-ratios (TRL 1.16's formulas).

    reverse_kl: log t. forward_kl: 1 − 1/t. js_divergence: log(2t/(1 + t)) = log 2 + logσ(log t).
    alpha_divergence: (t^(α−1) − 1)/(α − 1), with (α−1)·log t clamped at 80 (fp32) so the exponential
    stays finite; at |α − 1| < 1e-6 its limit, log t."""
    if f_divergence_type == "reverse_kl" or (
        f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6
    ):
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        return torch.expm1(((alpha - 1.0) * logratios.float()).clamp(max=80.0)) / (alpha - 1.0)
    raise ValueError(f"f_divergence_type must be one of {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")


def dpo_pair_inputs(
    loss_type: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(kernel loss type, c, r) of a DPO-family loss from sequence log-probs [P] (differentiable).

    The loss types of ``F_DIVERGENCE_LOSS_TYPES`` compare f-divergence scores of the log-ratios; the
    others are defined for reverse_kl only (a ValueError otherwise)."""
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} has no f-divergence form: only reverse_kl")
    if loss_type == "aot":  # sorted policy margins against sorted reference margins
        return "sigmoid", torch.sort(chosen - rejected)[0], torch.sort(ref_chosen - ref_rejected)[0]
    if loss_type == "aot_unpaired":
        return "sigmoid", torch.sort(chosen - ref_chosen)[0], torch.sort(rejected - ref_rejected)[0]
    c, r = (
        f_divergence_scores(logratios, f_divergence_type, f_alpha_divergence_coef)
        for logratios in (chosen - ref_chosen, rejected - ref_rejected)
    )
    if loss_type in LENGTH_NORMALISED_DPO_LOSS_TYPES:  # the scores per completion token
        return (
            "sigmoid" if loss_type == "sigmoid_norm" else loss_type,
            c / chosen_lengths.clamp(min=1.0),
            r / rejected_lengths.clamp(min=1.0),
        )
    return loss_type, c, r


def length_desensitised_weights(
    targets: torch.Tensor, ld_alpha: float, ignore_index: int = -100
) -> torch.Tensor:
    """LD-DPO's per-token weights [2P, T] for ``targets`` [2P, T] (P chosen rows, then their P rejected
    ones; ``ignore_index`` where not a loss token): 1 on a completion's first k tokens, k the shorter
    completion length of its pair, ``ld_alpha`` on the tokens after them, 0 where ignored. Σ weight·log p
    is then TRL 1.16's shared + ld_alpha·tail log-prob, for the policy and the reference alike."""
    counted = targets != ignore_index
    position = counted.cumsum(-1)  # 1-based index of each loss token within its completion
    chosen, rejected = position[:, -1].chunk(2)
    shared = torch.minimum(chosen, rejected).repeat(2)
    weights = torch.where(position > shared[:, None], ld_alpha, 1.0)
    return weights * counted


def log_sum_sq_probs(
    logits: torch.Tensor, backend: Literal["triton", "torch"], softcap: float | None = None
) -> torch.Tensor:
    """log Σ_v softmax(logits)_v² per row [C] (fp32) of a logits chunk [C, V] (a resolved backend), the
    logits capped first where ``softcap`` is given (Gemma-2's s·tanh(x/s), on a copy)."""
    if softcap is not None:
        logits = softcap_(logits.clone(), softcap)
    if backend == "triton":
        from fastalign.kernels import preference as kernels

        return kernels.log_sum_sq_probs(logits)
    z = logits.float()
    return torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)


def log_sum_sq_bytes(dtype: torch.dtype, backend: Literal["triton", "torch"], softcap: bool = False) -> int:
    """Bytes ``log_sum_sq_probs`` holds at once per element of its logits chunk, for the workspace
    budget (``fastalign.ops.head_workspace``): the logits (twice with a softcap: the capped copy), and on
    the PyTorch path their fp32 copy (low precision), ``2·z`` and ``logsumexp``'s two temporaries
    (``z − max`` and its exp)."""
    logits = dtype.itemsize * (2 if softcap else 1)
    if backend == "triton":
        return logits
    return logits + 4 * (int(dtype != torch.float32) + 3)


@torch.no_grad()
def token_log_sum_sq_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
    workspace_bytes: int | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """log Σ_v p_v² of softmax(hidden @ weight.T + bias) (capped at ``softcap``: Gemma-2's final-logit
    softcap) at each loss token (fp32, shaped like
    ``targets``, 0 where it is ``ignore_index``), without gradient: WPO's alignment term (TRL's
    ``log_sum_sq_probs``).

    The fused log-softmax's statistics have no Σ p², so this is a second, forward-only pass over the
    loss tokens in chunks of logits (one [C, V] chunk alive): 2·N·V·D FLOPs next to its 8·N·V·D, run
    only when ``use_weighting`` is on. ``chunk_size`` defaults to the rows that fit ``workspace_bytes``
    (see ``linear_cross_entropy``)."""
    dim, vocab = weight.shape[1], weight.shape[0]
    flat_hidden, flat_targets = hidden.reshape(-1, dim), targets.reshape(-1)
    rows = (flat_targets != ignore_index).nonzero().squeeze(-1)
    out = torch.zeros(flat_targets.shape, dtype=torch.float32, device=hidden.device)
    resolved = resolve_backend(backend, hidden)
    budget = head_workspace_bytes(weight.device.type, workspace_bytes, weight)
    per_logit = log_sum_sq_bytes(weight.dtype, resolved, softcap is not None)
    step = chunk_size or chunk_rows(vocab, per_logit, budget)
    for start in range(0, rows.numel(), step):
        index = rows[start : start + step]
        out[index] = log_sum_sq_probs(F.linear(flat_hidden[index], weight, bias), resolved, softcap)
    return out.view(targets.shape)
