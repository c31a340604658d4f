"""The row kernel of ``fastalign/kernels/linear_divergence.py`` in PyTorch, for the ``backend='torch'``
path: divergence, hard-label cross-entropy and gradient of one chunk of student and teacher logits.

Both backends share the chunk loop (``fastalign.ops.linear_divergence``); only this row operation
differs. It is also the readable statement of the math, written as TRL's ``generalized_jsd_loss``
writes it; the derivation of the gradient is in the kernel module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: The kernel's MODE, by β: 0 is forward KL(teacher ‖ student), 1 reverse KL(student ‖ teacher).
FORWARD_KL, REVERSE_KL, GENERALIZED_JSD = 0, 1, 2


class RowMath(NamedTuple):
    """What one call's rows compute, as both backends take it (``**row_math._asdict()``)."""

    mode: int  # FORWARD_KL (β = 0), REVERSE_KL (β = 1) or GENERALIZED_JSD
    beta: float
    log_1m_beta: float  # log(1 − β) (mixture weight of the student); 0 unless GENERALIZED_JSD
    log_beta: float  # log β (of the teacher); 0 unless GENERALIZED_JSD
    inv_temperature: float
    ignore_index: int
    with_ce: bool  # the hard-label cross-entropy is wanted (its weight is > 0)
    with_entropy: bool  # the student's entropy at the temperature is wanted (a metric)


def divergence_rows_(student_logits, teacher_logits, labels, coef_div, coef_ce, row_math: RowMath):
    """The contract of ``fastalign.kernels.linear_divergence.divergence_rows_``, whose scalar keywords
    are ``row_math``'s fields: per-row divergence, cross-entropy and student entropy (fp32 [C] each) of
    ``student_logits`` / ``teacher_logits`` [C, V] with ``labels`` [C]; with ``coef_div`` (and
    ``coef_ce``) [C], ``student_logits`` is overwritten by the gradient."""
    mode, beta, log_1m_beta, log_beta, inv_temperature, ignore_index, with_ce, with_entropy = row_math
    s = torch.log_softmax(student_logits.float() * inv_temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.float() * inv_temperature, dim=-1)
    p = s.exp()
    if mode == FORWARD_KL:  # F.kl_div(s, t, log_target=True)
        div = (t.exp() * (t - s)).sum(-1)
        grad_z = p - t.exp()
    elif mode == REVERSE_KL:  # F.kl_div(t, s, log_target=True)
        div = (p * (s - t)).sum(-1)
        grad_z = p * (s - t - div[:, None])
    else:
        log_m = torch.logaddexp(s + log_1m_beta, t + log_beta)
        kl_student = (p * (s - log_m)).sum(-1)
        div = beta * (t.exp() * (t - log_m)).sum(-1) + (1.0 - beta) * kl_student
        grad_z = (1.0 - beta) * p * (s - log_m - kl_student[:, None])

    # −Σ p·s: the entropy of the distribution the divergence compares (TRL's DistillationTrainer metric)
    entropy = -(p * s).sum(-1) if with_entropy else torch.zeros_like(div)
    ce = torch.zeros_like(div)
    if with_ce:
        has_label = labels != ignore_index
        safe_labels = torch.where(has_label, labels, 0)[:, None]
        log_p1 = torch.log_softmax(student_logits.float(), dim=-1)  # temperature 1
        ce = torch.where(has_label, -log_p1.gather(1, safe_labels).squeeze(1), 0.0)

    if coef_div is not None:
        grad = grad_z.mul_((coef_div * inv_temperature)[:, None])
        if with_ce:
            ce_grad = log_p1.exp_().scatter_add_(1, safe_labels, -has_label[:, None].float())
            grad.add_(ce_grad.mul_(coef_ce[:, None]))
        student_logits.copy_(grad)
    return div, ce, entropy
