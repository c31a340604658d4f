"""The final artefact of a run: a model ``from_pretrained`` loads, or a PEFT adapter."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fastalign.models.structure import base_model
from fastalign.patching import unpatch_model
from fastalign.train.checkpoint import DiskFullError, fsync_dir, is_disk_full
from fastalign.train.distributed import DistributedContext

#: Where an export is written before its files move into ``output_dir``.
STAGING = ".tmp-export"
#: The files a loader opens first (``from_pretrained``, ``PeftModel.from_pretrained``): moved in last.
MARKERS = ("config.json", "adapter_config.json")
#: Weight files of an export: an earlier export's that this one does not write are removed.
_WEIGHTS = re.compile(r"^(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def export_model(model: torch.nn.Module, tokenizer, output_dir: str | Path, ctx: DistributedContext) -> None:
    """safetensors weights (full model) or the adapter in PEFT format, plus the tokenizer, in
    ``output_dir``. Under FSDP2 every rank takes part in gathering the full state dict (on CPU);
    the main process writes it.

    Atomic enough that a kill never leaves half a model that loads: everything is written (and fsynced)
    in ``output_dir/.tmp-export``; then an earlier export's ``config.json``/``adapter_config.json`` is
    removed, each file moves into place with ``os.replace`` (atomic per file), and ``config.json`` /
    ``adapter_config.json`` move last. So at any moment ``output_dir`` either holds a loader's entry file
    and every file it names (of one export), or no entry file. A kill leaves the staging directory,
    which the next export deletes; a full disk is a one-line ``DiskFullError``, the staging removed."""
    output_dir = Path(output_dir)
    is_peft = hasattr(model, "peft_config")
    state = None
    if ctx.enabled:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft)
        state = get_model_state_dict(model, options=options)
        state.pop(_tied_head_key(model), None)  # tied in, tied out: one copy, as save_pretrained writes
    if not ctx.is_main:
        return
    unpatch_model(model)  # a saved model is a plain transformers model
    staging = output_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # what a killed export left
    config = getattr(model, "config", None)
    training_cache = getattr(config, "use_cache", None)  # off for training (loading), on in what is saved
    try:
        if config is not None:
            config.use_cache = True
        model.save_pretrained(staging, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        move_into_place(staging, output_dir)
    except BaseException as error:
        if not is_disk_full(error):
            raise
        raise DiskFullError(
            f"no space left on device while writing the final export in {output_dir}: the partial export was "
            "removed and the checkpoints are kept; free space, then resume (resume_from_checkpoint: latest)"
        ) from None
    finally:
        if config is not None:
            config.use_cache = training_cache
        shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staging: Path, output_dir: Path) -> None:
    """Move a saved model or adapter from ``staging`` into ``output_dir`` (created if needed), fsynced,
    so that no loader ever takes a half-replaced model: an earlier export's ``MARKERS`` are removed first
    and the new ones land last, and an earlier export's weight files that this one lacks are removed."""
    output_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(path.name for path in staging.iterdir())
    for path in staging.rglob("*"):
        if path.is_file():
            fsync_dir(path)
    for marker in MARKERS:  # from here until the new one lands, no loader takes output_dir for a model
        (output_dir / marker).unlink(missing_ok=True)
    for path in output_dir.iterdir():
        if _WEIGHTS.match(path.name) and path.name not in names and path.is_file():
            path.unlink()  # an earlier export's other shards, or its other kind (adapter vs full model)
    for name in [n for n in names if n not in MARKERS] + [n for n in MARKERS if n in names]:
        target = output_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    fsync_dir(output_dir)


def _tied_head_key(model: torch.nn.Module) -> str | None:
    """The state-dict key of the LM head's weight when it is tied to the input embedding (a gathered
    full state dict holds it under both names), else None."""
    base = base_model(model)
    head = base.get_output_embeddings()
    if head is None or head.weight is not base.get_input_embeddings().weight:
        return None
    prefix = "base_model.model." if base is not model else ""
    return prefix + next(name for name, module in base.named_modules() if module is head) + ".weight"
