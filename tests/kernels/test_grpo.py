"""GRPO ops: group advantages and the token loss, both backends, against float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch

from fastalign.ops.grpo import TokenLossConfig, combine_rewards, group_advantages, grpo_token_loss
from tests.conftest import DEVICE

NAN = float("nan")


def reference_advantages(rewards, group_size, scale, rloo, eps=1e-4):
    """Written from the definitions, one group at a time, in float64."""
    flat = [float(r) for r in rewards.reshape(-1)]
    valid_all = [r for r in flat if not math.isnan(r)]
    batch_mean = sum(valid_all) / len(valid_all)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in valid_all) / max(len(valid_all) - 1, 1))
    out, zero_std = [], 0
    for start in range(0, len(flat), group_size):
        group = flat[start : start + group_size]
        valid = [r for r in group if not math.isnan(r)]
        n = len(valid)
        mean = sum(valid) / max(n, 1)
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / max(n - 1, 1))
        zero_std += std == 0
        for r in group:
            if math.isnan(r):
                out.append(0.0)
                continue
            a = (r - (sum(valid) - r) / (n - 1) if n > 1 else 0.0) if rloo else r - mean
            a = a / (std + eps) if scale == "group" else a / (batch_std + eps) if scale == "batch" else a
            out.append(a)
    return torch.tensor(out, dtype=torch.float64), zero_std


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_definitions(backend, scale, estimator):
    rewards = torch.tensor(
        [
            [1.0, 2.0, NAN, 4.0, 0.5],
            [5.0, 5.0, 5.0, 5.0, 5.0],
            [NAN, NAN, NAN, 3.0, NAN],
            [0.0, 1.0, 0.0, 1.0, 1.0],
        ],
        device=DEVICE,
    )
    result = group_advantages(rewards, 5, scale_rewards=scale, advantage_estimator=estimator, backend=backend)
    expected, zero_std = reference_advantages(rewards, 5, scale, estimator == "rloo")
    assert result.advantages.shape == rewards.shape and torch.isfinite(result.advantages).all()
    torch.testing.assert_close(
        result.advantages.reshape(-1).double(), expected.to(DEVICE), rtol=1e-5, atol=1e-5
    )
    assert int(result.num_zero_std_groups) == zero_std == 2  # all-equal group and single-reward group


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_equal_rewards_whose_mean_rounds_get_zero_advantage(backend, estimator):
    """7 × 0.7 sums to 4.9 in fp32 and 4.9 / 7 ≠ 0.7: the group is still zero-std with advantages 0
    (on CUDA even 25 / 5 rounds, as Triton's fp32 division is approximate)."""
    rewards = torch.tensor([[0.7] * 7, [0.3] * 6 + [NAN]], device=DEVICE)
    result = group_advantages(rewards, 7, advantage_estimator=estimator, backend=backend)
    assert torch.equal(result.advantages, torch.zeros_like(rewards))
    assert torch.equal(result.group_std, torch.zeros(2, device=DEVICE))
    assert int(result.num_zero_std_groups) == 2


def test_group_advantages_flat_and_random(backend):
    rewards = torch.randn(6 * 7, device=DEVICE)
    rewards[::5] = NAN
    result = group_advantages(rewards, 7, backend=backend)
    expected, _ = reference_advantages(rewards, 7, "group", False)
    torch.testing.assert_close(result.advantages.double(), expected.to(DEVICE), rtol=1e-5, atol=1e-5)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.randn(10), 4)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.randn(4), 1)
    group_advantages(torch.randn(4), 1, scale_rewards="batch")  # fine without group statistics
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(torch.randn(4), 2, scale_rewards="std")
    with pytest.raises(ValueError, match="advantage_estimator"):
        group_advantages(torch.randn(4), 2, advantage_estimator="ppo")


def test_combine_rewards_skips_none():
    per_func = torch.tensor([[1.0, NAN], [NAN, NAN], [2.0, 3.0]])
    total = combine_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert total[0] == 1.0 and math.isnan(total[1]) and total[2] == 3.5


CONFIGS = {
    "clip": TokenLossConfig(
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, sequence_level=False, cispo=False
    ),
    "delta": TokenLossConfig(
        beta=0.0, eps_low=0.2, eps_high=0.28, delta=1.4, sequence_level=False, cispo=False
    ),
    "sequence": TokenLossConfig(
        beta=0.04, eps_low=0.2, eps_high=0.2, delta=None, sequence_level=True, cispo=False
    ),
    "cispo": TokenLossConfig(
        beta=0.0, eps_low=0.2, eps_high=1.3, delta=None, sequence_level=False, cispo=True
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_token_loss_backends_agree_on_long_completions(config):
    """64k+ tokens per completion: one program per completion loops over them (no grid limit)."""
    cfg = CONFIGS[config]
    batch, length = 2, 70_001
    logp = (torch.randn(batch, length, device=DEVICE) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(batch, length, device=DEVICE) * 0.2
    ref = logp.detach() + torch.randn(batch, length, device=DEVICE) * 0.1
    mask = (torch.rand(batch, length, device=DEVICE) > 0.1).float()
    advantages, weights = torch.tensor([0.7, -1.2], device=DEVICE), torch.full((batch,), 1e-5, device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        logp.grad = None
        loss, sums = grpo_token_loss(
            logp, mask, advantages, weights, cfg, old_logp=old, ref_logp=ref, backend=backend
        )
        loss.backward()
        results.append((loss.detach(), sums, logp.grad.clone()))
    for torch_value, triton_value in zip(*results, strict=True):
        torch.testing.assert_close(triton_value, torch_value, rtol=1e-4, atol=1e-6)
