"""TRL 1.16 as the oracle for reward modelling: one optimizer step of TRL's own ``RewardTrainer`` and of
``fastalign train reward`` from the same tiny sequence-classification checkpoint (its ``score`` head
saved with it, so both start from the same head) on the same rows give the same loss, gradient norm and
metrics: standard and conversational rows, explicit and implicit prompts, a ``margin`` column,
``center_rewards_coefficient``, gradient accumulation, and ``max_length`` filtering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_preference_rows, tiny_tokenizer
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training
from tests.helpers import require
from tests.parity.steps import SHARED, first_logged

pytestmark = pytest.mark.slow

#: What both log.
METRICS = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")
PAIRS = tiny_preference_rows(8, seed=3)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    """A tiny Llama reward model (``num_labels=1``), score head included, saved with the tokenizer."""
    path = tmp_path_factory.mktemp("reward-model") / "model"
    model = tiny_model("llama", task="sequence_classification", seed=1)
    with torch.no_grad():  # a head as large as a trained one's, so the scores differ visibly across rows
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _margins(rows: list[dict]) -> list[dict]:
    return [{**row, "margin": 0.25 * index - 0.5} for index, row in enumerate(rows)]


def _implicit(rows: list[dict]) -> list[dict]:
    return [
        {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in rows
    ]


def _conversational(rows: list[dict]) -> list[dict]:
    def turn(role: str, text: str) -> list[dict]:
        return [{"role": role, "content": text.strip()}]

    return [
        {
            "prompt": turn("user", row["prompt"]),
            "chosen": turn("assistant", row["chosen"]),
            "rejected": turn("assistant", row["rejected"]),
        }
        for row in rows
    ]


def _implicit_conversational(rows: list[dict]) -> list[dict]:
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


CASES = {
    "standard": (PAIRS, {}),
    "margin": (_margins(PAIRS), {}),
    "center": (PAIRS, {"center_rewards_coefficient": 0.01}),
    "margin-center": (_margins(PAIRS), {"center_rewards_coefficient": 0.3}),
    "implicit": (_implicit(PAIRS), {}),
    "conversational": (_conversational(PAIRS), {}),
    "conversational-implicit": (_implicit_conversational(_conversational(PAIRS)), {}),
    "accumulation": (_margins(PAIRS), {"gradient_accumulation_steps": 2, "center_rewards_coefficient": 0.1}),
}


def fastalign_reward_step(rows: list[dict], tmp_path: Path, model: str, batch_size: int, **options) -> dict:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = TrainConfig(
        model_name_or_path=model,
        dataset_name=str(data),
        output_dir=str(tmp_path / "fastalign"),
        per_device_train_batch_size=batch_size,
        loss_curve_png=False,
        **{**SHARED, **options},
    )
    return first_logged(run_training(config, "reward"))


def trl_reward_step(rows: list[dict], tmp_path: Path, model: str, batch_size: int, **options) -> dict:
    import datasets

    require("trl")
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=batch_size,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        **{**SHARED, **options},
    )
    trainer = RewardTrainer(
        model=model,  # a path: TRL loads it with AutoModelForSequenceClassification, num_labels=1
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    trainer.train()
    return trainer.state.log_history[0]


def assert_equal(ours: dict, theirs: dict) -> None:
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_equals_trl(reward_model, tmp_path, case):
    rows, options = CASES[case]
    batch_size = len(rows) // options.get("gradient_accumulation_steps", 1)
    ours = fastalign_reward_step(rows, tmp_path, reward_model, batch_size, **options)
    theirs = trl_reward_step(rows, tmp_path, reward_model, batch_size, **options)
    assert 0 < theirs["accuracy"] < 1 and theirs["min_reward"] < theirs["max_reward"]  # not degenerate
    assert_equal(ours, theirs)


def test_max_length_filters_pairs_as_trl(reward_model, tmp_path):
    """A pair with a side over max_length is left out on both sides (not truncated): the remaining 7
    pairs make the step."""
    from fastalign.data.reward import tokenize_reward_dataset

    tokenizer = tiny_tokenizer()
    lengths = [
        max(len(e.chosen_ids), len(e.rejected_ids))
        for e in tokenize_reward_dataset(PAIRS, tokenizer, max_length=None)
    ]
    longest = max(lengths)
    assert lengths.count(longest) == 1 and sorted(lengths)[-2] < longest
    options = {"max_length": longest - 1}
    ours = fastalign_reward_step(PAIRS, tmp_path, reward_model, 7, **options)
    theirs = trl_reward_step(PAIRS, tmp_path, reward_model, 7, **options)
    assert_equal(ours, theirs)
