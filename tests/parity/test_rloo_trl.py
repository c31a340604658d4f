"""TRL 1.16 as the oracle for RLOO, on the same tiny model and the same completions:

- the loss: TRL's own ``RLOOTrainer._compute_loss`` and fastalign's ``RLOOLoss`` (inside the patched
  model's forward) give the same loss, gradients and metrics, with importance ratios far enough from 1
  that both clip sides are hit;
- the advantages: TRL's ``_generate_and_score_completions`` (its generation and reward calls replaced by
  the given completions and rewards, so that nothing else differs) and fastalign's rollout pieces (the
  policy's and the reference's log-probs, then ``RLOOObjective.advantages``) give the same advantages
  and reward metrics: the KL folded into the reward, the leave-one-out baseline, an unscorable
  completion, ``reward_clip_range`` and ``normalize_advantages``.

Prompts have one length (TRL scores left-padded prompts at positions that count the padding)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_prompt_rows, tiny_tokenizer
from fastalign.losses.rloo import RLOOLoss
from fastalign.ops import combine_rewards
from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.rloo import RLOOObjective
from fastalign.train.reference import Reference
from fastalign.train.rollout import Completions, Rewards
from tests.helpers import require
from tests.parity.test_grpo_trl import COMPLETION, GROUP, PROMPT, trl_args

pytestmark = pytest.mark.slow

LENGTHS = [7, 3, 5, 1, 6, 7, 2, 4]


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two prompts × a group of 4 completions of different lengths, with advantages and a shift of the
    old policy's sequence log-probs large enough to clip."""
    gen = torch.Generator().manual_seed(11)
    rows = 2 * GROUP
    prompt_ids = torch.randint(3, vocab, (2, PROMPT), generator=gen).repeat_interleave(GROUP, 0)
    completion_mask = (torch.arange(COMPLETION)[None] < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(3, vocab, (rows, COMPLETION), generator=gen)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids.masked_fill(completion_mask == 0, tiny_tokenizer().pad_token_id),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=gen),
        "old_shift": torch.randn(rows, generator=gen) * 0.4,
    }


def sequence_logps(model, data) -> torch.Tensor:
    """[B] Σ log-probs of the completion tokens under ``model`` (plain PyTorch)."""
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(input_ids).logits[:, PROMPT - 1 : -1].float()
    logps = logits.log_softmax(-1).gather(-1, data["completion_ids"][..., None]).squeeze(-1)
    return (logps * data["completion_mask"]).sum(-1)


def load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def trl_trainer(models, tmp_path, reward_funcs=None, **options):
    import datasets

    require("trl")
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(**trl_args(tmp_path), **options)
    trainer = RLOOTrainer(
        model=load(models[0]),
        reward_funcs=reward_funcs or [lambda completions, **kwargs: [0.0] * len(completions)],
        args=args,
        train_dataset=datasets.Dataset.from_list(tiny_prompt_rows(8)),
        processing_class=tiny_tokenizer(),
    )
    if trainer.ref_model is not None:  # TRL loads the policy's checkpoint again: use the perturbed one
        trainer.ref_model.load_state_dict(load(models[1]).state_dict())
    return trainer


