"""GRPO ops: ``group_advantages`` and ``grpo_token_loss``, dispatch and PyTorch implementations.

The math is stated in ``fastalign/kernels/grpo.py``; the PyTorch functions here follow TRL's
``GRPOTrainer`` formulas op for op (and let autograd derive the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from fastalign.ops.backend import Backend, resolve_backend

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # shaped like the rewards, fp32; 0 where the reward is NaN
    num_zero_std_groups: torch.Tensor  # groups whose rewards are all equal (the frac_reward_zero_std metric)
    group_std: torch.Tensor  # [groups] std of each group's non-NaN rewards (unbiased)


def _nan_group_stats(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, unbiased std) of each row's non-NaN values."""
    valid = ~torch.isnan(groups)
    count = valid.sum(-1).float()
    mean = torch.where(valid, groups, 0.0).sum(-1) / count.clamp_min(1.0)
    centered = torch.where(valid, groups - mean[:, None], 0.0)
    std = (centered.square().sum(-1) / (count - 1.0).clamp_min(1.0)).sqrt()
    return count, mean, std


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    _, _, std = _nan_group_stats(rewards.reshape(1, -1))
    return std.reshape(1)


def _group_advantages_torch(groups, rloo: bool, scale: str, batch_std, eps: float):
    valid = ~torch.isnan(groups)
    count, mean, std = _nan_group_stats(groups)
    centered = torch.where(valid, groups - mean[:, None], 0.0)
    if rloo:
        factor = torch.where(count > 1.0, count / (count - 1.0).clamp_min(1.0), 0.0)
        centered = centered * factor[:, None]
    if scale == "group":
        centered = centered / (std[:, None] + eps)
    elif scale == "batch":
        centered = centered / (batch_std + eps)
    return torch.where(valid, centered, 0.0), std


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    advantage_estimator: Literal["grpo", "rloo"] = "grpo",
    eps: float = 1e-4,
    backend: Backend = "auto",
) -> GroupAdvantages:
    """Advantages of ``rewards`` [B·G] or [B, G] (completions of one prompt adjacent) within groups.

    'grpo': reward minus its group mean; 'rloo': minus the mean of the group's other rewards. Then
    divided by the group std + eps ('group'), the batch std + eps ('batch'), or left ('none'). NaN
    rewards (no reward function applied to the sample) are left out of every statistic and get
    advantage 0. Sum several reward functions first (``combine_rewards``).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {advantage_estimator!r}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) must be a positive multiple of "
            f"group_size ({group_size})"
        )
    if group_size < 2 and (scale_rewards == "group" or advantage_estimator == "rloo"):
        raise ValueError(
            "group_size must be at least 2 for scale_rewards='group' or advantage_estimator='rloo', "
            f"got {group_size}"
        )
    if rewards.dim() == 2 and rewards.shape[1] != group_size:
        raise ValueError(
            f"rewards [B, G] must have G = group_size = {group_size}, got {tuple(rewards.shape)}"
        )
    flat = rewards.reshape(-1).float().contiguous()
    batch_std = _batch_std(flat) if scale_rewards == "batch" else torch.ones(1, device=flat.device)
    rloo = advantage_estimator == "rloo"
    if resolve_backend(backend, flat) == "torch":
        advantages, std = _group_advantages_torch(
            flat.view(-1, group_size), rloo, scale_rewards, batch_std, eps
        )
    else:
        from fastalign.kernels import grpo as kernels

        scale = {"none": 0, "group": 1, "batch": 2}[scale_rewards]
        advantages, std = kernels.group_advantages(flat, group_size, rloo, scale, batch_std, eps)
    zero_std = torch.isclose(std, torch.zeros_like(std)).sum()
    return GroupAdvantages(advantages.view(rewards.shape), zero_std, std)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over reward functions [N, F] → [N], skipping NaN (a function that returned None);
    NaN where every function returned None, so the sample stays out of the group statistics."""
    weights = (
        torch.ones(rewards_per_func.shape[1], device=rewards_per_func.device) if weights is None else weights
    )
    total = (rewards_per_func * weights.to(rewards_per_func)).nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), float("nan"), total)


# --------------------------------------------------------------------------------------------------
# The token loss.


@dataclass(frozen=True)
class TokenLossConfig:
    beta: float
    eps_low: float
    eps_high: float
    delta: float | None
    sequence_level: bool
    cispo: bool


def _token_loss_torch(logp, old_logp, ref_logp, mask, advantages, seq_weight, config: TokenLossConfig):
    """TRL's per-token loss, aggregated with the weights ``mask · seq_weight``; returns (loss, [5, B])."""
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    if config.sequence_level:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)
    adv = advantages.unsqueeze(1)
    if config.cispo:
        per_token_loss = -torch.clamp(coef_1, max=config.eps_high).detach() * adv * logp
        high = (coef_1 > config.eps_high) & (adv > 0)
        low = torch.zeros_like(high)
    else:
        coef_2 = torch.clamp(coef_1, 1 - config.eps_low, 1 + config.eps_high)
        if config.delta is not None:
            coef_1 = torch.clamp(coef_1, max=config.delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        low = (coef_1 < 1 - config.eps_low) & (adv < 0)
        high = (coef_1 > 1 + config.eps_high) & (adv > 0)
    region = low | high
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token_loss = per_token_loss + config.beta * kl
    per_token_loss = per_token_loss.expand_as(mask)
    loss_per_seq = (per_token_loss * mask * seq_weight[:, None]).sum(-1)
    sums = [(flag.expand_as(mask).float() * mask).sum(-1) for flag in (low, high, region)]
    seq_out = torch.stack([loss_per_seq.detach(), (kl.detach() * mask).sum(-1), *sums])
    return loss_per_seq.sum(), seq_out


class _TokenLossFunction(torch.autograd.Function):
    """The Triton kernel: the gradient w.r.t. the log-probs is formed in forward."""

    @staticmethod
    def forward(ctx, logp, old_logp, ref_logp, mask, advantages, seq_weight, config: TokenLossConfig):
        from fastalign.kernels import grpo as kernels

        grad, seq_out = kernels.grpo_token_loss(
            logp.contiguous(), None if old_logp is None else old_logp.contiguous(),
            None if ref_logp is None else ref_logp.contiguous(), mask.contiguous(), advantages.contiguous(),
            seq_weight.contiguous(), beta=config.beta, eps_low=config.eps_low, eps_high=config.eps_high,
            delta=config.delta, sequence_level=config.sequence_level, cispo=config.cispo,
        )  # fmt: skip
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(seq_out)
        return seq_out[0].sum(), seq_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_seq_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None, None


def grpo_token_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    seq_weight: torch.Tensor,
    config: TokenLossConfig,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_b seq_weight_b Σ_t mask·loss_t of log-probs [B, T] (differentiable w.r.t. ``logp``), and the
    per-completion sums [5, B] (loss share, Σ mask·kl, low-, high- and region-clipped token counts)."""
    mask = mask.to(torch.float32)
    logp = logp.float()
    old_logp = None if old_logp is None else old_logp.float()
    ref_logp = None if ref_logp is None else ref_logp.float()
    if resolve_backend(backend, logp) == "torch":
        return _token_loss_torch(
            logp, old_logp, ref_logp, mask, advantages.float(), seq_weight.float(), config
        )
    return _TokenLossFunction.apply(
        logp, old_logp, ref_logp, mask, advantages.float(), seq_weight.float(), config
    )
