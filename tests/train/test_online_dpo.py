"""``fastalign train online_dpo`` against TRL 1.16's ``OnlineDPOTrainer``, and through the runner.

Sampling is not compared (each tool draws its own completions): both sides get the same completions of
the same prompts, TRL's by replacing its ``_generate``, fastalign's by replacing the rollout's
``sample_completions``. From there on everything is each tool's own: the reward functions, the missing-EOS
penalty, the ranking (ties included), ``max_length``'s cut of the prompts, the reference's log-probs, the
loss, its gradients and the logged metrics. Prompts have one length (TRL scores left-padded prompts at
positions that count the padding). TRL's ``objective/kl``, ``objective/entropy``,
``objective/non_score_reward`` and ``objective/rlhf_reward`` also sum over the padding after a completion's
EOS; fastalign's over its tokens only, so those four are compared on completions without padding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_prompt_rows, tiny_tokenizer
from fastalign.data.preference import PromptCollator, tokenize_prompt_dataset
from fastalign.train.config import ConfigError, TrainConfig, load_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from fastalign.train.objectives import online_dpo as online_dpo_module
from fastalign.train.reference import FrozenReference
from fastalign.train.rollout import Completions
from tests.helpers import require
from tests.parity.conftest import models  # noqa: F401 (the policy and reference fixture)
from tests.train.runs import short_config, train

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))
PROMPTS, COMPLETION = 3, 5
#: Metrics TRL sums over a completion's padding too (compared where there is none).
PADDING_SUMMED = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward")


def length_reward(completions, **kwargs):
    return [float(len(text) % 4) for text in completions]


def sometimes_none(completions, **kwargs):
    """None on every other completion: TRL's nansum makes a completion no function scores 0."""
    return [None if index % 2 else float("5" in text) for index, text in enumerate(completions)]


def fixed_completions(padded: bool) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts, two completions of each [prompt, 2, C], their masks and which did not end (no EOS):
    some end before the last position (``padded``), some do not end; a pair of equal ones is a tie."""
    tokenizer = tiny_tokenizer()
    gen = torch.Generator().manual_seed(3)
    prompts = [row["prompt"] for row in tiny_prompt_rows(PROMPTS)]
    ids = torch.randint(3, tokenizer.vocab_size, (PROMPTS, 2, COMPLETION), generator=gen)
    ids[1, 1] = ids[1, 0]  # the same completion twice: a tie, which the first sampled wins
    ends = [[2, None], [None, None], [4, 1]] if padded else [[4, None], [None, None], [4, 4]]
    mask = torch.ones_like(ids)
    for prompt, pair in enumerate(ends):
        for k, end in enumerate(pair):
            if end is not None:
                ids[prompt, k, end] = tokenizer.eos_token_id
                ids[prompt, k, end + 1 :] = tokenizer.pad_token_id
                mask[prompt, k, end + 1 :] = 0
    return prompts, ids, mask, ~(ids == tokenizer.eos_token_id).any(-1)


OPTIONS = {"beta": 0.2, "loss_type": "sigmoid", "missing_eos_penalty": 0.5, "max_length": 64}


def trl_step(model_dirs, tmp_path, padded: bool, options: dict) -> tuple[float, dict, dict]:
    """TRL's training step on the fixed completions: the loss, the gradients and its logged stats."""
    import datasets

    require("trl")
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    prompts, ids, mask, _ = fixed_completions(padded)
    tokenizer = tiny_tokenizer()
    args = OnlineDPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=PROMPTS,
        max_new_tokens=COMPLETION,
        reward_weights=[1.0, 0.5],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        **options,
    )
    trainer = OnlineDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32),
        ref_model=AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32),
        reward_funcs=[length_reward, sometimes_none],
        args=args,
        train_dataset=datasets.Dataset.from_list(tiny_prompt_rows(8)),
        processing_class=tokenizer,
    )
    prompt_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False) for prompt in prompts])

    def generate(model, prompts, images=None):  # TRL's layout: every prompt's first completion, then seconds
        return (
            prompt_ids.repeat(2, 1),
            torch.ones_like(prompt_ids).repeat(2, 1),
            ids.transpose(0, 1).reshape(2 * PROMPTS, COMPLETION),
            mask.transpose(0, 1).reshape(2 * PROMPTS, COMPLETION),
            None,
        )

    trainer._generate = generate
    model = trainer.model
    loss = trainer.training_step(model, {"prompt": prompts})
    stats = {key: values[-1] for key, values in trainer.stats.items()}
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}, stats


def fastalign_step(model_dirs, padded: bool, options: dict, monkeypatch) -> tuple[float, dict, dict]:
    """fastalign's objective on the same completions (adjacent pairs, its rollout's layout)."""
    prompts, ids, mask, truncated = fixed_completions(padded)
    tokenizer = tiny_tokenizer()
    config = TrainConfig(
        reward_funcs=[length_reward, sometimes_none],  # callables: what the resolver makes of specs
        reward_weights=[1.0, 0.5],
        max_new_tokens=COMPLETION,
        **{**options, "loss_type": [options["loss_type"]]},
    )
    objective = make_objective("online_dpo", config, CPU)

    def load(path):
        return fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))

    model = load(model_dirs[0]).train()
    objective.reference, objective.tokenizer = FrozenReference(load(model_dirs[1])), tokenizer
    examples = tokenize_prompt_dataset([{"prompt": prompt} for prompt in prompts], tokenizer)
    batch = PromptCollator(tokenizer.pad_token_id)(examples)
    prompt_ids = batch["input_ids"].repeat_interleave(2, 0)
    done = Completions(
        prompt_ids,
        torch.ones_like(prompt_ids),
        ids.reshape(2 * PROMPTS, COMPLETION),
        mask.reshape(2 * PROMPTS, COMPLETION),
        truncated.reshape(-1),
    )
    monkeypatch.setattr(online_dpo_module, "sample_completions", lambda *args: [done])
    (pairs,), step_metrics = objective.prepare_step(model, [batch], 0)
    loss, metrics = objective.compute_loss(model, pairs, torch.tensor(objective.loss_tokens(pairs)))
    loss.backward()
    metrics = {key: float(value) for key, value in metrics.items()} | step_metrics
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}, metrics


