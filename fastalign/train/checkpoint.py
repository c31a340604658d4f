"""Training checkpoints that a crash cannot corrupt, and that resume a run exactly.

A checkpoint is a directory ``checkpoint-<step>`` holding the model (or, with LoRA, only the trainable adapter
weights) and optimizer state in ``torch.distributed.checkpoint`` format (each rank writes its own shards;
loading re-shards), ``trainer_state.json`` (step, data position, scheduler, and under ``"config"`` the run's
config as given: the fingerprint a resume is checked against) and one ``rng-<rank>.pt`` per rank (torch's,
Python's ``random`` and numpy's generators). A checkpoint saved where the objective's next steps still train
on something no data position makes again (a generation sampled by the policy of an earlier step:
``Objective.pending_state``) holds it too, per rank: ``pending-<rank>.safetensors`` (its tensors) and
``pending-<rank>.json`` (each tensor's dtype and shape, and the objective's small metadata), never pickle; a
resume hands them back to the objective, and a file missing, unreadable or not as listed is a one-line error
naming it. It is written under ``.tmp-checkpoint-<step>`` and renamed when complete: a kill during a save
leaves only a temporary directory, which resume never picks and the next save deletes; a disk that fills
during a save is a one-line ``DiskFullError``, the partial directory removed. ``save_total_limit`` checkpoints
are kept (None: all), as transformers rotates them: the newest and the best (``load_best_model_at_end``)
always, the others newest first; and besides them, until the run ends, the newest one that a finite step has
followed: a checkpoint saved just before a run diverges may hold the weights that diverge, and must not be the
only one left. At the end the best is kept, not the newest, where only one may stay.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fastalign.train.distributed import DistributedContext, raise_on_every_rank
from fastalign.train.safe_dcp import METADATA, SafeLoadPlanner, UnsafeCheckpointError, check_metadata

_NAME = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
#: The directory of a checkpoint that holds the objective's own state (``Objective.state_dict``).
OBJECTIVE_STATE = "objective"
#: Where the trainer state keeps the run's config (a dict of ``TrainConfig`` fields, as given).
CONFIG_KEY = "config"
#: Each rank's pending state (``PendingState``): ``<name>.safetensors`` and ``<name>.json``.
PENDING = "pending-{rank}"
#: The trainer state's key that says every rank saved a pending state.
PENDING_KEY = "pending"


@dataclass
class PendingState:
    """What an objective's next steps still train on that no data position makes again (e.g. a generation
    sampled by the policy of an earlier step), on one rank: ``tensors`` (saved as safetensors) and
    ``meta``, small JSON-serialisable metadata (numbers, strings, lists, dicts)."""

    tensors: dict[str, torch.Tensor]
    meta: dict


class DiskFullError(OSError, ValueError):
    """The disk (or quota) filled while writing a checkpoint or the export; what was half written is
    removed. Also a ValueError, so ``fastalign train`` prints it as one line."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors do not fit the model (and optimizer) being trained."""


class CheckpointDamagedError(ValueError):
    """A checkpoint with a file missing, shorter than its metadata says, or unreadable: moved into place
    whole (``save_checkpoint`` renames it atomically) and damaged since."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is, wraps or was caused by an out-of-space ``OSError`` (ENOSPC, EDQUOT), also
    inside a ``CheckpointException`` (how ``torch.distributed.checkpoint`` reports a rank's failure)."""
    stack, seen = [error], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(current, CheckpointException):
            stack.extend(failure for failure, _ in current.failures.values())
        stack.extend((current.__cause__, current.__context__))
    return False


