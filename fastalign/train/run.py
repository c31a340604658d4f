"""``fastalign train <objective>``: one runner for every objective, from a ``TrainConfig``, one process or
many (``torchrun``).

Reads top to bottom: set up processes and seed; check the output directory (and the checkpoint to
resume) before anything loads (``fastalign.train.run_dir``: one run per directory); load model and
tokenizer; patch, LoRA, memory savers, sharding; the objective tokenizes the data and sets itself up
(with its reference); batches; optimizer and schedule; resume; train; export. What differs between
objectives lives in each one's own file, ``fastalign.train.objectives.<name>``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from fastalign.data.tokenizer_options import override_tokenizer
from fastalign.quant.bitsandbytes_import import bitsandbytes_hidden
from fastalign.train.batches import EvaluationBatches
from fastalign.train.callbacks import (
    JsonlMetrics,
    LossCurve,
    ProgressBar,
    TensorBoardMetrics,
    WandbMetrics,
)
from fastalign.train.config import ConfigError, TrainConfig, check_config
from fastalign.train.distributed import init_distributed, shutdown_distributed
from fastalign.train.engine import Callback, Engine, Schedule
from fastalign.train.export import export_model
from fastalign.train.loading import is_hub_dataset, load_dataset_rows, load_model_and_tokenizer, resolve_model
from fastalign.train.metrics import peak_flops, training_flops_per_token
from fastalign.train.neftune import enable_neftune
from fastalign.train.objectives import make_objective, with_objective_defaults
from fastalign.train.objectives.base import BatchPlan, Objective, RunParts
from fastalign.train.optim import (
    BITSANDBYTES_OPTIMIZERS,
    build_optimizer,
    build_scheduler,
    check_schedule,
)
from fastalign.train.policy import (
    autocast_dtype,
    load_frozen_model,
    prepare_policy,
    quant_options,
)
from fastalign.train.run_dir import check_output_dir, check_resume_length, resume, run_identity, start_writing


def run_training(config: TrainConfig, name: str, callbacks: list[Callback] | None = None) -> Path:
    """Train objective ``name`` (a key of ``fastalign.train.objectives.OBJECTIVES``: 'sft', 'dpo', 'orpo',
    'simpo', 'cpo', 'kto', 'grpo', 'rloo', 'reward'), save the final model (or adapter) in
    ``config.output_dir``, and return that path. bitsandbytes is hidden unless the run quantizes or uses
    an 8-bit optimizer (``fastalign.quant.bitsandbytes_import``)."""
    uses_bitsandbytes = config.quantization is not None or config.optim in BITSANDBYTES_OPTIMIZERS
    with bitsandbytes_hidden(not uses_bitsandbytes):
        return _run_training(config, name, callbacks)


def _run_training(config: TrainConfig, name: str, callbacks: list[Callback] | None) -> Path:
    ctx = init_distributed()
    failed = True
    try:
        check_config(config)  # a TrainConfig built in code skips load_config's checks
        config = with_objective_defaults(name, config)  # saved with the run: the values it trained with
        check_schedule(config)
        _seed_everything(config.seed)
        _check_hub_dataset_keys(config)
        output_dir = Path(config.output_dir)
        resume_path, earlier_files = check_output_dir(config)  # before anything loads
        if ctx.enabled:  # every rank has looked before the main rank writes: a slow rank saw its files
            torch.distributed.barrier()
        given, config = config, _with_local_model(config)  # saved and reported: the names as given
        objective = make_objective(name, config, ctx)  # checks the config before any work
        model, tokenizer = load_model_and_tokenizer(
            config.model_name_or_path,
            quant_options(config),
            ctx.device,
            materialize=False,
            task=objective.task,
        )
        override_tokenizer(tokenizer, model, config.eos_token, config.pad_token, config.chat_template_path)
        train_examples, eval_examples = _tokenized_splits(config, objective, tokenizer)
        row_tokens = objective.sequence_length(config, train_examples)
        model = prepare_policy(
            model,
            config,
            ctx,
            needs_fused_head=objective.needs_fused_head,
            task=objective.task,
            row_tokens=row_tokens,
            rows_per_example=objective.rows_per_example,
        )
        enable_neftune(model, config.neftune_noise_alpha)  # in training mode only

        prepared = objective.setup(model, train_examples, eval_examples, _run_parts(config, tokenizer, ctx))
        batches = objective.batches(prepared.train, tokenizer, BatchPlan.from_config(config, tokenizer, ctx))
        max_steps = (
            config.max_steps
            if config.max_steps > 0
            else max(1, math.ceil(config.num_train_epochs * batches.steps_per_epoch))  # as Trainer
        )
        optimizer = build_optimizer(model, config)
        scheduler = build_scheduler(optimizer, config, max_steps)
        if resume_path is not None:
            check_resume_length(resume_path, max_steps)
        identity = run_identity(name, ctx.world_size)  # saved in each checkpoint, checked on resume
        engine = Engine(
            model,
            objective,
            optimizer,
            scheduler,
            batches,
            Schedule.from_config(config, max_steps),
            ctx,
            output_dir=output_dir,
            eval_batches=EvaluationBatches(
                prepared.evaluation,
                config.per_device_eval_batch_size,
                tokenizer.pad_token_id,
                ctx.rank,
                ctx.world_size,
                collate=objective.collate(tokenizer),
            ),
            callbacks=_callbacks(given, output_dir) + prepared.callbacks + list(callbacks or []),
            flops_per_token=training_flops_per_token(model, row_tokens),
            peak_flops=peak_flops(ctx.device),
            autocast_dtype=autocast_dtype(config, ctx),
            run_config=asdict(given) | identity,
        )
        if resume_path is not None:  # before anything is written: a misfit changes no file
            resume(engine, resume_path, given, identity)
        if ctx.is_main:
            start_writing(given, output_dir, clear=earlier_files)
            if note := busy_cpus_note(ctx.device):  # advice beside the progress, not an error: stdout
                print(note, flush=True)
        engine.train()  # evaluates at the last step as eval_strategy says; ends with the best model's weights
        export_model(model, tokenizer, output_dir, ctx)
        failed = False
        return output_dir
    finally:
        shutdown_distributed(failed)


def busy_cpus_note(device: torch.device) -> str | None:
    """One line when a CPU run starts on CPUs that are busy already: torch's threads then compete with the
    other work for the cores (measured: a CPU step 20-30× slower while another process used the 2 cores).
    The 1-minute load average above the cores this process may use; None on a GPU or where either is
    unknown (os.getloadavg, os.sched_getaffinity: not on every platform)."""
    if device.type != "cpu":
        return None
    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if load <= cores:
        return None
    threads = os.environ.get("OMP_NUM_THREADS")
    advice = (
        f"stop other work (OMP_NUM_THREADS is {threads})"
        if threads  # set already: the user chose the threads
        else "stop other work or set OMP_NUM_THREADS to the free cores"
    )
    return (
        f"note: the CPUs are busy (load {load:.1f} on {cores} core{'s' if cores > 1 else ''}): training will "
        f"be slower; {advice}"
    )


def _seed_everything(seed: int) -> None:
    """Python's, numpy's (reward functions may draw from it) and torch's generators, as transformers'
    ``set_seed`` seeds them (numpy takes 32 bits)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _with_local_model(config: TrainConfig) -> TrainConfig:
    """``config`` with ``model_name_or_path`` (and a ``ref_model_name_or_path`` naming the same model) as
    the local files it resolves to: a Hub id becomes its snapshot directory in the Hugging Face cache at
    ``model_revision``. Resolved once, so the skeleton, the weights filled into it and the reference all
    come from one commit, however the Hub moves meanwhile."""
    local = str(resolve_model(config.model_name_or_path, config.model_revision))
    same = config.ref_model_name_or_path == config.model_name_or_path
    return dataclasses.replace(
        config,
        model_name_or_path=local,
        model_revision=None,
        ref_model_name_or_path=local if same else config.ref_model_name_or_path,
    )


