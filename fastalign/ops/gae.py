"""``generalized_advantage_estimation``: PPO's advantages and returns, dispatch and PyTorch implementation.

The math is stated in ``fastalign/kernels/gae.py``. The PyTorch function is the backward loop of TRL's
former ``PPOTrainer`` (and OpenRLHF's ``get_advantages_and_returns``) on rewards and values zeroed where
the mask is off, in fp32.
"""

from __future__ import annotations

import torch

from fastalign.ops import validation
from fastalign.ops.backend import Backend, resolve_backend


def _gae_torch(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.where(mask, rewards.float(), 0.0)
    values = torch.where(mask, values.float(), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = last_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_advantage = delta + gamma * lam * last_advantage
        advantages[:, t] = last_advantage
        next_value = values[:, t]
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, advantages + values


def generalized_advantage_estimation(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (= advantages + values), both [B, T] fp32, of per-token ``rewards`` and
    critic ``values`` [B, T] (any float dtype) over the tokens where the bool ``mask`` [B, T] is True.

    Rewards and values are taken as 0 where the mask is off, so the value after a row's last token (the
    bootstrap) is 0: a completion ends the episode. Both outputs are 0 there. The mask is meant to be a
    right-padded response mask (ragged lengths); any mask works, a gap passing the recursion through
    zeros. ``gamma`` (discount) and ``lam`` (GAE's λ) are in [0, 1]: λ = 1 gives the discounted return
    minus the value (Monte-Carlo), λ = 0 the one-step TD error."""
    for name, tensor in (("rewards", rewards), ("values", values), ("mask", mask)):
        validation.require_tensor(name, tensor)
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True on response tokens), got dtype {mask.dtype}")
    for name, tensor in (("rewards", rewards), ("values", values)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    gamma, lam = validation.real("gamma", gamma), validation.real("lam", lam)
    for name, number in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= number <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {number}")
    if rewards.numel() == 0:
        empty = torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)
        return empty, empty.clone()
    if resolve_backend(backend, rewards) == "torch":
        return _gae_torch(rewards, values, mask, gamma, lam)
    from fastalign.kernels import gae as kernels

    return kernels.generalized_advantage_estimation(
        rewards.contiguous(), values.contiguous(), mask.contiguous(), gamma, lam
    )
