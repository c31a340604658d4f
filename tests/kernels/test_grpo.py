"""GRPO ops: group advantages and the token loss, both backends, against float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch

from fastalign.ops.grpo import (
    TokenLossConfig,
    _quantile,
    combine_rewards,
    group_advantages,
    grpo_token_loss,
    high_entropy_mask,
)
from tests.conftest import DEVICE
from tests.helpers import require

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


def reference_token_loss(logp, mask, advantages, weights, cfg, old, ref, keep):
    """TRL's per-token loss in float64 on [B, T] log-probs (token level), the entropy mask ``keep`` on the
    policy term only; returns the weighted sum."""
    logp, old, ref, adv = logp.double(), old.double(), ref.double(), advantages.double()[:, None]
    coef_1 = torch.exp(logp - old)
    if cfg.cispo:
        policy = -torch.clamp(coef_1, max=cfg.eps_high).detach() * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg.eps_low, 1 + cfg.eps_high)
        capped = coef_1 if cfg.delta is None else torch.clamp(coef_1, max=cfg.delta)
        policy = -torch.min(capped * adv, coef_2 * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    if cfg.bias_correction_kl:
        kl = kl * coef_1
    per_token = policy * keep.double() + cfg.beta * kl
    return (per_token * mask.double() * weights.double()[:, None]).sum()


@pytest.mark.parametrize("config", ["clip", "delta", "cispo", "bias_kl"])
def test_token_loss_keep_masks_the_policy_term_only(backend, config):
    """``keep``: the policy term (loss and gradient) of the dropped tokens is 0, their KL term is not."""
    cfg = CONFIGS["clip"] if config == "bias_kl" else CONFIGS[config]
    if config == "bias_kl":
        cfg = TokenLossConfig(**{**cfg.__dict__, "bias_correction_kl": True})
    gen = torch.Generator().manual_seed(5)
    batch, length = 3, 1031  # odd: a partial block
    logp = (torch.randn(batch, length, generator=gen) * 0.3 - 1).to(DEVICE).requires_grad_()
    old = logp.detach() + (torch.randn(batch, length, generator=gen) * 0.2).to(DEVICE)
    ref = logp.detach() + (torch.randn(batch, length, generator=gen) * 0.1).to(DEVICE)
    mask = (torch.rand(batch, length, generator=gen) > 0.1).to(DEVICE)
    keep = (torch.rand(batch, length, generator=gen) > 0.7).to(DEVICE) & mask
    advantages = torch.tensor([0.7, -1.2, 0.3], device=DEVICE)
    weights = torch.tensor([1e-3, 2e-3, 5e-4], device=DEVICE)
    loss, sums = grpo_token_loss(
        logp, mask, advantages, weights, cfg, old_logp=old, ref_logp=ref, keep=keep, backend=backend
    )
    loss.backward()
    leaf = logp.detach().double().requires_grad_()
    expected = reference_token_loss(leaf, mask, advantages, weights, cfg, old, ref, keep)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp.grad.double(), leaf.grad, rtol=1e-5, atol=1e-9)
    # the metrics count every masked-in token, kept or not (as TRL's)
    _, unmasked_sums = grpo_token_loss(
        logp.detach(), mask, advantages, weights, cfg, old_logp=old, ref_logp=ref, backend=backend
    )
    torch.testing.assert_close(sums[1:], unmasked_sums[1:])


def test_sequence_level_keep_passes_gradient_through_the_completion_weight(backend):
    """At sequence level a kept token's term depends on every token of its completion (through the
    completion's ratio): the gradient reaches the dropped tokens too (autograd, either backend)."""
    cfg = TokenLossConfig(beta=0.0, eps_low=0.2, eps_high=0.28, delta=None, sequence_level=True, cispo=False)
    gen = torch.Generator().manual_seed(6)
    logp = (torch.randn(2, 9, generator=gen) * 0.3 - 1).to(DEVICE).requires_grad_()
    old = logp.detach() + (torch.randn(2, 9, generator=gen) * 0.05).to(DEVICE)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    keep = torch.zeros_like(mask)
    keep[:, :3] = True
    advantages, weights = torch.tensor([0.7, -1.2], device=DEVICE), torch.full((2,), 0.1, device=DEVICE)
    loss, _ = grpo_token_loss(logp, mask, advantages, weights, cfg, old_logp=old, keep=keep, backend=backend)
    loss.backward()
    leaf = logp.detach().double().requires_grad_()
    log_w = ((leaf - old.double()).sum(-1) / 9)[:, None]
    coef_1, adv = log_w.exp(), advantages.double()[:, None]
    per_token = -torch.min(coef_1 * adv, coef_1.clamp(0.8, 1.28) * adv) * keep.double()
    expected = (per_token * weights.double()[:, None]).sum()
    expected.backward()
    torch.testing.assert_close(loss.double(), expected)
    torch.testing.assert_close(logp.grad.double(), leaf.grad)
    assert (logp.grad[:, 3:] != 0).all()


def test_quantile_is_torch_quantile_without_its_size_limit():
    gen = torch.Generator().manual_seed(7)
    for n in (1, 2, 3, 10, 1001):
        for values in (torch.rand(n, generator=gen) * 5, torch.randint(0, 3, (n,), generator=gen).float()):
            for q in (0.0, 1 - 0.8, 0.5, 1 - 0.2, 1.0, 0.123):
                assert torch.equal(_quantile(values, q), torch.quantile(values, q)), (n, q)
    large = torch.rand(2**24 + 3, generator=gen)  # torch.quantile refuses more than 2^24 values
    assert abs(_quantile(large, 0.8).item() - 0.8) < 1e-3


class _Accelerator:
    """What TRL's ``get_high_entropy_mask`` asks of accelerate, for ``ranks`` processes of which this is
    the first: the others' local values are given."""

    def __init__(self, others):
        self.others = others

    def pad_across_processes(self, local, dim, pad_index):
        width = max([len(local), *map(len, self.others)])
        return torch.cat([local, local.new_full((width - len(local),), pad_index)])

    def gather(self, padded):
        parts = [padded, *(self.pad_across_processes(other, 0, -1e9) for other in self.others)]
        return torch.cat(parts)


@pytest.mark.parametrize("quantile", [1.0, 0.8, 0.2, 0.0])
@pytest.mark.parametrize("ranks", [1, 3])
def test_high_entropy_mask_is_trls(quantile, ranks):
    """TRL's own ``GRPOTrainer.get_high_entropy_mask`` (with the processes simulated) is the oracle:
    ties (entropies on a grid) and padding included."""
    require("trl")
    from trl import GRPOTrainer

    gen = torch.Generator().manual_seed(8)
    entropy = (torch.rand(5, 13, generator=gen) * 20).round() / 4  # many ties
    mask = torch.rand(5, 13, generator=gen) > 0.3
    others = [(torch.rand(n, generator=gen) * 20).round() / 4 for n in (17, 4)][: ranks - 1]
    trainer = type("Trainer", (), {"accelerator": _Accelerator(others)})()
    expected = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask.long(), 1 - quantile)
    ours = high_entropy_mask(entropy, mask, quantile, lambda local: torch.cat([local, *others]))
    assert torch.equal(ours, expected)
    if quantile == 1.0:
        assert torch.equal(ours, mask)


def test_high_entropy_mask_without_tokens_keeps_none():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert not high_entropy_mask(torch.rand(2, 3), mask, 0.2).any()
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        high_entropy_mask(torch.rand(2, 3), mask, 1.2)
