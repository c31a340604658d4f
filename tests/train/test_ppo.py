"""``fastalign train ppo``: its math against TRL's former PPOTrainer (trl 0.11-0.19) written out in float64,
its config errors, and short runs on the built-in tiny model (metrics, the critic trains, the export is
the policy alone, exact resume), the one-base-model mode under (Q)LoRA, the separate critic under FSDP2
(2 processes = 1), and the example config's reward rising."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastalign.losses.ppo import PPOLoss, shaped_rewards, value_loss
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback
from fastalign.train.objectives import make_objective
from fastalign.train.objectives.ppo import CRITIC_ADAPTER, VALUE_HEAD, VALUE_MODEL
from fastalign.train.reference import AdapterDisabledReference
from fastalign.train.rollout import Rewards
from tests import torchrun
from tests.train.runs import DEFAULTS, logged

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))
DIGITS = "fastalign.builtin:digit_ratio"
TRAIN_WORKER = Path(__file__).with_name("train_worker.py")
INVALID_LOGPROB = 1.0  # TRL's fill value of padding log-probs
B, T, D, V = 5, 6, 8, 19
TEMPERATURE = 0.7


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def masked_whiten(values, mask, shift_mean=True):
    """trl.core.masked_whiten (unbiased variance)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def trl_advantages(scores, logprobs, ref_logprobs, values, mask, args):
    """TRL's PPOTrainer steps 4-6 in float64. One change, fastalign's documented one: the score goes on
    the last response token and the values stop there (TRL puts the score one position later and keeps
    that position's value: ``padding_mask_p1``)."""
    padding_mask = ~mask
    sequence_lengths = mask.sum(-1) - 1
    logprobs = torch.masked_fill(logprobs.double(), padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs.double(), padding_mask, INVALID_LOGPROB)
    values = torch.masked_fill(values.double(), padding_mask, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if args["kl_estimator"] == "k1" else (logr.exp() - 1) - logr
    non_score_reward = -args["kl_coef"] * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(rewards.size(0)), sequence_lengths] += scores.double()
    if args["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask, 0)
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args["gamma"] * nextvalues - values[:, t]
        lastgaelam = delta + args["gamma"] * args["lam"] * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns * mask, kl, non_score_reward


def rollout_batch(seed, width):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([width, 1, 0, 3, width - 1])[: B - 1 if seed else B]
    mask = torch.arange(width)[None] < lengths[:, None]
    logprobs = -torch.rand(len(lengths), width, generator=gen) * 3
    ref = logprobs + torch.randn(len(lengths), width, generator=gen) * 0.3
    values = torch.randn(len(lengths), width, generator=gen)
    return mask, logprobs, ref, values


@pytest.mark.parametrize(
    "args",
    [
        {"kl_coef": 0.05, "kl_estimator": "k1", "whiten_rewards": False, "gamma": 1.0, "lam": 0.95},
        {"kl_coef": 0.2, "kl_estimator": "k3", "whiten_rewards": True, "gamma": 0.9, "lam": 1.0},
    ],
)
def test_advantages_match_trl(args, monkeypatch):
    """The objective's advantages (two micro-batches of different widths, one generation batch: the
    whitening spans both) against TRL's steps 4-6 on the concatenated batch."""
    config = TrainConfig(reward_funcs=[DIGITS], missing_eos_penalty=1.5, **args)
    objective = make_objective("ppo", config, CPU)
    parts = [rollout_batch(0, 6), rollout_batch(1, 4)]
    batches = [
        {"completion_mask": mask.long(), "old_per_token_logps": logp, "ref_per_token_logps": ref, "v": values}
        for mask, logp, ref, values in parts
    ]
    monkeypatch.setattr(objective, "values", lambda batch: batch["v"])
    scores = torch.tensor([0.3, -1.0, 2.0, 0.5, float("nan"), 1.0, 0.0, 4.0, -2.0])
    truncated = torch.tensor([False, True, False, False, True, False, False, True, False])
    rewards = Rewards(scores[:, None], scores, torch.ones(9), truncated, slice(0, 9))
    first, metrics = objective.advantages(rewards, batches, group=1, reused=True)

    expected_scores = torch.nan_to_num(scores) - 1.5 * truncated
    mask = torch.cat([parts[0][0], torch.nn.functional.pad(parts[1][0], (0, 2))])

    def padded(index):
        return torch.cat([parts[0][index], torch.nn.functional.pad(parts[1][index], (0, 2))])

    advantages, returns, kl, non_score = trl_advantages(
        expected_scores, padded(1), padded(2), padded(3), mask, args
    )
    ours = torch.cat(
        [batches[0]["token_advantages"], torch.nn.functional.pad(batches[1]["token_advantages"], (0, 2))]
    )
    ours_returns = torch.cat([batches[0]["returns"], torch.nn.functional.pad(batches[1]["returns"], (0, 2))])
    torch.testing.assert_close(ours.double(), advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_returns.double(), returns, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first.double(), advantages[:, 0])
    assert "ref_per_token_logps" not in batches[0]  # folded into the rewards
    masked_kl = torch.where(mask, kl, 0.0)
    assert metrics["objective/kl"] == pytest.approx(float(masked_kl.sum(1).mean()), rel=1e-5)
    non_score = torch.where(mask, non_score, 0.0).sum(1).mean()
    assert metrics["objective/non_score_reward"] == pytest.approx(float(non_score), rel=1e-5)
    assert metrics["objective/scores"] == pytest.approx(float(expected_scores.mean()), rel=1e-6)
    assert metrics["objective/rlhf_reward"] == pytest.approx(
        float(non_score + expected_scores.mean()), rel=1e-5
    )
    assert metrics["val/num_eos_tokens"] == 6


def test_shaped_rewards_without_a_reference_are_the_score_at_the_last_token():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    result = shaped_rewards(torch.tensor([2.0, 5.0, -1.0]), torch.zeros(3, 3), None, mask, 0.05, "k1")
    assert torch.equal(result.rewards, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]))
    assert torch.equal(result.kl, torch.zeros(3, 3))


