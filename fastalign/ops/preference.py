"""Pairwise preference losses: ``pair_loss`` (dispatch + PyTorch) and the inputs each loss type needs.

The per-pair math is stated in ``fastalign/kernels/preference.py``; the PyTorch versions here follow
TRL 1.16's ``DPOTrainer`` loss (and its CPO/SimPO/ORPO trainers) op for op; ``tests/parity`` runs TRL
itself against them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastalign.ops.backend import Backend, resolve_backend

#: Loss types whose pair inputs are the chosen and rejected log-ratios π − π_ref (after the prep below).
DPO_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "sigmoid_norm", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
)  # fmt: skip


#: The DPO loss types whose formula in TRL 1.16 uses ``label_smoothing`` (ε); the others ignore it.
SMOOTHED_DPO_LOSS_TYPES: tuple[str, ...] = ("robust", "exo_pair", "aot", "aot_unpaired")
#: The DPO loss types TRL 1.16 compares on length-normalised (per completion token) log-ratios.
LENGTH_NORMALISED_DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid_norm", "ipo")


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


def dpo_pair_inputs(
    loss_type: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(kernel loss type, c, r) of a DPO-family loss from sequence log-probs [P] (differentiable)."""
    if loss_type == "aot":  # sorted policy margins against sorted reference margins
        return "sigmoid", torch.sort(chosen - rejected)[0], torch.sort(ref_chosen - ref_rejected)[0]
    if loss_type == "aot_unpaired":
        return "sigmoid", torch.sort(chosen - ref_chosen)[0], torch.sort(rejected - ref_rejected)[0]
    if loss_type in LENGTH_NORMALISED_DPO_LOSS_TYPES:  # the log-ratios per completion token
        return (
            "sigmoid" if loss_type == "sigmoid_norm" else loss_type,
            (chosen - ref_chosen) / chosen_lengths.clamp(min=1.0),
            (rejected - ref_rejected) / rejected_lengths.clamp(min=1.0),
        )
    return loss_type, chosen - ref_chosen, rejected - ref_rejected
