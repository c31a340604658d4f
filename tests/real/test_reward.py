"""A reward model trained from the real SmolLM2-135M-Instruct (its body, a new score head) on real
preference rows: a few steps make it prefer the right capitals (the loss falls, the accuracy rises),
and the exported model scores the training pairs as the run ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fastalign.data.reward import RewardCollator, tokenize_reward_dataset
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training
from tests.real.data import real_preference_rows

pytestmark = pytest.mark.real

PAIRS = real_preference_rows()[:4]  # a step on 4 pairs (8 sequences) takes ~5 s on 2 cores


def test_a_reward_model_learns_to_prefer_the_right_capitals(smollm2, tmp_path):
    """Two steps on the same four pairs (both see the whole batch): the loss falls from 0.679 to 0.527
    and the accuracy rises from 0.75 to 1; the model the second step leaves, which is exported, scores
    every pair right (its loss on them is 0.237: a third step logged it when this test took three)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    config = TrainConfig(
        model_name_or_path=str(smollm2),
        dataset_name=str(data),
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-4,  # TRL's RewardConfig default
        logging_steps=1,
        seed=0,
        loss_curve_png=False,
        save_strategy="no",  # the export is checked, not a checkpoint (weights + AdamW moments, ~1.6 GB)
    )
    output = run_training(config, "reward")
    logs = [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.05
    assert logs[-1]["accuracy"] > logs[0]["accuracy"] or logs[0]["accuracy"] == 1.0
    model = AutoModelForSequenceClassification.from_pretrained(output, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(output)
    batch = RewardCollator(tokenizer.pad_token_id)(tokenize_reward_dataset(PAIRS, tokenizer, max_length=None))
    with torch.no_grad():
        chosen, rejected = model(**batch).logits.squeeze(-1).chunk(2)
    assert (chosen > rejected).float().mean() >= logs[-1]["accuracy"]
