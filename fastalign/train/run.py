"""``fastalign train <objective>``: one runner for every objective, from a ``TrainConfig``, one process or
many (``torchrun``).

Reads top to bottom: set up processes and seed; check the output directory (and the checkpoint to
resume) before anything loads; load model and tokenizer; patch, LoRA, memory savers, sharding; the
objective's recipe tokenizes the data and builds the objective (with its reference); batches; optimizer
and schedule; resume; train; export. What differs between SFT, the preference objectives and GRPO lives
in ``fastalign.train.recipes``.

Run directories: one ``output_dir`` holds one run. A non-empty one is refused unless the run resumes
(``resume_from_checkpoint``) or sets ``overwrite_output_dir: true``, which empties it (only if it holds a
fastalign run) once the new run has loaded. A resume is checked against the config saved in the
checkpoint: a changed key that changes what is trained is refused, naming it (see ``RESUME_SAFE_KEYS``
for those that may change); and it may not train over later checkpoints of the same directory.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import get_scheduler

from fastalign.train.batches import evaluation_batches
from fastalign.train.callbacks import (
    JsonlMetrics,
    LossCurve,
    ProgressBar,
    TensorBoardMetrics,
    WandbMetrics,
)
from fastalign.train.checkpoint import (
    CONFIG_KEY,
    CheckpointMismatchError,
    checkpoint_step,
    list_checkpoints,
    read_trainer_state,
    resolve_resume_path,
)
from fastalign.train.config import ConfigError, TrainConfig, check_config, save_config
from fastalign.train.distributed import init_distributed, shutdown_distributed
from fastalign.train.engine import Callback, Engine, Schedule
from fastalign.train.export import export_model
from fastalign.train.loading import is_hub_dataset, load_dataset_rows, load_model_and_tokenizer, resolve_model
from fastalign.train.metrics import peak_flops, training_flops_per_token
from fastalign.train.policy import autocast_dtype, prepare_policy, quant_options
from fastalign.train.recipes import Recipe, make_recipe


def run_training(config: TrainConfig, objective: str, callbacks: list[Callback] | None = None) -> Path:
    """Train ``objective`` ('sft', 'dpo', 'orpo', 'simpo', 'cpo', 'kto', 'grpo', 'rloo'), save the final
    model (or adapter) in ``config.output_dir``, and return that path."""
    ctx = init_distributed()
    try:
        check_config(config)  # a TrainConfig built in code skips load_config's checks
        _seed_everything(config.seed)
        _check_hub_dataset_keys(config)
        output_dir = Path(config.output_dir)
        resume_path, earlier_files = _check_output_dir(config)  # before anything loads
        given, config = config, _with_local_model(config)  # saved and reported: the names as given
        model, tokenizer = load_model_and_tokenizer(
            config.model_name_or_path, quant_options(config), ctx.device, materialize=False
        )
        recipe = make_recipe(objective, config, tokenizer, ctx)  # checks the config before any work
        model = prepare_policy(model, config, ctx, needs_fused_head=recipe.needs_fused_head)

        train_examples, eval_examples = _tokenized_splits(config, recipe)
        objective_, train_examples, eval_examples, recipe_callbacks = recipe.build_objective(
            model, train_examples, eval_examples
        )
        batches = recipe.batches(train_examples)
        max_steps = (
            config.max_steps
            if config.max_steps > 0
            else max(1, int(config.num_train_epochs * batches.steps_per_epoch))
        )
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
            weight_decay=config.weight_decay, fused=ctx.device.type == "cuda",
        )  # fmt: skip
        warmup = config.warmup_steps or round(config.warmup_ratio * max_steps)
        # transformers' "constant" ignores num_warmup_steps; the warmup a config asks for is kept
        schedule_name = (
            "constant_with_warmup" if config.lr_scheduler_type == "constant" else config.lr_scheduler_type
        )
        scheduler = get_scheduler(
            schedule_name, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps
        )
        if resume_path is not None:
            _check_resume_length(resume_path, max_steps)
        engine = Engine(
            model, objective_, optimizer, scheduler, batches,
            Schedule(max_steps, config.max_grad_norm, config.logging_steps, config.eval_steps,
                     config.save_steps, config.save_total_limit),
            ctx, output_dir=output_dir,
            eval_batches=evaluation_batches(
                eval_examples, config.per_device_eval_batch_size, tokenizer.pad_token_id, ctx.rank,
                ctx.world_size, collate=recipe.collate,
            ),
            callbacks=_callbacks(given, output_dir) + recipe_callbacks + list(callbacks or []),
            flops_per_token=training_flops_per_token(model, config.max_length),
            peak_flops=peak_flops(ctx.device),
            autocast_dtype=autocast_dtype(config, ctx),
            run_config=asdict(given),
        )  # fmt: skip
        if resume_path is not None:
            _resume(engine, resume_path, given)  # before anything is written: a misfit changes no file
        if ctx.is_main:
            _start_writing(given, output_dir, clear=earlier_files)
        engine.train()
        evaluated = any(row.get("step") == engine.state.step and "eval_loss" in row
                        for row in engine.state.log_history)  # fmt: skip
        if eval_examples and not evaluated:
            engine.evaluate()  # a final evaluation, unless the last step just had one
        export_model(model, tokenizer, output_dir, ctx)
        return output_dir
    finally:
        shutdown_distributed()


#: Keys a resumed run may change: they decide what is logged, evaluated and saved, and where, and how
#: memory is saved (same losses) — not what is trained. Every other key is compared with the config saved
#: in the checkpoint, and a change is refused: a resumed run trains as the checkpoint's run did.
RESUME_SAFE_KEYS = frozenset({
    "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "logging_steps", "eval_steps",
    "save_steps", "save_total_limit", "report_to", "loss_curve_png", "per_device_eval_batch_size",
    "gradient_checkpointing", "activation_offloading",
})  # fmt: skip
#: Keys that set the run's length: they may change on resume (to extend or shorten a run) only where the
#: learning-rate schedule does not depend on the length — constant, with no warmup_ratio.
LENGTH_KEYS = ("max_steps", "num_train_epochs")
#: The files of an export that a loader opens first: a directory holding one holds a finished run's model.
_EXPORT_MARKERS = ("config.json", "adapter_config.json")


def _check_output_dir(config: TrainConfig) -> tuple[Path | None, list[str]]:
    """Whether this run may write in ``output_dir``, decided before anything loads: returns the
    checkpoint to resume from and the entries to delete first (an earlier run, with
    ``overwrite_output_dir``). A path that cannot be a writable directory, a non-empty one without resume
    or overwrite, and a resume that would mix two runs are one-line errors naming the culprit."""
    output_dir = Path(config.output_dir)
    _check_writable(output_dir)
    entries = sorted(path.name for path in output_dir.iterdir()) if output_dir.is_dir() else []
    shown = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
    if config.resume_from_checkpoint is not None:
        if config.overwrite_output_dir:
            raise ConfigError(
                f"config keys 'overwrite_output_dir' and 'resume_from_checkpoint' "
                f"({config.resume_from_checkpoint!r}) contradict each other: overwriting deletes the run "
                "that resuming continues; set one"
            )
        resume_path = resolve_resume_path(config.resume_from_checkpoint, output_dir)
        if resume_path is None:  # "latest", and no checkpoint yet
            finished = [name for name in _EXPORT_MARKERS if name in entries]
            if finished:
                raise ConfigError(
                    f"resume_from_checkpoint 'latest': output_dir {str(output_dir)!r} holds no checkpoint to "
                    f"resume from, but a finished run's model ({finished[0]}) that training again would "
                    "replace; set overwrite_output_dir: true (without resume_from_checkpoint) to replace it, "
                    "or choose another output_dir"
                )
            return None, []
        _check_resume(config, resume_path, output_dir, entries, shown)
        return resume_path, []
    if not entries:
        return None, []
    if not config.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {str(output_dir)!r} is not empty ({shown}): set resume_from_checkpoint: latest to "
            "continue the run in it, overwrite_output_dir: true to replace it, or choose another output_dir"
        )
    if "fastalign_config.yaml" not in entries:
        raise ConfigError(
            f"overwrite_output_dir: true empties output_dir {str(output_dir)!r}, but it holds no fastalign "
            f"run (no fastalign_config.yaml), only other files ({shown}); choose another output_dir"
        )
    root = output_dir.resolve()
    for key in ("model_name_or_path", "ref_model_name_or_path", "dataset_name", "eval_dataset_name"):
        value = getattr(config, key)
        if value and Path(value).exists() and Path(value).resolve().is_relative_to(root):
            raise ConfigError(
                f"overwrite_output_dir: true would delete {key} {value!r}, which lies in output_dir "
                f"{str(output_dir)!r}; write this run to another output_dir"
            )
    return None, entries


def _check_writable(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(
            f"output_dir {str(output_dir)!r} is a file, not a directory; choose another output_dir"
        )
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"output_dir {str(output_dir)!r} cannot be created: {str(existing)!r} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == output_dir else f" (cannot create it in {str(existing)!r})"
        raise ConfigError(
            f"output_dir {str(output_dir)!r} is not writable{where}: permission denied or a read-only file "
            "system; choose another output_dir"
        )


def _check_resume(
    config: TrainConfig, resume_path: Path, output_dir: Path, entries: list[str], shown: str
) -> None:
    """A resume that continues one run, as that run trained."""
    state = read_trainer_state(resume_path)
    step = state["step"]
    inside = resume_path.resolve().parent == output_dir.resolve()
    if not inside and entries:
        raise ConfigError(
            f"resume_from_checkpoint {str(resume_path)!r} continues a run of another directory, but "
            f"output_dir {str(output_dir)!r} already holds files ({shown}); continue it in an empty one"
        )
    later = [path.name for path in list_checkpoints(output_dir) if (checkpoint_step(path) or 0) > step]
    if inside and later:
        raise ConfigError(
            f"resume_from_checkpoint {str(resume_path)!r} continues from step {step}, but output_dir "
            f"{str(output_dir)!r} holds later checkpoints of its run ({', '.join(later)}) that training on "
            "would overwrite; resume from the latest (resume_from_checkpoint: latest), or continue this "
            "checkpoint in another (empty) output_dir"
        )
    saved = state.get(CONFIG_KEY)
    if not isinstance(saved, dict):
        return  # a checkpoint from before configs were saved in checkpoints: nothing to compare with
    changed = _changed_keys(saved, asdict(config))
    if changed:
        shown_changes = "; ".join(
            f"{key} {saved_value!r} -> {value!r}" for key, saved_value, value in changed
        )
        raise ConfigError(
            f"resume_from_checkpoint {str(resume_path)!r} was saved by a run with other settings: "
            f"{shown_changes} (checkpoint -> this run); resuming would mix two trainings: set them as the "
            "checkpoint has them, or start a new run in another output_dir"
        )


def _changed_keys(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved, current) for each key that changes what a resumed run trains; model first."""
    defaults = asdict(TrainConfig())
    schedule_fixed = current["lr_scheduler_type"] == "constant" and (
        current["warmup_steps"] > 0 or current["warmup_ratio"] == 0
    )  # fmt: skip
    changed = []
    for key, value in current.items():
        if key in RESUME_SAFE_KEYS or (key in LENGTH_KEYS and schedule_fixed):
            continue
        saved_value = saved.get(key, defaults.get(key))  # a key newer than the checkpoint: its default
        if saved_value != value:
            changed.append((key, saved_value, value))
    return sorted(changed, key=lambda item: item[0] != "model_name_or_path")


