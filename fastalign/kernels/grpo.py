"""Triton kernels of GRPO: group-normalised advantages, and the clipped policy loss per token.

Advantages (one program per group of G rewards; NaN rewards are left out of the statistics and get
advantage 0):
    grpo:  A_i = (r_i − mean_g) / (std + eps)          rloo:  A_i = (r_i − mean of the other rewards) / (…)
with std the group's (unbiased), a given batch std, or 1 (no scaling; eps is then not added).

Token loss (elementwise over the flattened tokens of the completions, so any length works and the
grid stays small: ⌈tokens / 4096⌉ programs). With ℓ = log π(token), ℓ_old (ℓ itself, detached, when
absent), A the completion's advantage and w_t = mask_t · norm_b the aggregation weight of the loss type:
    c1 = exp(ℓ − ℓ_old)  (token level)  or  exp(Σ_t mask_t (ℓ − ℓ_old) / Σ_t mask_t)  (sequence level)
    clip:   loss_t = −min(min(c1, δ)·A, clamp(c1, 1 − ε_low, 1 + ε_high)·A)
    cispo:  loss_t = −sg(min(c1, ε_high))·A·ℓ
    keep:   loss_t ·= k_t, an optional 0/1 per token on the policy term only (TRL's high-entropy mask,
            ``top_entropy_quantile``; token level only: at sequence level a kept token's c1 carries the
            gradient of the completion's other tokens too; the op uses PyTorch)
    KL:     kl_t = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1,  loss_t += β·kl_t  (bias-corrected: β·kl_t·c1, token
            level only: at sequence level its gradient couples a completion's tokens; the op uses PyTorch)
    L = Σ_t w_t loss_t,   ∂L/∂ℓ_t = w_t · (k_t·c1·∂loss/∂c1 + β·(1 − exp(ℓ_ref − ℓ)))   (clip)
                                     w_t · (−k_t·sg(min(c1, ε_high))·A + β·(…))            (cispo)
The sequence-level form (without keep) has the same gradient: ∂c1/∂ℓ_t = c1·mask_t / Σmask, and the Σ
over the completion's tokens of w·∂loss/∂c1 brings the Σmask back; its c1 comes in per token (the caller
reduces each completion's log ratio first). The kernel writes ∂L/∂ℓ per token, and per program its share
of L and the sums behind the metrics (KL, clip fractions: over every weighted token, kept or not, as TRL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _group_advantages_kernel(
    rewards_ptr,
    advantages_ptr,
    group_std_ptr,
    batch_std_ptr,
    G,
    eps,
    RLOO: tl.constexpr,
    SCALE: tl.constexpr,  # 0: none, 1: group std, 2: batch std (read from batch_std_ptr)
    BLOCK_G: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    offsets = group * G + tl.arange(0, BLOCK_G)
    in_group = tl.arange(0, BLOCK_G) < G
    r = tl.load(rewards_ptr + offsets, mask=in_group, other=0.0).to(tl.float32)
    valid = in_group & (r == r)  # NaN != NaN
    r = tl.where(valid, r, 0.0)
    count = tl.sum(valid.to(tl.float32), axis=0)
    total = tl.sum(r, axis=0)
    mean = total / tl.maximum(count, 1.0)
    # All-equal groups centre to exactly 0 (std 0), whatever the rounding of their mean.
    highest = tl.max(tl.where(valid, r, -float("inf")), axis=0)
    lowest = tl.min(tl.where(valid, r, float("inf")), axis=0)
    centered = tl.where(valid, (r - mean) * (highest > lowest).to(tl.float32), 0.0)
    std = tl.sqrt(tl.sum(centered * centered, axis=0) / tl.maximum(count - 1.0, 1.0))
    if RLOO:
        # r − (total − r) / (n − 1) = n / (n − 1) · (r − mean); no baseline without another reward
        advantage = tl.where(count > 1.0, centered * count / tl.maximum(count - 1.0, 1.0), 0.0)
    else:
        advantage = centered
    if SCALE == 1:
        advantage = advantage / (std + eps)
    elif SCALE == 2:
        advantage = advantage / (tl.load(batch_std_ptr) + eps)
    tl.store(advantages_ptr + offsets, tl.where(valid, advantage, 0.0), mask=in_group)
    tl.store(group_std_ptr + group, std)


def group_advantages(
    rewards: torch.Tensor, group_size: int, rloo: bool, scale: int, batch_std: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N] fp32, per-group std [N / G] fp32) for contiguous fp32 rewards [N]."""
    groups = rewards.numel() // group_size
    advantages = torch.empty_like(rewards)
    group_std = torch.empty(groups, dtype=torch.float32, device=rewards.device)
    _group_advantages_kernel[(groups,)](
        rewards, advantages, group_std, batch_std, group_size, eps,
        RLOO=rloo, SCALE=scale, BLOCK_G=triton.next_power_of_2(group_size),
    )  # fmt: skip
    return advantages, group_std