def test_policy_loss_and_gradients_match_trl():
    """PPOLoss (fused head) against TRL's loss on explicit logits: value, gradient, metrics."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, D, generator=gen).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T)[None] < torch.tensor([6, 2, 4, 1, 5])[:, None]
    advantages = torch.randn(B, T, generator=gen) * mask
    with torch.no_grad():
        logp = (hidden @ weight.T / TEMPERATURE).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = logp + torch.randn(B, T, generator=gen) * 0.3  # some ratios leave [0.8, 1.2]
    output = PPOLoss(cliprange=0.2, temperature=TEMPERATURE, backend="torch")(
        hidden, weight, ids, mask.long(), advantages, old_logps=old
    )
    output.loss.backward()
    ours = hidden.grad.clone(), weight.grad.clone()

    hidden.grad = weight.grad = None
    h, w = hidden.double(), weight.double()
    logits = h @ w.T / TEMPERATURE
    new_logprobs = torch.masked_fill(
        logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1), ~mask, INVALID_LOGPROB
    )
    mb_logprobs = torch.masked_fill(old.double(), ~mask, INVALID_LOGPROB)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -advantages.double() * ratio
    pg_losses2 = -advantages.double() * torch.clamp(ratio, 0.8, 1.2)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
    pg_loss.backward()
    torch.testing.assert_close(output.loss.double(), pg_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[0].double(), hidden.grad.double(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours[1].double(), weight.grad.double(), rtol=1e-4, atol=1e-6)
    metrics = output.metrics
    clipfrac = masked_mean((pg_losses2 > pg_losses).double(), mask)
    assert 0 < float(clipfrac) < 1
    assert float(metrics["policy/clipfrac_avg"]) == pytest.approx(float(clipfrac), rel=1e-5)
    approxkl = masked_mean(0.5 * logprobs_diff.detach() ** 2, mask)  # TRL's mean also counts padding (0s)
    assert float(metrics["policy/approxkl_avg"]) == pytest.approx(float(approxkl), rel=1e-4)
    probs = logits.detach().softmax(-1)
    entropy = torch.logsumexp(logits.detach(), -1) - (probs * logits.detach()).sum(-1)
    assert float(metrics["policy/entropy_avg"]) == pytest.approx(float(masked_mean(entropy, mask)), rel=1e-4)
    assert float(metrics["val/ratio"]) == pytest.approx(float(masked_mean(ratio.detach(), mask)), rel=1e-5)


def test_value_loss_matches_trl():
    gen = torch.Generator().manual_seed(4)
    mask = torch.arange(T)[None] < torch.tensor([6, 2, 0, 1, 5])[:, None]
    vpred = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mb_values = vpred + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    mb_return = torch.randn(B, T, generator=gen, dtype=torch.float64)
    loss, clipfrac = value_loss(vpred, mb_values, mb_return, mask, 0.2)
    vpredclipped = torch.clamp(vpred, mb_values - 0.2, mb_values + 0.2)
    vf_losses1, vf_losses2 = torch.square(vpred - mb_return), torch.square(vpredclipped - mb_return)
    assert float(loss) == pytest.approx(float(0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)))
    assert float(clipfrac) == pytest.approx(float(masked_mean((vf_losses2 > vf_losses1).double(), mask)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_peft": True, "value_model_path": "tiny-qwen2"}, "config key 'value_model_path' .* use_peft"),
        ({"use_peft": True, "gradient_checkpointing": True}, "config key 'gradient_checkpointing'"),
        ({"epsilon": 0.3}, r"config key 'epsilon' \(0.3\) is for grpo, rloo; ppo does not read it"),
        ({"num_generations": 4}, "config key 'num_generations' .* ppo does not read it"),
        ({"beta": 0.1}, "config key 'beta' .* ppo does not read it"),
        ({"reward_funcs": []}, "config key 'reward_funcs' must name at least one"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_objective("ppo", TrainConfig(**{"reward_funcs": [DIGITS], **overrides}), CPU)


def test_the_one_base_model_mode_runs_in_one_process():
    two = DistributedContext(0, 2, 0, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"config key 'use_peft': .* runs in one process"):
        make_objective("ppo", TrainConfig(reward_funcs=[DIGITS], use_peft=True), two)


def test_value_model_path_may_name_the_policy_under_lora():
    config = TrainConfig(reward_funcs=[DIGITS], use_peft=True, value_model_path="tiny-llama")
    assert make_objective("ppo", config, CPU).options.value_model_path == "tiny-llama"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kl_estimator", "k2", "one of k1, k3"),
        ("lam", 1.5, r"in \[0, 1\]"),
        ("num_ppo_epochs", 0, "at least 1"),
    ],
)
def test_config_value_checks(key, value, message):
    from fastalign.train.config import check_config

    with pytest.raises(ConfigError, match=f"config key '{key}' must be {message}"):
        check_config(TrainConfig(**{key: value}))


# --- runs ----------------------------------------------------------------------------------------------


def tiny_config(output_dir: Path, **overrides) -> TrainConfig:
    """Two PPO steps on the built-in prompts (``tests.train.runs.DEFAULTS``), into ``output_dir``."""
    ppo = dict(per_device_train_batch_size=4, max_completion_length=6, num_ppo_epochs=2, save_strategy="no")
    return TrainConfig(
        **{"output_dir": str(output_dir), "reward_funcs": [DIGITS], **DEFAULTS, **ppo, **overrides}
    )


class _CriticWeights(Callback):
    """Records the critic's score head before training and after each step."""

    def on_train_begin(self, engine):
        self.before = getattr(engine.model, VALUE_MODEL).score.weight.detach().clone()

    def on_step_end(self, engine, metrics):
        self.after = getattr(engine.model, VALUE_MODEL).score.weight.detach().clone()


