"""One optimizer step of TRL's own trainer and of ``fastalign train``, set up alike, for the parity tests:
the same rows, batch (all rows in one step), learning rate and seed; fp32 on the CPU without gradient
checkpointing (TRL 1.16 turns bf16 and checkpointing on by default). Each returns the first logged row."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastalign.builtin import tiny_tokenizer
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

#: What both sides share.
SHARED = {"max_steps": 1, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0}


def first_logged(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / "metrics.jsonl").read_text().splitlines()[0])


def fastalign_step(name: str, rows: list[dict], tmp_path: Path, **options) -> dict:
    """``fastalign train <name>`` for one step on ``rows`` (written as JSONL); ``options`` are config keys.
    No checkpoint is saved (as ``trl_step``): the first logged row is all either returns."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = {**SHARED, "max_length": 128, "save_strategy": "no", **options}  # TRL's side saves none either
    config = TrainConfig(
        dataset_name=str(data),
        output_dir=str(tmp_path / "fastalign"),
        per_device_train_batch_size=len(rows),
        loss_curve_png=False,
        **settings,
    )
    return first_logged(run_training(config, name))


def trl_step(
    trainer, config, rows: list[dict], tmp_path: Path, model: str, ref_model=None, tokenizer=None, **options
) -> dict:
    """TRL's ``trainer`` class with its ``config`` class, for one step on ``rows``; ``model`` and
    ``ref_model`` are model directories, ``tokenizer`` the processing class (default: the tiny one)."""
    import datasets
    from transformers import AutoModelForCausalLM

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    args = config(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(rows),
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        **{**SHARED, **options},
    )
    references = {} if ref_model is None else {"ref_model": load(ref_model)}
    run = trainer(
        model=load(model),
        args=args,
        processing_class=tokenizer or tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(rows),
        **references,
    )
    run.train()
    return run.state.log_history[0]