@triton.jit
def _grpo_token_loss_kernel(
    logp_ptr,
    old_logp_ptr,
    ref_logp_ptr,
    log_weight_ptr,  # sequence level: each token's completion-wide log importance weight
    mask_ptr,
    advantage_ptr,  # per token (its completion's advantage)
    weight_ptr,  # per token: the aggregation weight w_t = mask_t · norm_b
    keep_ptr,  # per token: 0/1, whether the policy term counts (HAS_KEEP)
    grad_ptr,
    partial_ptr,  # [5, programs]: Σ w·loss, Σ mask·kl, Σ mask·low-, high-, region-clipped
    N,
    programs,
    beta,
    eps_low,
    eps_high,
    delta,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    SEQUENCE_LEVEL: tl.constexpr,
    CISPO: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    m = tl.load(mask_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    logp = tl.load(logp_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    advantage = tl.load(advantage_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if SEQUENCE_LEVEL:
        c1 = tl.exp(tl.load(log_weight_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    elif HAS_OLD:
        c1 = tl.exp(logp - tl.load(old_logp_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    else:
        c1 = tl.zeros_like(logp) + 1.0
    positive = tl.where(advantage > 0, 1.0, 0.0)
    negative = tl.where(advantage < 0, 1.0, 0.0)
    if CISPO:
        capped = tl.minimum(c1, eps_high)
        token_loss = -capped * advantage * logp
        d_logp = -capped * advantage
        high = tl.where(c1 > eps_high, 1.0, 0.0) * positive  # cispo's one clip, reported as 'high'
        low = tl.zeros_like(c1)
    else:
        c1_capped = tl.minimum(c1, delta) if HAS_DELTA else c1
        c2 = tl.minimum(tl.maximum(c1, 1.0 - eps_low), 1.0 + eps_high)
        unclipped = c1_capped * advantage
        clipped = c2 * advantage
        token_loss = -tl.minimum(unclipped, clipped)
        # ∂(−min(u, v))/∂c1: the active term's slope (ties split evenly, as torch.minimum does); each
        # term passes gradient only where its clamp does not bind.
        d_unclipped = tl.where(c1 <= delta, 1.0, 0.0) if HAS_DELTA else tl.zeros_like(c1) + 1.0
        d_clipped = tl.where(c1 >= 1.0 - eps_low, 1.0, 0.0) * tl.where(c1 <= 1.0 + eps_high, 1.0, 0.0)
        pick = tl.where(unclipped < clipped, 1.0, tl.where(unclipped > clipped, 0.0, 0.5))
        d_logp = -advantage * (pick * d_unclipped + (1.0 - pick) * d_clipped) * c1
        low = tl.where(c1_capped < 1.0 - eps_low, 1.0, 0.0) * negative
        high = tl.where(c1_capped > 1.0 + eps_high, 1.0, 0.0) * positive
    region = tl.maximum(low, high)
    if HAS_KEEP:
        keep = tl.load(keep_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        token_loss = keep * token_loss
        d_logp = keep * d_logp
    kl = tl.zeros_like(logp)
    if HAS_REF:
        ref = tl.load(ref_logp_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        ratio_ref = tl.exp(ref - logp)
        kl = ratio_ref - (ref - logp) - 1.0
        if BIAS_CORRECTION:  # kl·c1 (token level): ∂/∂ℓ = c1·(1 − exp(ℓ_ref − ℓ) + kl)
            d_logp += beta * c1 * (1.0 - ratio_ref + kl)
            kl = kl * c1
        else:
            d_logp += beta * (1.0 - ratio_ref)
        token_loss += beta * kl
    tl.store(grad_ptr + offsets, weight * d_logp, mask=inside)
    tl.store(partial_ptr + pid, tl.sum(weight * token_loss, axis=0))
    tl.store(partial_ptr + programs + pid, tl.sum(m * kl, axis=0))
    tl.store(partial_ptr + 2 * programs + pid, tl.sum(m * low, axis=0))
    tl.store(partial_ptr + 3 * programs + pid, tl.sum(m * high, axis=0))
    tl.store(partial_ptr + 4 * programs + pid, tl.sum(m * region, axis=0))


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    log_weight: torch.Tensor | None,
    mask: torch.Tensor,
    advantage: torch.Tensor,
    weight: torch.Tensor,
    keep: torch.Tensor | None = None,
    *,
    beta: float,
    eps_low: float,
    eps_high: float,
    delta: float | None,
    cispo: bool,
    bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂logp [N] fp32, sums [5] fp32: L, Σ mask·kl, low-, high-, region-clipped token counts) for
    contiguous per-token inputs [N]; ``log_weight`` given means sequence-level importance sampling, ``keep``
    (fp32 0/1) a policy term on the kept tokens only."""
    n = logp.numel()
    block = min(triton.next_power_of_2(n), 4096)
    programs = triton.cdiv(n, block)
    grad = torch.empty(n, dtype=torch.float32, device=logp.device)
    partial = torch.empty((5, programs), dtype=torch.float32, device=logp.device)
    _grpo_token_loss_kernel[(programs,)](
        logp, logp if old_logp is None else old_logp, logp if ref_logp is None else ref_logp,
        logp if log_weight is None else log_weight, mask, advantage, weight, weight if keep is None else keep,
        grad, partial, n, programs, beta, eps_low, eps_high, 1.0 if delta is None else delta,
        HAS_OLD=old_logp is not None, HAS_REF=ref_logp is not None, HAS_DELTA=delta is not None,
        HAS_KEEP=keep is not None,
        SEQUENCE_LEVEL=log_weight is not None, CISPO=cispo, BIAS_CORRECTION=bias_correction_kl,
        BLOCK=block,
    )  # fmt: skip
    return grad, partial.sum(dim=1)
