"""TRL 1.16 as the oracle for KTO: one optimizer step of TRL's own ``KTOTrainer`` and of ``fastalign
train kto`` on the same tiny model, reference, rows and options give the same loss, gradient norm and
metrics (fp32, CPU, no gradient checkpointing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_kto_rows, tiny_tokenizer
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

pytestmark = pytest.mark.slow

ROWS = tiny_kto_rows(8, seed=5)
METRICS = (
    "loss",
    "grad_norm",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def trl_step(models, output_dir: Path, weights: tuple[float, float]) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(ROWS),
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        beta=0.1,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        save_strategy="no",
        seed=0,
    )
    trainer = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32),
        ref_model=AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(ROWS),
    )
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_one_step_equals_trl(models, tmp_path, weights):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    config = TrainConfig(
        model_name_or_path=models[0],
        ref_model_name_or_path=models[1],
        dataset_name=str(rows),
        output_dir=str(tmp_path / "fastalign"),
        max_steps=1,
        per_device_train_batch_size=len(ROWS),
        learning_rate=1e-3,
        logging_steps=1,
        loss_curve_png=False,
        beta=0.1,
        max_length=128,
        seed=0,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
    )
    run_training(config, "kto")
    ours = json.loads((tmp_path / "fastalign" / "metrics.jsonl").read_text().splitlines()[0])
    theirs = trl_step(models, tmp_path / "trl", weights)
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])