def _run_parts(config: TrainConfig, tokenizer, ctx) -> RunParts:
    def load_frozen(name_or_path: str | None) -> torch.nn.Module:
        return load_frozen_model(name_or_path or config.model_name_or_path, config, ctx)

    return RunParts(
        tokenizer,
        ctx,
        load_frozen,
        config.use_peft,
        autocast_dtype(config, ctx),
        config.per_device_eval_batch_size,
    )


def _tokenized_splits(config: TrainConfig, objective: Objective, tokenizer) -> tuple[list, list]:
    """Training and evaluation examples. A Hub dataset trains on its ``dataset_train_split``; a Hub
    ``eval_dataset_name`` evaluates on its ``dataset_test_split`` (naming ``dataset_name`` itself gives
    TRL's evaluation on the same dataset's test split); ``dataset_config`` and ``dataset_revision`` apply
    to both. Without ``eval_dataset_name``, ``eval_split_ratio`` holds out a share of the training rows."""
    name = config.dataset_name or objective.default_dataset
    examples = objective.tokenize(_rows(config, name, "dataset_name", config.dataset_train_split), tokenizer)
    if config.eval_dataset_name:
        return examples, objective.tokenize(
            _rows(config, config.eval_dataset_name, "eval_dataset_name", config.dataset_test_split), tokenizer
        )
    if config.eval_split_ratio > 0:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed)).tolist()
        held_out = set(order[: max(1, round(config.eval_split_ratio * len(examples)))])
        # both parts keep the data's order (what sequential sampling and KTO's KL pairs read)
        return (
            [example for index, example in enumerate(examples) if index not in held_out],
            [example for index, example in enumerate(examples) if index in held_out],
        )
    return examples, []