def _check_resume_length(resume_path: Path, max_steps: int) -> None:
    step = read_trainer_state(resume_path)["step"]
    if step > max_steps:
        raise ConfigError(
            f"resume_from_checkpoint {str(resume_path)!r} is at step {step}, past this run's last step "
            f"{max_steps} (max_steps / num_train_epochs): there is nothing to train"
        )


def _resume(engine: Engine, resume_path: Path, given: TrainConfig) -> None:
    try:
        engine.resume(resume_path)
    except CheckpointMismatchError as error:
        saved = read_trainer_state(resume_path).get(CONFIG_KEY) or {}
        by = f"a run of {saved['model_name_or_path']!r}" if "model_name_or_path" in saved else "another run"
        raise ValueError(
            f"resume_from_checkpoint {str(resume_path)!r} was saved by {by} whose weights do not fit this "
            f"run's model {given.model_name_or_path!r} (use_peft {given.use_peft}): {error}"
        ) from None


def _start_writing(given: TrainConfig, output_dir: Path, clear: list[str]) -> None:
    """Empty ``output_dir`` of an earlier run (``overwrite_output_dir``), create it, save the config."""
    try:
        for name in clear:
            path = output_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(given, output_dir / "fastalign_config.yaml")
    except OSError as error:
        raise ValueError(
            f"output_dir {str(output_dir)!r} cannot be written: {error.strerror or error}"
        ) from None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _with_local_model(config: TrainConfig) -> TrainConfig:
    """``config`` with ``model_name_or_path`` (and a ``ref_model_name_or_path`` naming the same model) as
    the local files it resolves to: a Hub id becomes its snapshot directory in the Hugging Face cache at
    ``model_revision``. Resolved once, so the skeleton, the weights filled into it and the reference all
    come from one commit, however the Hub moves meanwhile."""
    local = str(resolve_model(config.model_name_or_path, config.model_revision))
    same = config.ref_model_name_or_path == config.model_name_or_path
    return dataclasses.replace(
        config, model_name_or_path=local, model_revision=None,
        ref_model_name_or_path=local if same else config.ref_model_name_or_path,
    )  # fmt: skip


