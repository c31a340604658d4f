"""The row kernels of ``fastalign/kernels/linear_cross_entropy.py`` in PyTorch: softmax statistics and
gradients of one logits chunk, for the ``backend='torch'`` path.

Both backends share one chunk loop (``fastalign.ops.linear_cross_entropy_chunks``); only these two row
operations differ. This file is also the readable statement of their math; the derivation is in the
kernel module.

To stay within one [C, V] buffer per chunk, ``softmax_row_stats`` may overwrite the logits with
``exp(z − max z)`` and hands that buffer on; ``softmax_row_grad_`` turns it into the gradient in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SoftmaxRowStats(NamedTuple):
    """fp32 per-row statistics of the transformed logits ``z`` of a chunk."""

    lse: torch.Tensor  # log Σ_j exp z_j
    target_logit: torch.Tensor  # z_t, 0 where the target is ignored
    sum_logits: torch.Tensor  # Σ_j z_j (label smoothing)
    mean_pz: torch.Tensor  # Σ_j p_j z_j (entropy = lse − mean_pz); NaN when not requested (PyTorch path)
    max_logit: torch.Tensor  # max_j z_j
    #: 1 where the target is ``argmax_j z_j``, the first of the maximal logits as ``torch.argmax`` picks it
    #: (a target tied with an earlier token is not top-1, as in TRL's token accuracy); 0 elsewhere and
    #: where the target is ignored.
    top1: torch.Tensor


class GradCoefficients(NamedTuple):
    """Per-row weights of the output whose gradient is taken (see the kernel module docstring).

    ``uniform`` and ``entropy`` are None when they are zero for every row, which lets the PyTorch path
    skip their passes.
    """

    p: torch.Tensor
    target: torch.Tensor
    uniform: torch.Tensor | None
    entropy: torch.Tensor | None


class LogitTransform(NamedTuple):
    """The map from the raw logits x to the logits z whose softmax is taken: ``softcap·tanh(x/softcap)/T``
    (Gemma-2's softcap, then a sampler's temperature T), or ``x/T`` without a softcap."""

    softcap: float | None
    inv_temperature: float

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 z: ``logits`` itself when it is fp32 and the map is the identity."""
        z = logits.float()
        if self.softcap is not None:
            return torch.tanh(z / self.softcap).mul_(self.softcap * self.inv_temperature)
        if self.inv_temperature != 1.0:
            return z * self.inv_temperature
        return z

    def chain_(self, grad_z: torch.Tensor, logits: torch.Tensor) -> None:
        """``grad_z *= dz/dx`` in place; ``logits`` must hold the raw x whenever a softcap is set."""
        if self.softcap is not None:
            tanh = torch.tanh(logits.float() / self.softcap)
            grad_z.mul_(tanh.mul_(tanh).neg_().add_(1.0).mul_(self.inv_temperature))
        elif self.inv_temperature != 1.0:
            grad_z.mul_(self.inv_temperature)


