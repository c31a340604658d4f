"""TRL 1.16 as the oracle for SFT: one optimizer step of TRL's own ``SFTTrainer`` and of ``fastalign train
sft`` on the same tiny model and prompt-completion rows (completion-only loss, TRL's default for them)
give the same loss and gradient norm (fp32, CPU, no gradient checkpointing)."""

from __future__ import annotations

import json

import pytest
import torch

from fastalign.builtin import tiny_sft_rows, tiny_tokenizer
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

pytestmark = pytest.mark.slow

ROWS = tiny_sft_rows(8, seed=7)


@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_one_step_equals_trl(models, tmp_path, completion_only_loss):
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    config = TrainConfig(
        model_name_or_path=models[0],
        dataset_name=str(rows),
        output_dir=str(tmp_path / "fastalign"),
        max_steps=1,
        per_device_train_batch_size=len(ROWS),
        learning_rate=1e-3,
        logging_steps=1,
        loss_curve_png=False,
        max_length=128,
        seed=0,
        completion_only_loss=completion_only_loss,
    )
    run_training(config, "sft")
    ours = json.loads((tmp_path / "fastalign" / "metrics.jsonl").read_text().splitlines()[0])

    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(ROWS),
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        seed=0,
        max_length=128,
        completion_only_loss=completion_only_loss,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(ROWS),
    )
    trainer.train()
    theirs = trainer.state.log_history[0]
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])