@pytest.mark.slow
@pytest.mark.parametrize(
    ("padded", "options"),
    [
        (True, OPTIONS),
        (False, OPTIONS),
        (True, {**OPTIONS, "loss_type": "ipo", "missing_eos_penalty": None}),
        (False, {**OPTIONS, "max_length": 9}),  # prompts of 6 + completions of 5: the prompts lose 2
    ],
    ids=["sigmoid-padded", "sigmoid", "ipo-padded", "sigmoid-max_length"],
)
def test_loss_gradients_and_metrics_equal_trl(models, tmp_path, monkeypatch, padded, options):  # noqa: F811
    theirs, their_grads, their_stats = trl_step(models, tmp_path, padded, options)
    ours, our_grads, our_metrics = fastalign_step(models, padded, options, monkeypatch)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    compared = [key for key in their_stats if not (padded and key in PADDING_SUMMED)]
    assert set(their_stats) == set(our_metrics)  # TRL's names, all of them
    for key in compared:
        assert our_metrics[key] == pytest.approx(their_stats[key], rel=1e-5, abs=1e-6), key
    # the fixed pairs exercise what they should: a non-zero KL, a tie, a missing EOS
    assert abs(our_metrics["objective/kl"]) > 1e-3 and 0 < our_metrics["val/contain_eos_token"] < 1


def run(tmp_path: Path, **options) -> list[dict]:
    defaults = dict(reward_funcs=["fastalign.builtin:digit_ratio"], max_new_tokens=4, max_length=32)
    config = short_config(tmp_path, tiny_prompt_rows(12), per_device_train_batch_size=2, **defaults | options)
    return train(config, "online_dpo")


@pytest.mark.slow
def test_two_steps_through_the_runner_with_accumulation_and_evaluation(tmp_path):
    rows = run(
        tmp_path,
        gradient_accumulation_steps=2,
        missing_eos_penalty=1.0,
        eval_split_ratio=0.2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=2,
    )
    steps = [row for row in rows if "loss" in row]
    evaluations = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in steps] == [1, 2] and [row["step"] for row in evaluations] == [1, 2]
    for row in steps:
        assert all(math.isfinite(value) for value in row.values())
        assert row["beta"] == pytest.approx(0.1) and 0.0 <= row["rewards/accuracies"] <= 1.0
    # the reference is the initial policy: no KL before the first update
    assert steps[0]["objective/kl"] == 0.0 and steps[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert steps[1]["objective/kl"] != 0.0
    assert "eval_objective/scores" in evaluations[0] and "eval_rewards/margins" in evaluations[0]


def test_trl_defaults_and_learning_rate():
    from fastalign.train.objectives import with_objective_defaults

    config = with_objective_defaults("online_dpo", TrainConfig(reward_funcs=["exact_match"]))
    objective = make_objective("online_dpo", config, CPU)
    assert config.learning_rate == 5e-7
    options = objective.options
    assert (options.beta, options.loss_type, options.max_new_tokens) == (0.1, ["sigmoid"], 64)
    assert options.disable_dropout and options.missing_eos_penalty is None
    assert objective.sampling.num_generations == 2


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "reward_funcs"),
        ({"loss_type": ["hinge"]}, "loss_type"),
        ({"loss_type": ["sigmoid", "ipo"]}, "loss_type"),
        ({"loss_type": ["ipo"], "beta": 0.0}, "beta"),
        ({"max_new_tokens": 64, "max_length": 64}, "max_new_tokens"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
        ({"use_vllm": True}, "use_vllm"),
        ({"generation_kwargs": {"num_return_sequences": 3}}, "generation_kwargs"),
        ({"num_generations": 4}, "num_generations"),  # grpo's: online DPO samples two
        ({"sync_ref_model": True}, "sync_ref_model"),  # dpo's: the reference is fixed
        (
            {"max_completion_length": 8},
            "max_completion_length",
        ),  # grpo's name: online DPO's is max_new_tokens
    ],
)
def test_options_that_cannot_work_are_refused(options, key):
    reward = {"reward_funcs": ["exact_match"]} if key != "reward_funcs" else {}
    with pytest.raises(ConfigError, match=key):
        make_objective("online_dpo", TrainConfig(**reward, **options), CPU)


def test_value_checks_and_a_list_of_betas_name_the_key(tmp_path):
    for flag, key in (
        ("--missing_eos_penalty=-1", "missing_eos_penalty"),
        ("--max_new_tokens=0", "max_new_tokens"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [flag])
    path = tmp_path / "config.yaml"
    path.write_text("beta: [0.1, 0.05]\n")  # TRL's per-epoch betas: refused, beta is one number
    with pytest.raises(ConfigError, match=r"'beta'.*must be a number or null"):
        load_config(path)