@pytest.mark.parametrize("pair", ["models", "softcap_models"])  # a tiny Llama; a Gemma-2 capped at 0.2
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_gradients_and_metrics_equal_trl(request, tmp_path, epsilon_high, pair):
    models = request.getfixturevalue(pair)
    data = batch(tiny_tokenizer().vocab_size)
    trainer = trl_trainer(models, tmp_path, beta=0.0, epsilon=0.2, epsilon_high=epsilon_high)
    model = trainer.model.train()
    old_logps = sequence_logps(model, data) + data["old_shift"]
    inputs = {key: data[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    inputs |= {"advantages": data["advantages"], "old_logps": old_logps}
    their_loss = trainer._compute_loss(model, inputs)
    their_loss.backward()
    their_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    their_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    ours = fastalign.patch_model(load(models[0])).train()
    loss_fn = RLOOLoss(epsilon=0.2, epsilon_high=epsilon_high)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    attention_mask = torch.cat([data["prompt_mask"], data["completion_mask"]], 1)

    def head(hidden, weight, bias, softcap=None):
        return loss_fn(
            hidden[:, PROMPT - 1 : -1],
            weight,
            data["completion_ids"],
            data["completion_mask"],
            data["advantages"],
            old_logps=old_logps,
            bias=bias,
            softcap=softcap,
        )

    result = ours(input_ids=input_ids, attention_mask=attention_mask, head_fn=head).head_output
    result.loss.backward()
    assert float(result.loss) == pytest.approx(float(their_loss), rel=1e-5, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(dict(ours.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6)
    clipped = their_metrics["clip_ratio/low_mean"] + their_metrics["clip_ratio/high_mean"]
    assert 0 < clipped < 1  # the data exercises the clip
    for key, value in result.metrics.items():
        assert float(value) == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-6), key


def rewards_table() -> torch.Tensor:
    """Two reward functions' rewards [8, 2]: the second function skips some completions (NaN), and the
    last completion is scored by neither (unscorable: advantage 0, left out of its group's baselines)."""
    first = torch.tensor([0.5, 1.0, 0.0, 2.0, 1.5, -1.0, 3.0, math.nan])
    second = torch.tensor([1.0, math.nan, 0.25, -0.5, math.nan, 0.5, 1.0, math.nan])
    return torch.stack([first, second], 1)


@pytest.mark.parametrize(
    "options",
    [
        {"beta": 0.0},
        {"beta": 0.05},
        {"beta": 0.3, "normalize_advantages": True},
        {"beta": 0.05, "reward_clip_range": (-0.5, 2.0), "reward_weights": [1.0, 0.5]},
    ],
    ids=["no-kl", "kl", "kl-normalized", "kl-clipped-weighted"],
)
def test_advantages_and_reward_metrics_equal_trl(models, tmp_path, options):
    data = batch(tiny_tokenizer().vocab_size)
    table = rewards_table()
    funcs = [lambda completions, **kwargs: [0.0] * len(completions)] * 2
    trainer = trl_trainer(models, tmp_path, reward_funcs=funcs, **options)
    trainer.model.train()
    ids = [row[:length].tolist() for row, length in zip(data["completion_ids"], LENGTHS, strict=True)]
    prompt_ids = [row.tolist() for row in data["prompt_ids"]]
    trainer._generate = lambda prompts: (prompt_ids, ids, ["text"] * len(ids))
    trainer._calculate_rewards = lambda *args: table.clone()
    output = trainer._generate_and_score_completions([{"prompt": "p"}] * len(ids))
    their_metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    config = TrainConfig(
        reward_funcs=["fastalign.builtin:digit_ratio"] * 2,
        num_generations=GROUP,
        per_device_train_batch_size=2 * GROUP,
        max_completion_length=COMPLETION,
        **{key: list(value) if isinstance(value, tuple) else value for key, value in options.items()},
    )
    objective = RLOOObjective.from_config("rloo", config, DistributedContext(0, 1, 0, torch.device("cpu")))
    objective.tokenizer = tiny_tokenizer()
    if options["beta"] > 0:
        objective.reference = Reference(fastalign.patch_model(load(models[1])).eval())
    policy = fastalign.patch_model(load(models[0])).train()
    done = Completions(
        data["prompt_ids"],
        data["prompt_mask"],
        data["completion_ids"],
        data["completion_mask"],
        torch.zeros(len(ids), dtype=torch.bool),
    )
    batches = [objective._training_batch(policy, done, objective.keeps_policy_logprobs(False))]
    weights = torch.tensor(options.get("reward_weights", [1.0, 1.0]))
    rewards = Rewards(
        table, combine_rewards(table, weights), torch.tensor(LENGTHS).float(), done.truncated, slice(0, 8)
    )
    advantages, metrics = objective.advantages(rewards, batches, GROUP, reused=False)
    metrics |= rewards.metrics(objective.reward_funcs)

    torch.testing.assert_close(advantages, output["advantages"].float(), rtol=1e-5, atol=1e-5)
    assert advantages[-1] == 0
    assert set(batches[0]) == {"input_ids", "attention_mask", "position_ids", "completion_mask"}
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl"):
        if key in their_metrics or key in metrics:
            assert metrics[key] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-6), key
