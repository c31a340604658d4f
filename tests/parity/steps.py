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


def logged(output_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def first_logged(output_dir: str | Path) -> dict:
    return logged(output_dir)[0]


def fastalign_step(name: str, rows: list[dict], tmp_path: Path, **options) -> dict:
    """``fastalign train <name>`` for one step on ``rows`` (written as JSONL); ``options`` are config keys.
    No checkpoint is saved (as ``trl_step``): the first logged row is all either returns."""
    return first_logged(fastalign_run(name, rows, tmp_path, **options))


def fastalign_run(name: str, rows: list[dict], tmp_path: Path, **options) -> Path:
    """``fastalign_step``'s run, for as many steps as ``options`` say (one by default): its output
    directory. ``per_device_train_batch_size`` defaults to every row."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    batch = {"per_device_train_batch_size": len(rows)}
    settings = {
        **SHARED,
        **batch,
        "max_length": 128,
        "save_strategy": "no",
        **options,
    }  # TRL saves none either
    config = TrainConfig(
        dataset_name=str(data), output_dir=str(tmp_path / "fastalign"), loss_curve_png=False, **settings
    )
    return run_training(config, name)


def trl_step(
    trainer, config, rows: list[dict], tmp_path: Path, model: str, ref_model=None, tokenizer=None, **options
) -> dict:
    """TRL's ``trainer`` class with its ``config`` class, for one step on ``rows``; ``model`` and
    ``ref_model`` are model directories, ``tokenizer`` the processing class (default: the tiny one)."""
    return trl_run(trainer, config, rows, tmp_path, model, ref_model, tokenizer, **options)[0]


def trl_run(
    trainer, config, rows: list[dict], tmp_path: Path, model: str, ref_model=None, tokenizer=None, **options
) -> list[dict]:
    """``trl_step``'s run, for as many steps as ``options`` say (one by default): every logged row.
    ``per_device_train_batch_size`` defaults to every row."""
    import datasets
    from transformers import AutoModelForCausalLM

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    args = config(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        **{**SHARED, "per_device_train_batch_size": len(rows), **options},
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
    return run.state.log_history


def both_steps(
    objective: str, trainer, config, rows: list[dict], tmp_path: Path, policy: str, tokenizer, **options
) -> tuple[dict, dict]:
    """One step of ``fastalign train <objective>`` and of TRL's ``trainer`` on the same ``rows``, model
    and ``options`` (``ref_model_name_or_path`` among them goes to TRL as its ``ref_model``): the first
    logged row of each."""
    (tmp_path / "fastalign").mkdir()
    ours = fastalign_step(objective, rows, tmp_path / "fastalign", model_name_or_path=policy, **options)
    reference = options.pop("ref_model_name_or_path", None)
    theirs = trl_step(
        trainer, config, rows, tmp_path, policy, ref_model=reference, tokenizer=tokenizer, **options
    )
    return ours, theirs
