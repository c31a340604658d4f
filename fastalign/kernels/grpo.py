"""Triton kernels of GRPO: group-normalised advantages, and the clipped policy loss per token.

Advantages (one program per group of G rewards; NaN rewards are left out of the statistics and get
advantage 0):
    grpo:  A_i = (r_i − mean_g) / (std + eps)          rloo:  A_i = (r_i − mean of the other rewards) / (…)
with std the group's (unbiased), a given batch std, or 1 (no scaling; eps is then not added).

Token loss (one program per completion, looping over its tokens, so any length works and the grid is
the number of completions). With ℓ = log π(token), ℓ_old (ℓ itself, detached, when absent), A the
completion's advantage and w_t = mask_t · norm_b the aggregation weight of the loss type:
    c1 = exp(ℓ − ℓ_old)  (token level)  or  exp(Σ_t mask_t (ℓ − ℓ_old) / Σ_t mask_t)  (sequence level)
    clip:   loss_t = −min(min(c1, δ)·A, clamp(c1, 1 − ε_low, 1 + ε_high)·A)
    cispo:  loss_t = −sg(min(c1, ε_high))·A·ℓ
    KL:     kl_t = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1,  loss_t += β·kl_t
    L = Σ_t w_t loss_t,   ∂L/∂ℓ_t = w_t · (c1·∂loss/∂c1 + β·(1 − exp(ℓ_ref − ℓ)))   (clip)
                                     w_t · (−sg(min(c1, ε_high))·A + β·(…))            (cispo)
The sequence-level form has the same gradient: ∂c1/∂ℓ_t = c1·mask_t / Σmask, and the Σ over the
completion's tokens of w·∂loss/∂c1 brings the Σmask back. The kernel writes ∂L/∂ℓ per token and, per
completion, its share of L and the sums behind the metrics (KL, clip fractions).
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
    centered = tl.where(valid, r - mean, 0.0)
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
    mask_ptr,
    advantages_ptr,
    seq_weight_ptr,
    grad_ptr,
    seq_out_ptr,  # [5, B]: loss share, Σ mask·kl, low-, high-, region-clip sums
    B,
    T,
    beta,
    eps_low,
    eps_high,
    delta,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SEQUENCE_LEVEL: tl.constexpr,
    CISPO: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    row = seq * T
    advantage = tl.load(advantages_ptr + seq).to(tl.float32)
    norm = tl.load(seq_weight_ptr + seq).to(tl.float32)

    seq_log_weight = 0.0
    if SEQUENCE_LEVEL:
        log_ratio_sum = 0.0
        length = 0.0
        for start in range(0, T, BLOCK_T):
            cols = start + tl.arange(0, BLOCK_T)
            in_row = cols < T
            m = tl.load(mask_ptr + row + cols, mask=in_row, other=0).to(tl.float32)
            if HAS_OLD:
                logp = tl.load(logp_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
                old = tl.load(old_logp_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
                log_ratio_sum += tl.sum(m * (logp - old), axis=0)
            length += tl.sum(m, axis=0)
        seq_log_weight = log_ratio_sum / tl.maximum(length, 1.0)

    loss_sum = 0.0
    kl_sum = 0.0
    low_sum = 0.0
    high_sum = 0.0
    region_sum = 0.0
    for start in range(0, T, BLOCK_T):
        cols = start + tl.arange(0, BLOCK_T)
        in_row = cols < T
        m = tl.load(mask_ptr + row + cols, mask=in_row, other=0).to(tl.float32)
        logp = tl.load(logp_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
        if SEQUENCE_LEVEL:
            c1 = tl.exp(seq_log_weight + tl.zeros_like(logp))
        elif HAS_OLD:
            c1 = tl.exp(logp - tl.load(old_logp_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32))
        else:
            c1 = tl.zeros_like(logp) + 1.0
        # Flags as 0/1 floats: the completion-wide sign of A broadcasts over the tile.
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
            # ∂(−min(u, v))/∂c1: the active term's slope (ties split evenly, as torch.minimum does);
            # each term passes gradient only where its clamp does not bind.
            d_unclipped = tl.where(c1 <= delta, 1.0, 0.0) if HAS_DELTA else tl.zeros_like(c1) + 1.0
            d_clipped = tl.where(c1 >= 1.0 - eps_low, 1.0, 0.0) * tl.where(c1 <= 1.0 + eps_high, 1.0, 0.0)
            pick = tl.where(unclipped < clipped, 1.0, tl.where(unclipped > clipped, 0.0, 0.5))
            d_logp = -advantage * (pick * d_unclipped + (1.0 - pick) * d_clipped) * c1
            low = tl.where(c1_capped < 1.0 - eps_low, 1.0, 0.0) * negative
            high = tl.where(c1_capped > 1.0 + eps_high, 1.0, 0.0) * positive
        region = tl.maximum(low, high)
        if HAS_REF:
            ref = tl.load(ref_logp_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
            ratio_ref = tl.exp(ref - logp)
            kl = ratio_ref - (ref - logp) - 1.0
            token_loss += beta * kl
            d_logp += beta * (1.0 - ratio_ref)
            kl_sum += tl.sum(m * kl, axis=0)
        weight = m * norm
        tl.store(grad_ptr + row + cols, weight * d_logp, mask=in_row)
        loss_sum += tl.sum(weight * token_loss, axis=0)
        low_sum += tl.sum(m * low, axis=0)
        high_sum += tl.sum(m * high, axis=0)
        region_sum += tl.sum(m * region, axis=0)

    tl.store(seq_out_ptr + seq, loss_sum)
    tl.store(seq_out_ptr + B + seq, kl_sum)
    tl.store(seq_out_ptr + 2 * B + seq, low_sum)
    tl.store(seq_out_ptr + 3 * B + seq, high_sum)
    tl.store(seq_out_ptr + 4 * B + seq, region_sum)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    seq_weight: torch.Tensor,
    *,
    beta: float,
    eps_low: float,
    eps_high: float,
    delta: float | None,
    sequence_level: bool,
    cispo: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂logp [B, T] fp32, per-completion sums [5, B] fp32) for contiguous [B, T] inputs."""
    batch, length = logp.shape
    grad = torch.empty((batch, length), dtype=torch.float32, device=logp.device)
    seq_out = torch.empty((5, batch), dtype=torch.float32, device=logp.device)
    block = min(triton.next_power_of_2(length), 1024)
    _grpo_token_loss_kernel[(batch,)](
        logp, logp if old_logp is None else old_logp, logp if ref_logp is None else ref_logp, mask,
        advantages, seq_weight, grad, seq_out, batch, length, beta, eps_low, eps_high,
        1.0 if delta is None else delta,
        HAS_OLD=old_logp is not None, HAS_REF=ref_logp is not None, HAS_DELTA=delta is not None,
        SEQUENCE_LEVEL=sequence_level, CISPO=cispo, BLOCK_T=block,
    )  # fmt: skip
    return grad, seq_out
