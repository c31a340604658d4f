"""Resuming from a checkpoint unpickles nothing but checkpoint data (``fastalign.train.safe_dcp``): DCP's
``.metadata`` pickle and its non-tensor values (``torch.save`` bytes, loaded by DCP's default planner with
``weights_only=False``) that would construct anything else are refused in one line, and nothing of them
runs; a checkpoint fastalign wrote resumes as before. Runs on every supported torch (the lowest too)."""

from __future__ import annotations

import io
import os
import pickle
import types
from pathlib import Path

import pytest
import torch

from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training
from fastalign.train.safe_dcp import METADATA, SafeLoadPlanner, UnsafeCheckpointError, check_metadata


class Payload:
    """What an attacker pickles: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def options(out: Path, **more) -> TrainConfig:
    fixed = dict(
        output_dir=str(out), max_steps=1, save_steps=1, loss_curve_png=False, lr_scheduler_type="constant"
    )
    return TrainConfig(**fixed | more)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    run_training(options(out), "sft")
    return out / "checkpoint-1"


def test_fastalign_checkpoints_pass_and_resume(checkpoint, tmp_path):
    check_metadata(checkpoint)  # DCP's metadata classes, sizes, dtypes, layouts, paths
    out = tmp_path / "resumed"
    resumed = options(out, max_steps=2, resume_from_checkpoint=str(checkpoint))
    assert run_training(resumed, "sft") == out


def test_a_metadata_pickle_that_would_run_code_is_refused_unrun(checkpoint, tmp_path):
    copy = tmp_path / "checkpoint-1"
    copy.mkdir()
    for file in checkpoint.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    marker = tmp_path / "ran"
    (copy / METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        UnsafeCheckpointError, match=r"would construct posix\.mkdir, which is not checkpoint"
    ) as e:
        check_metadata(copy)
    assert "\n" not in str(e.value) and not marker.exists()
    out = tmp_path / "resumed"
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        run_training(options(out, max_steps=2, resume_from_checkpoint=str(copy)), "sft")
    assert not marker.exists()


def test_a_non_tensor_value_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    planner = SafeLoadPlanner()
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optim.param_groups.0.lr"))
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    with pytest.raises(
        UnsafeCheckpointError, match=r"'optim\.param_groups\.0\.lr' is not plain data: refused"
    ):
        planner.load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert not marker.exists()