def _tokenized_splits(config: TrainConfig, recipe: Recipe) -> tuple[list, list]:
    """Training and evaluation examples. A Hub dataset trains on its ``dataset_train_split``; a Hub
    ``eval_dataset_name`` evaluates on its ``dataset_test_split`` (naming ``dataset_name`` itself gives
    TRL's evaluation on the same dataset's test split); ``dataset_config`` and ``dataset_revision`` apply
    to both. Without ``eval_dataset_name``, ``eval_split_ratio`` holds out a share of the training rows."""
    name = config.dataset_name or recipe.default_dataset
    examples = recipe.tokenize(_rows(config, name, "dataset_name", config.dataset_train_split))
    if config.eval_dataset_name:
        return examples, recipe.tokenize(
            _rows(config, config.eval_dataset_name, "eval_dataset_name", config.dataset_test_split)
        )
    if config.eval_split_ratio > 0:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed)).tolist()
        held_out = max(1, round(config.eval_split_ratio * len(examples)))
        return [examples[i] for i in order[held_out:]], [examples[i] for i in order[:held_out]]
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
        ("dataset_train_split", config.dataset_train_split != defaults.dataset_train_split,
         "dataset_name is not", train),
        ("dataset_test_split", config.dataset_test_split != defaults.dataset_test_split,
         "eval_dataset_name is not", evaluate),
        ("dataset_config", config.dataset_config is not None, either, train or evaluate),
        ("dataset_revision", config.dataset_revision is not None, either, train or evaluate),
    )  # fmt: skip
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