def softcap_(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap·tanh(logits/softcap)`` in place (a final-logit softcap, Gemma-2's); None: unchanged. For
    the heads that cap a chunk of fp32 logits before their own row math (the divergence and top-k heads,
    WPO's statistic on a copy); ``LogitTransform`` folds the cap into the cross-entropy's."""
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


def softcap_slope(capped: torch.Tensor, softcap: float) -> torch.Tensor:
    """dz/dx = 1 − (z/s)² of the cap z = s·tanh(x/s), from the capped logits ``capped`` (a new tensor):
    the factor that turns a gradient w.r.t. z into one w.r.t. the raw logits x."""
    return (capped / softcap).square_().neg_().add_(1.0)


#: Rows of ``exp_with_dot_``'s exp block (its one temporary beyond the chunk's buffer).
ENTROPY_BLOCK_ROWS = 16


def exp_with_dot_(shifted: torch.Tensor) -> torch.Tensor:
    """Σ_j e_j·x_j per row of ``shifted`` x = z − max z [C, V] fp32, which becomes e = exp(x) in place.

    The entropy is log Σe − Σe·x / Σe. The dot product is taken of the shifted logits, whose terms are
    small (|e·x| ≤ 1/e) rather than of z itself, and summed by ``sum`` (pairwise), not ``bmm``: a CPU
    bmm sums a row in one fp32 accumulator, and Σ e·z that way lost up to 3e-3 nats a token on a
    49,152-token vocabulary (Σ e·x, 3e-4). e is formed a block of rows at a time, a [16, V] temporary,
    and copied over x."""
    e_dot_x = torch.empty(shifted.shape[0], dtype=shifted.dtype, device=shifted.device)
    for block in range(0, shifted.shape[0], ENTROPY_BLOCK_ROWS):
        x = shifted[block : block + ENTROPY_BLOCK_ROWS]
        e = x.exp()
        e_dot_x[block : block + ENTROPY_BLOCK_ROWS] = x.mul_(e).sum(-1)
        x.copy_(e)
    return e_dot_x


def softmax_row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    transform: LogitTransform,
    with_entropy: bool,
) -> tuple[SoftmaxRowStats, torch.Tensor]:
    """Statistics of ``logits`` [C, V] (any float dtype) with ``targets`` [C].

    Also returns ``exp(z − max z)`` [C, V] fp32, written over ``logits`` when those are fp32 with no
    transform (the caller must then not read ``logits`` again). ``with_entropy`` computes ``mean_pz``,
    which costs one more [C, V] buffer.
    """
    z = transform.apply(logits)
    is_target = targets != ignore_index
    safe_targets = torch.where(is_target, targets, 0)
    target_logit = z.gather(1, safe_targets[:, None]).squeeze(1) * is_target
    sum_logits = z.sum(dim=-1)
    # the maximum and its first index in the one reduction (torch.max returns the first maximal index)
    max_logit, argmax = z.max(dim=-1)
    exp = (z.clone() if with_entropy else z).sub_(max_logit[:, None])
    e_dot_x = exp_with_dot_(exp) if with_entropy else None
    if not with_entropy:
        exp.exp_()
    exp_sum = exp.sum(dim=-1)
    if with_entropy:
        mean_pz = max_logit + e_dot_x / exp_sum
    else:
        mean_pz = torch.full_like(exp_sum, float("nan"))
    stats = SoftmaxRowStats(
        lse=max_logit + exp_sum.log(),
        target_logit=target_logit,
        sum_logits=sum_logits,
        mean_pz=mean_pz,
        max_logit=max_logit,
        top1=((argmax == safe_targets) & is_target).float(),
    )
    return stats, exp


def softmax_row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: SoftmaxRowStats,
    coefs: GradCoefficients,
    ignore_index: int,
    transform: LogitTransform,
    exp: torch.Tensor | None = None,
) -> torch.Tensor:
    """∂(Σ_i output_i)/∂logits [C, V] in ``logits``' dtype, built in place of ``exp`` (the buffer from
    ``softmax_row_stats``) or, without it, of ``logits``."""
    z = None
    if exp is None or coefs.entropy is not None:
        if exp is not None and exp.data_ptr() == logits.data_ptr():
            raise ValueError("the entropy gradient needs the logits, which softmax_row_stats overwrote")
        z = transform.apply(logits)
    if exp is None:
        exp = (z.clone() if coefs.entropy is not None else z).sub_(stats.max_logit[:, None]).exp_()
    grad = exp.mul_(torch.exp(stats.max_logit - stats.lse)[:, None])  # p = softmax(z)
    if coefs.entropy is None:
        grad.mul_(coefs.p[:, None])
    else:
        grad.mul_(coefs.p[:, None] - coefs.entropy[:, None] * (z - stats.mean_pz[:, None]))
    if coefs.uniform is not None:
        grad.add_(coefs.uniform[:, None])
    # Ignored rows have a zero target coefficient, so any in-range column may stand in for them.
    safe_targets = torch.where(targets != ignore_index, targets, 0)
    grad.scatter_add_(1, safe_targets[:, None], coefs.target[:, None])
    transform.chain_(grad, logits)
    if grad.dtype != logits.dtype:
        return logits.copy_(grad)
    return grad
