"""Row-wise softmax statistics and gradients of a logits chunk: the PyTorch twin of the Triton kernels.

Both backends of ``linear_cross_entropy`` share one chunk loop (``fastalign.ops.linear_cross_entropy``);
only these two row operations differ. This file is also the readable statement of their math; the
derivation is in ``fastalign/kernels/linear_cross_entropy.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SoftmaxRowStats(NamedTuple):
    """fp32 per-row statistics of the transformed logits ``z`` of a chunk."""

    lse: torch.Tensor  # log Σ_j exp z_j
    target_logit: torch.Tensor  # z_t, 0 where the target is ignored
    sum_logits: torch.Tensor  # Σ_j z_j (label smoothing)
    mean_pz: torch.Tensor  # Σ_j p_j z_j (entropy = lse − mean_pz)
    max_logit: torch.Tensor  # max_j z_j (token accuracy)


class GradCoefficients(NamedTuple):
    """Per-row weights of the output whose gradient is taken (see the kernel module docstring).

    ``uniform`` and ``entropy`` are None when they are zero for every row, which lets the PyTorch path
    skip their passes.
    """

    p: torch.Tensor
    target: torch.Tensor
    uniform: torch.Tensor | None
    entropy: torch.Tensor | None


def _transform(logits: torch.Tensor, softcap: float | None, inv_temperature: float):
    """fp32 ``z = softcap·tanh(x/softcap)/T`` and ``dz/dx`` (a float when it is constant)."""
    z = logits.float()
    if softcap is None:
        if inv_temperature != 1.0:
            z = z * inv_temperature
        return z, inv_temperature
    tanh = torch.tanh(z / softcap)
    return tanh * (softcap * inv_temperature), (1.0 - tanh * tanh).mul_(inv_temperature)


def softmax_row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int,
    softcap: float | None,
    inv_temperature: float,
) -> SoftmaxRowStats:
    """Statistics of ``logits`` [C, V] (any float dtype) with ``targets`` [C]."""
    z, _ = _transform(logits, softcap, inv_temperature)
    max_logit = z.amax(dim=-1)
    exp = (z - max_logit[:, None]).exp_()
    exp_sum = exp.sum(dim=-1)
    # Σ_j exp_j z_j as a batched dot product: no [C, V] temporary.
    exp_z_sum = torch.bmm(exp.unsqueeze(1), z.unsqueeze(2)).view(-1)
    del exp
    is_target = targets != ignore_index
    safe_targets = torch.where(is_target, targets, 0)
    target_logit = z.gather(1, safe_targets[:, None]).squeeze(1) * is_target
    return SoftmaxRowStats(
        lse=max_logit + exp_sum.log(),
        target_logit=target_logit,
        sum_logits=z.sum(dim=-1),
        mean_pz=exp_z_sum / exp_sum,
        max_logit=max_logit,
    )


def softmax_row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: SoftmaxRowStats,
    coefs: GradCoefficients,
    *,
    ignore_index: int,
    softcap: float | None,
    inv_temperature: float,
) -> torch.Tensor:
    """Overwrite ``logits`` [C, V] with ∂(Σ_i output_i)/∂logits and return it."""
    z, dz_dx = _transform(logits, softcap, inv_temperature)
    # Build the gradient in z's storage (for fp32 logits with no transform, z *is* logits) unless the
    # entropy term still needs z.
    grad = z if coefs.entropy is None else z.clone()
    grad.sub_(stats.lse[:, None]).exp_()  # p
    if coefs.entropy is None:
        grad.mul_(coefs.p[:, None])
    else:
        grad.mul_(coefs.p[:, None] - coefs.entropy[:, None] * (z - stats.mean_pz[:, None]))
    if coefs.uniform is not None:
        grad.add_(coefs.uniform[:, None])
    # Ignored rows have a zero target coefficient, so any in-range column may stand in for them.
    safe_targets = torch.where(targets != ignore_index, targets, 0)
    grad.scatter_add_(1, safe_targets[:, None], coefs.target[:, None])
    grad.mul_(dz_dx)
    if grad is not logits:
        logits.copy_(grad)
    return logits