PPO_METRICS = (
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
)


def test_ppo_trains_policy_and_critic_and_exports_the_policy(tmp_path):
    from fastalign.train.run import run_training

    critic = _CriticWeights()
    run_training(tiny_config(tmp_path), "ppo", callbacks=[critic])
    rows = logged(tmp_path)
    assert len(rows) == 2
    for row in rows:
        for key in (*PPO_METRICS, "loss", "grad_norm"):
            assert torch.isfinite(torch.tensor(row[key])), (key, row)
    assert not torch.equal(critic.before, critic.after)  # the critic's head trained
    saved = load_file(tmp_path / "model.safetensors")
    assert saved and not any(VALUE_MODEL in key or "score" in key for key in saved)


@pytest.mark.parametrize(
    "lora", [{}, {"use_peft": True, "lora_target_modules": ["all-linear"]}], ids=["full", "lora"]
)
def test_ppo_resumes_exactly(tmp_path, lora):
    """A run resumed from checkpoint-2 (policy, critic, optimizer; under LoRA both adapters and the value
    head; a generation boundary) logs steps 3 and 4 as the run that went on."""
    from fastalign.train.run import run_training

    straight = tiny_config(tmp_path / "straight", max_steps=4, save_strategy="steps", save_steps=2, **lora)
    run_training(straight, "ppo")
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    run_training(
        tiny_config(tmp_path / "resumed", max_steps=4, resume_from_checkpoint=str(checkpoint), **lora), "ppo"
    )
    straight = {row["step"]: row for row in logged(tmp_path / "straight")}
    resumed = {row["step"]: row for row in logged(tmp_path / "resumed")}
    for step in (3, 4):
        for key in ("loss", "loss/value_avg", "objective/scores", "val/ratio"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (step, key)


# --- the one-base-model mode (use_peft) ------------------------------------------------------------------


class _AdapterWeights(Callback):
    """The trainable tensors (both adapters, the value head) and one frozen base weight, before training
    and after it, and what the objective's reference is."""

    def on_train_begin(self, engine):
        self.before = self._snapshot(engine.model)
        self.reference = engine.objective.reference

    def on_step_end(self, engine, metrics):
        self.after = self._snapshot(engine.model)

    @staticmethod
    def _snapshot(model):
        return {
            name: param.detach().clone()
            for name, param in model.named_parameters()
            if "lora_B" in name or VALUE_HEAD in name or name.endswith("embed_tokens.weight")
        }


def test_lora_trains_two_adapters_and_a_value_head_on_one_4bit_base_and_exports_the_policy_adapter(tmp_path):
    """QLoRA: one frozen 4-bit base; the policy's and the critic's adapters and the value head train;
    the reference is the base (adapters off, no second model); the export is the policy's adapter alone."""
    from fastalign.train.run import run_training

    weights = _AdapterWeights()
    config = tiny_config(tmp_path, use_peft=True, lora_target_modules=["all-linear"], quantization="nf4")
    run_training(config, "ppo", callbacks=[weights])
    assert isinstance(weights.reference, AdapterDisabledReference)
    groups = {
        "policy": ".default.",
        "critic": f".{CRITIC_ADAPTER}.",
        "head": VALUE_HEAD,
        "base": "embed_tokens",
    }
    changed = {
        group: [
            not torch.equal(weights.before[name], weights.after[name])
            for name in weights.before
            if key in name
        ]
        for group, key in groups.items()
    }
    assert all(changed["policy"]) and all(changed["critic"]) and changed["head"] == [True], changed
    assert changed["base"] == [False]
    rows = logged(tmp_path)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(row["loss/value_avg"])) for row in rows)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and not any(CRITIC_ADAPTER in key or VALUE_HEAD in key for key in saved)
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / CRITIC_ADAPTER).exists()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == "LORA"