def checkpoint_step(path: str | Path) -> int | None:
    """The step in a ``checkpoint-<step>`` name, else None."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` directories in ``output_dir``, oldest first: each moved into place whole
    (a half-written one is a ``.tmp-checkpoint-*``); one damaged since is what ``check_complete`` finds."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def check_complete(path: str | Path) -> dict:
    """Whether checkpoint ``path`` still holds all it was written with, read before any model loads: its
    trainer state, the metadata of its tensors (and of the objective's state), every file that metadata
    places tensors in, at least as long as it says, and the RNG state of each rank of the run that saved
    it. A one-line ``CheckpointDamagedError`` names the first file missing or short. Returns the trainer
    state."""
    path = Path(path)
    try:
        state = read_trainer_state(path)
    except ValueError as error:
        raise CheckpointDamagedError(str(error)) from None
    for directory in (path, path / OBJECTIVE_STATE):
        if directory != path and not directory.is_dir():
            continue
        metadata = check_metadata(directory)
        where = directory.relative_to(path)
        if metadata is None:
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: {where / METADATA} is missing")
        ends: dict[str, int] = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            file = directory / name
            if not file.is_file():
                raise CheckpointDamagedError(f"checkpoint {path} is damaged: {where / name} is missing")
            if file.stat().st_size < end:
                raise CheckpointDamagedError(
                    f"checkpoint {path} is damaged: {where / name} holds {file.stat().st_size:,} bytes, its "
                    f"metadata places data up to byte {end:,}"
                )
    for rank in range(int((state.get(CONFIG_KEY) or {}).get("fastalign_world_size", 1))):
        _read_rng_state(path / f"rng-{rank}.pt")
    return state


def read_trainer_state(path: str | Path) -> dict:
    """A checkpoint's ``trainer_state.json`` (step, position, scheduler, config), read without its tensors."""
    file = Path(path) / TRAINER_STATE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"checkpoint {Path(path)} cannot be read: {file.name}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        raise ValueError(f"checkpoint {Path(path)} cannot be read: {file.name} holds no step")
    return data


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
#: Loading sets only what was saved (not strict: the frozen weights are not in it, and stay as they are);
#: ``_load`` has already refused a checkpoint that lacks any tensor asked for.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rng_state() -> dict:
    """torch's (CPU, CUDA), Python's ``random`` and numpy's global generators, in types that
    ``torch.load(weights_only=True)`` reads back."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if "python" in rng:  # a checkpoint saved before they were kept has torch's only
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        kind, keys, position, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))


def _write_durably(path: Path, write, mode: str = "w") -> None:
    """``write(file)`` into ``path``, flushed to disk before the directory holding it is renamed into
    place."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


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
    save_total_limit: int | None,
    objective_state: dict[str, torch.Tensor] | None = None,
    best: Path | None = None,
    pending: PendingState | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically (every rank calls this); returns its path. The objective's
    state (tensors it carries across steps, possibly sharded) goes into ``objective/`` beside the model,
    and this rank's ``pending`` state (``Objective.pending_state``: every rank has one, or none has) into
    ``pending-<rank>.*``. Older checkpoints beyond ``save_total_limit`` are deleted, never ``best``."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    try:
        if ctx.is_main:
            for stale in root.glob(".tmp-checkpoint-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier(ctx)
        model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
        _quiet_dcp(dcp.save, {"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        if objective_state:
            _quiet_dcp(dcp.save, objective_state, checkpoint_id=str(tmp / OBJECTIVE_STATE))
        rng = _rng_state()
        _write_durably(tmp / f"rng-{ctx.rank}.pt", lambda f: torch.save(rng, f), "wb")
        if pending is not None:
            _write_pending(tmp / PENDING.format(rank=ctx.rank), pending)
            trainer_state = {**trainer_state, PENDING_KEY: True}
        _barrier(ctx)
        if ctx.is_main:
            _write_json(tmp / TRAINER_STATE, trainer_state)
            fsync_dir(tmp)
    except BaseException as error:
        if not is_disk_full(error):
            raise  # a kill or another failure: the temporary directory stays, never picked, deleted next save
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(root)
        raise DiskFullError(
            f"no space left on device while writing checkpoint-{step} in {root}: the partial checkpoint was "
            f"removed; {f'the last complete one is {kept[-1].name}' if kept else 'no checkpoint was saved'}"
        ) from None
    if ctx.is_main:
        os.replace(tmp, final)
        fsync_dir(root)
        for old in _beyond_limit(list_checkpoints(root), save_total_limit, best, step):
            shutil.rmtree(old)
    _barrier(ctx)
    return final


def prune_checkpoints(
    output_dir: str | Path, save_total_limit: int | None, ctx: DistributedContext, best: Path | None = None
) -> None:
    """At the end of a run that finished: ``save_total_limit`` checkpoints, the best among them."""
    if ctx.is_main:
        for old in _beyond_limit(list_checkpoints(output_dir), save_total_limit, best):
            shutil.rmtree(old)
    _barrier(ctx)


def _beyond_limit(
    checkpoints: list[Path], limit: int | None, best: Path | None, step: int | None = None
) -> list[Path]:
    """The checkpoints to delete, oldest first, so that ``limit`` stay (None: all stay), as transformers'
    ``rotate_checkpoints``: never ``best``, nor while the run goes on (``step``: the one just saved) the
    newest, which a resume continues (so with both and ``limit`` 1, two stay until the end). While the run
    goes on, if none of those that stay has been followed by a finite step (e.g. ``limit`` 1: only the one
    just saved), the newest of the others stays too: a run that diverges on its next step leaves a
    checkpoint that trains on."""
    if limit is None or not checkpoints:
        return []
    best = next((path for path in checkpoints if best is not None and path == Path(best)), None)
    protected = {best} if step is None and best is not None else {checkpoints[-1], best} - {None}
    others = [path for path in checkpoints if path not in protected]
    doomed = others[: max(0, len(checkpoints) - max(limit, len(protected)))]
    staying = [path for path in checkpoints if path not in doomed]
    if step is not None and doomed and all((checkpoint_step(path) or 0) >= step for path in staying):
        doomed = doomed[:-1]
    return doomed


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Only the model's weights from checkpoint ``path`` (with LoRA: the adapters), re-sharded as the model
    is: the best checkpoint's, loaded into the trained model at the end of a run (every rank calls this)."""
    state = {"model": get_model_state_dict(model, options=_OPTIONS)}
    _load(state, Path(path))
    set_model_state_dict(model, state["model"], options=_LOAD_OPTIONS)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistributedContext,
    objective_state: dict[str, torch.Tensor] | None = None,
) -> dict:
    """Restore model, optimizer, the objective's state (loaded in place into ``objective_state``'s
    tensors) and this rank's RNG from ``path``; returns its trainer state."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    _load(state, path)
    if objective_state:
        if not (path / OBJECTIVE_STATE).is_dir():
            raise ValueError(
                f"resume_from_checkpoint {str(path)!r} holds no objective state ({OBJECTIVE_STATE}/: "
                f"{', '.join(sorted(objective_state)[:2])}, ...), which this run carries across steps: it "
                "was saved by a run without it; resume from one of this run's checkpoints, or start a new run"
            )
        _load(objective_state, path / OBJECTIVE_STATE)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_LOAD_OPTIONS,
    )
    _set_rng_state(_read_rng_state(path / f"rng-{ctx.rank}.pt"))
    return json.loads((path / TRAINER_STATE).read_text())


def _read_rng_state(file: Path) -> dict:
    """A rank's saved RNG states (plain data and tensors only: ``weights_only``); a file missing, damaged
    or holding anything else is a one-line ``CheckpointDamagedError``, and nothing of it runs."""
    try:
        rng = torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointDamagedError(f"checkpoint {file.parent} is damaged: {file.name} is missing") from None
    except pickle.UnpicklingError:  # damage, or a pickle of something else than data (it could run code)
        raise CheckpointDamagedError(
            f"checkpoint {file.parent}: {file.name} is damaged or holds something other than RNG states: "
            "refused (nothing of it was run)"
        ) from None
    except Exception as error:  # a torch file cut short, or bytes that are none (torch's own words are its
        # advice to load it unsafely: not repeated)
        raise CheckpointDamagedError(
            f"checkpoint {file.parent} is damaged: {file.name} cannot be read ({type(error).__name__})"
        ) from None
    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
        raise CheckpointDamagedError(f"checkpoint {file.parent} is damaged: {file.name} holds no RNG state")
    return rng


def load_pending(path: str | Path, ctx: DistributedContext, load: Callable[[PendingState], None]) -> None:
    """Where checkpoint ``path`` holds pending states (``save_checkpoint``'s ``pending``), read this rank's
    and hand it to ``load`` (the objective's ``load_pending_state``). A file missing or unreadable, tensors
    other than its JSON lists, or a state ``load`` refuses (a ValueError) is a one-line ValueError naming
    the file, on every rank (every rank calls this)."""
    path = Path(path)
    if not read_trainer_state(path).get(PENDING_KEY):
        return
    stem = path / PENDING.format(rank=ctx.rank)
    listing, data = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    error = None
    try:
        load(_read_pending(listing, data))
    except _PendingFileError as failure:
        error = f"checkpoint {path} cannot be resumed: {failure.file.name}: {failure.reason}"
    except ValueError as failure:  # the objective's: tensors that are not what it saved
        error = f"checkpoint {path} cannot be resumed: {data.name}: {_first_line(failure)}"
    raise_on_every_rank(error, ctx)


_MISSING = f"missing, though its {TRAINER_STATE} says every rank saved a pending state"


class _PendingFileError(Exception):
    """A pending-state file that is missing, unreadable or not as listed, and why."""

    def __init__(self, file: Path, reason: object):
        super().__init__(file, reason)
        self.file, self.reason = file, _first_line(reason)


def _first_line(reason: object) -> str:
    text = str(reason).strip()
    return text.splitlines()[0] if text else type(reason).__name__


def _write_pending(stem: Path, pending: PendingState) -> None:
    """``pending``'s tensors (each its own contiguous copy: safetensors refuses views that share memory) as
    ``<stem>.safetensors``, and its metadata with each tensor's dtype and shape as ``<stem>.json``."""
    tensors = {
        name: tensor.detach().cpu().clone(memory_format=torch.contiguous_format)
        for name, tensor in pending.tensors.items()
    }
    data = safetensors.torch.save(tensors)
    _write_durably(stem.with_suffix(".safetensors"), lambda f: f.write(data), "wb")
    listed = {name: [_dtype_name(tensor.dtype), list(tensor.shape)] for name, tensor in tensors.items()}
    _write_json(stem.with_suffix(".json"), {"tensors": listed, "meta": pending.meta})


def _read_pending(listing: Path, data: Path) -> PendingState:
    """The pending state of ``listing`` (JSON) and ``data`` (safetensors), checked against each other."""
    try:
        saved = json.loads(listing.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _PendingFileError(listing, _MISSING) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _PendingFileError(listing, error) from None
    if not (
        isinstance(saved, dict)
        and isinstance(saved.get("tensors"), dict)
        and isinstance(saved.get("meta"), dict)
    ):
        raise _PendingFileError(listing, "holds no tensor listing and metadata")
    try:
        tensors = safetensors.torch.load(data.read_bytes())  # owned copies, not a map of the file
    except FileNotFoundError:
        raise _PendingFileError(data, _MISSING) from None
    except (OSError, SafetensorError) as error:
        raise _PendingFileError(data, error) from None
    if set(tensors) != set(saved["tensors"]):
        different = sorted(set(tensors) ^ set(saved["tensors"]))
        raise _PendingFileError(
            data, f"its tensors are not those {listing.name} lists ({', '.join(different[:3])})"
        )
    for name, tensor in tensors.items():
        found = [_dtype_name(tensor.dtype), list(tensor.shape)]
        if found != saved["tensors"][name]:
            raise _PendingFileError(
                data,
                f"tensor {name!r} is {found[0]} {found[1]}, {listing.name} lists {saved['tensors'][name]}",
            )
    return PendingState(tensors, saved["meta"])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load(state: dict, path: Path) -> None:
    """``dcp.load`` into ``state``'s tensors; a misfit is a ``CheckpointMismatchError`` naming why. Nothing
    of the checkpoint is unpickled but checkpoint data (``fastalign.train.safe_dcp``)."""
    check_metadata(path)
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=str(path), planner=SafeLoadPlanner())
    except CheckpointException as error:
        unsafe = [
            failure for failure, _ in error.failures.values() if isinstance(failure, UnsafeCheckpointError)
        ]
        if unsafe:
            raise unsafe[0] from None
        reasons = {
            str(failure).strip().splitlines()[0] for failure, _ in error.failures.values() if str(failure)
        }
        raise CheckpointMismatchError("; ".join(sorted(reasons)) or type(error).__name__) from None


def _write_json(path: Path, data: dict) -> None:
    _write_durably(path, lambda f: json.dump(data, f, indent=1))


def fsync_dir(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (a rename into it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
