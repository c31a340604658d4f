"""Triton kernel of generalized advantage estimation (GAE, Schulman et al. 2016), PPO's advantages.

Per row (a completion of T token positions) with r_t, V_t the reward and the critic's value at t, both
taken as 0 where the mask is off (so the value past the last response token, the bootstrap, is 0):
    δ_t = r_t + γ·V_{t+1} − V_t,      A_t = δ_t + γλ·A_{t+1},      A_T = V_T = 0
    returns_t = A_t + V_t;            A_t, returns_t = 0 where the mask is off.
The recursion runs backwards over t, so a row is one sequential scan: each program takes BLOCK_B rows and
walks their T positions from the last, carrying A_{t+1} and V_{t+1} in fp32 registers (one column of
BLOCK_B values per step). Work and memory are O(B·T), a small fraction of a training step's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gae_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    advantages_ptr,
    returns_ptr,
    B,
    T,
    gamma,
    lam,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    inside = rows < B
    row_start = rows * T
    next_value = tl.zeros((BLOCK_B,), dtype=tl.float32)
    last_advantage = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for step in range(0, T):
        offsets = row_start + (T - 1 - step)
        on = tl.load(mask_ptr + offsets, mask=inside, other=0) != 0
        reward = tl.where(on, tl.load(rewards_ptr + offsets, mask=inside, other=0.0).to(tl.float32), 0.0)
        value = tl.where(on, tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32), 0.0)
        delta = reward + gamma * next_value - value
        last_advantage = delta + gamma * lam * last_advantage
        advantage = tl.where(on, last_advantage, 0.0)
        tl.store(advantages_ptr + offsets, advantage, mask=inside)
        tl.store(returns_ptr + offsets, tl.where(on, advantage + value, 0.0), mask=inside)
        next_value = value


def generalized_advantage_estimation(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] fp32 of contiguous rewards and values [B, T] (any float dtype) and a
    contiguous bool mask [B, T]."""
    rows, length = rewards.shape
    advantages = torch.empty(rows, length, dtype=torch.float32, device=rewards.device)
    returns = torch.empty_like(advantages)
    block = min(triton.next_power_of_2(max(rows, 1)), 16)
    _gae_kernel[(triton.cdiv(rows, block),)](
        rewards, values, mask, advantages, returns, rows, length, gamma, lam, BLOCK_B=block
    )
    return advantages, returns