def _rows(config: TrainConfig, name: str, key: str, split: str) -> list[dict]:
    if is_hub_dataset(name):
        return load_dataset_rows(name, split, config.dataset_config, config.dataset_revision, key=key)
    return load_dataset_rows(name, key=key)


def _check_hub_dataset_keys(config: TrainConfig) -> None:
    """The keys that pick within a Hub dataset, set when the dataset they pick within is none: an error,
    as they would be ignored (a local file's rows all train; a built-in set has no splits). Checked before
    anything is loaded."""
    train = config.dataset_name is not None and is_hub_dataset(config.dataset_name)
    evaluate = config.eval_dataset_name is not None and is_hub_dataset(config.eval_dataset_name)
    defaults = TrainConfig()
    either = "neither dataset_name nor eval_dataset_name is"
    checks = (  # key, whether it is set, which dataset it picks within, whether that is a Hub dataset
        (
            "dataset_train_split",
            config.dataset_train_split != defaults.dataset_train_split,
            "dataset_name is not",
            train,
        ),
        (
            "dataset_test_split",
            config.dataset_test_split != defaults.dataset_test_split,
            "eval_dataset_name is not",
            evaluate,
        ),
        ("dataset_config", config.dataset_config is not None, either, train or evaluate),
        ("dataset_revision", config.dataset_revision is not None, either, train or evaluate),
    )
    for key, is_set, within, is_hub in checks:
        if is_set and not is_hub:
            raise ConfigError(
                f"config key {key!r} ({getattr(config, key)!r}) picks within a Hub dataset, but {within} one "
                f"(dataset_name {config.dataset_name!r}, eval_dataset_name {config.eval_dataset_name!r})"
            )


def _callbacks(config: TrainConfig, output_dir: Path) -> list[Callback]:
    callbacks: list[Callback] = [JsonlMetrics(output_dir / "metrics.jsonl"), ProgressBar()]
    if "tensorboard" in config.report_to:
        callbacks.append(TensorBoardMetrics(output_dir / "runs"))
    if "wandb" in config.report_to:
        callbacks.append(WandbMetrics(asdict(config)))
    if config.loss_curve_png:
        callbacks.append(LossCurve(output_dir / "loss_curve.png"))
    return callbacks
