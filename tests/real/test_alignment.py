"""Alignment on the real SmolLM2-135M-Instruct against the reference tool: DPO's first step is TRL's
``DPOTrainer``'s (loss ln 2, the same sequence log-probs from the same conversational rows), and GRPO
samples coherent answers from the real model and raises a reward within a short run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training
from tests.helpers import require
from tests.parity.steps import fastalign_step, trl_step
from tests.real.data import real_preference_rows, real_prompt_rows

pytestmark = pytest.mark.real

PAIRS = real_preference_rows()[:4]


def logged(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_dpo_first_step_equals_trl(smollm2, tmp_path):
    from transformers import AutoTokenizer

    require("trl")
    from trl import DPOConfig, DPOTrainer

    options = dict(learning_rate=1e-6, beta=0.1)
    ours = fastalign_step("dpo", PAIRS, tmp_path, model_name_or_path=str(smollm2), **options)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, str(smollm2), tokenizer=tokenizer, **options)

    assert ours["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy
    assert theirs["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    # the same tokens scored: TRL's sequence log-probs of chosen and rejected, summed over the completion
    for key in ("logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (key, ours[key], theirs[key])
    assert theirs["logps/chosen"] > theirs["logps/rejected"]  # the model knows its capitals


def first_capital(prompts, completions, completion_ids, answer, **columns) -> list[float]:
    """1 where the completion names the right capital, else 0. Completions of conversational prompts
    are messages, as in TRL."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(capital in text) for text, capital in zip(texts, answer, strict=True)]


def short_answer(prompts, completions, completion_ids, **columns) -> list[float]:
    """Shorter is better: 1 − tokens/16 (a 16-token completion, cut at the limit, scores 0)."""
    return [max(0.0, 1 - len(ids) / 16) for ids in completion_ids]


@pytest.mark.parametrize(("engine", "seed"), [("fastalign", 2), ("generate", 0)])
def test_grpo_samples_right_answers_and_raises_the_reward(engine, seed, smollm2, tmp_path):
    """Rollouts of the real model name the right capital (a 0-weighted reward logs it); the weighted
    reward, brevity, climbs from ~0.2 (rambling past 14 tokens) to ~0.5 ("The capital of X is Y.").
    Six steps of eight completions are noisy: with the rollout engine, seeds 0, 1 and 2 climbed from
    0.36, 0.18, 0.19 to 0.44, 0.44, 0.50 and named the right capital in 58%, 58%, 69% of completions;
    model.generate at seed 0 from 0.31-0.38 to 0.41-0.50 (the first and last two steps). Both engines'
    runs pass the same checks (the same reward curve within this noise; their draws differ, so one seed
    each)."""
    prompts = write_rows(tmp_path / "prompts.jsonl", real_prompt_rows())
    config = TrainConfig(
        model_name_or_path=str(smollm2),
        dataset_name=prompts,
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        temperature=0.7,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=1,
        loss_curve_png=False,
        reward_weights=[1.0, 0.0],
        reward_funcs=["tests.real.test_alignment:short_answer", "tests.real.test_alignment:first_capital"],
        seed=seed,
        generation_engine=engine,
        save_strategy="no",  # the metrics are what is checked: no 1.7 GB checkpoint (weights + AdamW) written
    )
    rows = logged(run_training(config, "grpo"))
    right = [row["rewards/first_capital/mean"] for row in rows]
    rewards = [row["reward"] for row in rows]
    assert rows[0]["rewards/first_capital/mean"] >= 0.5 and sum(right) / len(right) >= 0.6, right
    assert rewards == [row["rewards/short_answer/mean"] for row in rows]  # the 0 weight counts nothing
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1, rewards  # generate: +0.11, the engine +0.24
