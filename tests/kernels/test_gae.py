"""``generalized_advantage_estimation``: both backends against TRL's former PPOTrainer loop in float64."""

from __future__ import annotations

import pytest
import torch

from fastalign.ops import generalized_advantage_estimation
from tests.conftest import DEVICE


def reference_gae(rewards, values, mask, gamma, lam):
    """TRL's PPOTrainer (0.11-0.19) step 6, in float64, on rewards and values zeroed off the mask (as its
    padding masks zero them), the outputs zeroed there too."""
    rewards = torch.where(mask, rewards.double(), 0.0)
    values = torch.where(mask, values.double(), 0.0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return torch.where(mask, advantages, 0.0), torch.where(mask, returns, 0.0)


def right_padded(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.95, 1.0), (1.0, 1.0), (0.95, 0.95)])
def test_gae_matches_trl_loop(backend, dtype, gamma, lam):
    """Ragged lengths (a full row, an all-masked row), an odd batch (17 rows: more than one program of
    the kernel, the last one partial) and an odd length."""
    lengths = [13, 0, 1, 7, 13, 5, 12, 3, 9, 13, 2, 6, 11, 4, 8, 10, 1]
    mask = right_padded(lengths, 13).to(DEVICE)
    rewards = torch.randn(17, 13, device=DEVICE).to(dtype)
    values = torch.randn(17, 13, device=DEVICE).to(dtype)
    rewards[~mask] = float("nan")  # whatever sits off the mask never reaches the outputs
    values[~mask] = 1e4
    advantages, returns = generalized_advantage_estimation(rewards, values, mask, gamma, lam, backend=backend)
    expected_advantages, expected_returns = reference_gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == returns.dtype == torch.float32
    torch.testing.assert_close(advantages.double(), expected_advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), expected_returns, rtol=1e-5, atol=1e-5)
    assert torch.equal(advantages[1], torch.zeros(13, device=DEVICE))  # the all-masked row
    assert torch.equal(returns[~mask], torch.zeros_like(returns[~mask]))


def test_gae_closed_forms(backend):
    """λ = 1: the discounted return to go minus the value; λ = 0: the one-step TD error."""
    rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0]], device=DEVICE)
    values = torch.tensor([[0.5, -1.0, 2.0, 9.0]], device=DEVICE)
    mask = torch.tensor([[True, True, True, False]], device=DEVICE)
    advantages, returns = generalized_advantage_estimation(rewards, values, mask, 0.5, 1.0, backend=backend)
    expected_returns = torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 0.0]], device=DEVICE)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, expected_returns - values * mask)
    advantages, _ = generalized_advantage_estimation(rewards, values, mask, 0.5, 0.0, backend=backend)
    td_errors = torch.tensor([[1 - 0.5 - 0.5, 2 + 1.0 + 1.0, 3 - 2.0, 0.0]], device=DEVICE)
    torch.testing.assert_close(advantages, td_errors)


def test_gae_single_token_and_empty(backend):
    rewards, values = torch.tensor([[2.0]], device=DEVICE), torch.tensor([[0.5]], device=DEVICE)
    mask = torch.ones(1, 1, dtype=torch.bool, device=DEVICE)
    advantages, returns = generalized_advantage_estimation(rewards, values, mask, 1.0, 0.95, backend=backend)
    assert advantages.item() == 1.5 and returns.item() == 2.0
    empty = torch.zeros(0, 5, device=DEVICE)
    advantages, returns = generalized_advantage_estimation(
        empty, empty, empty.bool(), 1.0, 0.95, backend=backend
    )
    assert advantages.shape == returns.shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mask": torch.ones(2, 3)}, "mask must be a bool tensor"),
        ({"values": torch.zeros(2, 4)}, "must all be"),
        ({"rewards": torch.zeros(2, 3, dtype=torch.long)}, "rewards must be a floating-point"),
        ({"gamma": 1.5}, "gamma must be in"),
        ({"lam": -0.1}, "lam must be in"),
        ({"lam": float("nan")}, "lam must be a finite number"),
        ({"rewards": [[0.0]]}, "rewards must be a torch.Tensor"),
    ],
)
def test_gae_argument_errors(kwargs, message):
    arguments = {
        "rewards": torch.zeros(2, 3),
        "values": torch.zeros(2, 3),
        "mask": torch.ones(2, 3, dtype=torch.bool),
        "gamma": 1.0,
        "lam": 0.95,
    } | kwargs
    with pytest.raises(ValueError, match=message):
        generalized_advantage_estimation(**arguments)
