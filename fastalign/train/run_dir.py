"""One run per ``output_dir``: what a run checks before it writes anything, and how it starts writing.

Run directories: one ``output_dir`` holds one run. A non-empty one is refused unless the run resumes
(``resume_from_checkpoint``) or sets ``overwrite_output_dir: true``, which empties it (only if it holds a
fastalign run) once the new run has loaded. A resume is checked against the config saved in the
checkpoint: a changed key that changes what is trained is refused, naming it (see ``RESUME_SAFE_KEYS``
for those that may change); and it may not train over later checkpoints of the same directory.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

from fastalign.train.checkpoint import (
    CONFIG_KEY,
    CheckpointDamagedError,
    CheckpointMismatchError,
    check_complete,
    checkpoint_step,
    list_checkpoints,
    read_trainer_state,
    resolve_resume_path,
)
from fastalign.train.config import SHARED_DEFAULTS, ConfigError, TrainConfig, save_config
from fastalign.train.engine import Engine
from fastalign.train.safe_dcp import UnsafeCheckpointError

#: Keys a resumed run may change: they decide what is logged, evaluated and saved, and where, and how
#: memory is saved (same losses) — not what is trained. Every other key is compared with the config saved
#: in the checkpoint, and a change is refused: a resumed run trains as the checkpoint's run did.
RESUME_SAFE_KEYS = frozenset(
    {
        "output_dir",
        "resume_from_checkpoint",
        "overwrite_output_dir",
        "logging_strategy",
        "logging_steps",
        "eval_strategy",
        "eval_steps",
        "eval_on_start",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "report_to",
        "loss_curve_png",
        "per_device_eval_batch_size",
        "gradient_checkpointing",
        "activation_offloading",
        "activation_offloading_keep_on_device",
    }
)
#: Keys that set the run's length: they may change on resume (to extend or shorten a run) only where the
#: learning-rate schedule does not depend on the length — constant, with no warmup_ratio.
LENGTH_KEYS = ("max_steps", "num_train_epochs")
#: The files of an export that a loader opens first: a directory holding one holds a finished run's model.
_EXPORT_MARKERS = ("config.json", "adapter_config.json")


def check_output_dir(config: TrainConfig) -> tuple[Path | None, list[str]]:
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
    """A resume that continues one run, as that run trained, from a checkpoint that holds all it was
    written with."""
    state = _check_complete(resume_path, output_dir)
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


def _check_complete(resume_path: Path, output_dir: Path) -> dict:
    """``check_complete``, returning the checkpoint's trainer state; where it is damaged, the error also
    names the checkpoint before it (which ``latest`` resumes once the damaged one is removed, where it is
    ``output_dir``'s)."""
    try:
        return check_complete(resume_path)
    except (CheckpointDamagedError, UnsafeCheckpointError) as error:
        step = checkpoint_step(resume_path)
        earlier = [
            path
            for path in list_checkpoints(resume_path.parent)
            if (checkpoint_step(path) or 0) < (step or 0)
        ]
        hint = ""
        if earlier and step is not None and resume_path.resolve().parent == output_dir.resolve():
            before = earlier[-1].name
            hint = f"; remove it to resume from {before}, the one before it (resume_from_checkpoint: latest)"
        elif earlier and step is not None:
            hint = f"; the one before it: resume_from_checkpoint: {earlier[-1]}"
        raise type(error)(
            f"resume_from_checkpoint: {error}{hint}"
        ) from None  # its kind kept: damaged, unsafe


#: Keys whose null default the objective fills (``with_objective_defaults``), as checkpoints saved before
#: the key existed ran them: every objective read its data reshuffled each epoch.
BEFORE_THE_KEY = {"train_sampling_strategy": "random"}


def _changed_keys(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved, current) for each key that changes what a resumed run trains; model first."""
    defaults = asdict(TrainConfig())
    # a constant rate, after a warmup in steps (>= 1) or none at all, does not depend on the run's length
    warmup = current["warmup_steps"]
    schedule_fixed = current["lr_scheduler_type"] in ("constant", "constant_with_warmup") and (
        warmup >= 1 or (warmup == 0 and current["warmup_ratio"] == 0)
    )
    changed = []
    for key, value in current.items():
        if key in RESUME_SAFE_KEYS or (key in LENGTH_KEYS and schedule_fixed):
            continue
        if value is None and key in SHARED_DEFAULTS:  # the objective does not read it (else it is filled)
            continue
        saved_value = saved.get(key, defaults.get(key))  # a key newer than the checkpoint: its default,
        if key not in saved and value is not None:  # or, one an objective fills, what runs did before it
            saved_value = BEFORE_THE_KEY.get(key, saved_value)
        if saved_value != value:
            changed.append((key, saved_value, value))
    return sorted(changed, key=lambda item: item[0] != "model_name_or_path")


def check_resume_length(resume_path: Path, max_steps: int) -> None:
    step = read_trainer_state(resume_path)["step"]
    if step > max_steps:
        raise ConfigError(
            f"resume_from_checkpoint {str(resume_path)!r} is at step {step}, past this run's last step "
            f"{max_steps} (max_steps / num_train_epochs): there is nothing to train"
        )


def run_identity(objective: str, world_size: int) -> dict:
    """What a checkpoint records of its run besides the config: the objective (sft, dpo, simpo, ...: the
    loss) and the processes (a step's data position counts global batches of that many ranks)."""
    return {"fastalign_objective": objective, "fastalign_world_size": world_size}


def resume(engine: Engine, resume_path: Path, given: TrainConfig, identity: dict) -> None:
    saved = read_trainer_state(resume_path).get(CONFIG_KEY) or {}
    for key, what in (("fastalign_objective", "objective"), ("fastalign_world_size", "number of processes")):
        if key in saved and saved[key] != identity[key]:  # (a checkpoint from before they were saved: none)
            raise ConfigError(
                f"resume_from_checkpoint {str(resume_path)!r} was saved by a run with another {what} "
                f"({saved[key]!r}, this run {identity[key]!r}): resume it as it ran, or start a new run in "
                "another output_dir"
            )
    try:
        engine.resume(resume_path)
    except CheckpointMismatchError as error:
        saved = read_trainer_state(resume_path).get(CONFIG_KEY) or {}
        by = f"a run of {saved['model_name_or_path']!r}" if "model_name_or_path" in saved else "another run"
        raise ValueError(
            f"resume_from_checkpoint {str(resume_path)!r} (saved by {by}) does not load into this run's "
            f"model {given.model_name_or_path!r} (use_peft {given.use_peft}): {error}"
        ) from None


def start_writing(given: TrainConfig, output_dir: Path, clear: list[str]) -> None:
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