# --- the separate critic under FSDP2 ---------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_under_fsdp2_equal_one(tmp_path):
    """2 ranks × 2 prompts (gloo; policy, critic and reference each sharded) = one process with 2 micro-
    batches of 2: the same sampling, whitening over both ranks' tokens, losses, gradient norms and
    metrics; step 2 samples again (KL ≠ 0, values of the trained critic). The export is the policy alone."""
    from fastalign.train.run import run_training

    one = tiny_config(
        tmp_path / "one", num_ppo_epochs=1, per_device_train_batch_size=2, gradient_accumulation_steps=2
    )
    two = dataclasses.replace(one, gradient_accumulation_steps=1, output_dir=str(tmp_path / "two"))
    run_training(one, "ppo")
    torchrun.run_two_processes(TRAIN_WORKER, json.dumps([["ppo", dataclasses.asdict(two)]]), timeout=900)
    rows_one, rows_two = logged(one.output_dir), logged(two.output_dir)
    assert len(rows_one) == len(rows_two) == 2 and rows_one[1]["objective/kl"] != 0.0
    for one_row, two_row in zip(rows_one, rows_two, strict=True):
        for key in (*PPO_METRICS, "loss", "grad_norm"):
            assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), (one_row["step"], key)
    saved = load_file(tmp_path / "two" / "model.safetensors")
    assert saved and not any(VALUE_MODEL in key or "score" in key for key in saved)


# --- the example learns -------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"


def test_the_example_raises_the_reward(tmp_path):
    """examples/ppo_tiny.yaml's first 12 steps (6 generation batches of 16) at seed 3: the digit share of
    the last two generations' completions is above the first two's (0.20 against 0.11 here). A tiny
    random policy's climb depends on its draws: at 12 steps seeds 0-5 climbed by 0.03 to 0.09 with the
    rollout engine's float64 draws (seed 1 by 0.08 with its former float32 ones); at 24 steps seeds 0-2
    reached 0.20-0.35 with the float32 draws and 0.28-0.45 with model.generate."""
    from fastalign.train.config import load_config
    from fastalign.train.run import run_training

    config = dataclasses.replace(
        load_config(EXAMPLE), output_dir=str(tmp_path), max_steps=12, logging_steps=2, seed=3
    )
    run_training(config, "ppo")
    scores = [row["objective/scores"] for row in logged(tmp_path)]
    assert len(scores) == 6
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.04, scores
