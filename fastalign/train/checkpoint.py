"""Training checkpoints that a crash cannot corrupt, and that resume a run exactly.

A checkpoint is a directory ``checkpoint-<step>`` holding the model (or, with LoRA, only the trainable
adapter weights) and optimizer state in ``torch.distributed.checkpoint`` format (each rank writes its
own shards; loading re-shards), ``trainer_state.json`` (step, data position, scheduler, the config
fingerprint) and one ``rng-<rank>.pt`` of tensors per rank. It is written under ``.tmp-checkpoint-<step>``
and renamed when complete: a kill during a save leaves only a temporary directory, which resume never
picks and the next save deletes. The last ``save_total_limit`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fastalign.train.distributed import DistributedContext

_NAME = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def resolve_resume_path(resume_from_checkpoint: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: a directory, or "latest" (None when there is none yet)."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    path = Path(resume_from_checkpoint)
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(
            f"resume_from_checkpoint {resume_from_checkpoint!r} is not a complete checkpoint "
            f"(no {TRAINER_STATE} in it)"
        )
    return path


#: Frozen parameters (the base model under LoRA) are not saved: they come from the base weights.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _barrier(ctx: DistributedContext) -> None:
    if ctx.enabled:
        dist.barrier()


def _quiet_dcp(fn, *args, **kwargs):
    """DCP warns that it runs without a process group in single-process runs, which is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process", category=UserWarning)
        return fn(*args, **kwargs)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    ctx: DistributedContext,
    save_total_limit: int,
) -> Path:
    """Write ``checkpoint-<step>`` atomically (every rank calls this); returns its path."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    if ctx.is_main:
        for stale in root.glob(".tmp-checkpoint-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(ctx)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    _quiet_dcp(dcp.save, {"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-{ctx.rank}.pt")
    _barrier(ctx)
    if ctx.is_main:
        _write_json(tmp / TRAINER_STATE, trainer_state)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(root)[:-save_total_limit]:
            shutil.rmtree(old)
    _barrier(ctx)
    return final


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistributedContext
) -> dict:
    """Restore model, optimizer and this rank's RNG from ``path``; returns its trainer state."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    _quiet_dcp(dcp.load, state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=_OPTIONS,
    )  # fmt: skip
    rng_file = path / f"rng-{ctx.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / TRAINER_STATE).read_text())


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
