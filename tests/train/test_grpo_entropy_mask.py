"""GRPO's ``top_entropy_quantile`` (TRL's entropy mask) in the trainer: the config key, which objective
reads it, the threshold over every process's tokens, and a run with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastalign.train.config import ConfigError, TrainConfig, check_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from tests.helpers import require
from tests.torchrun import run_two_processes
from tests.train.test_rollout_options import DIGITS, run

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def test_grpo_reads_top_entropy_quantile():
    objective = make_objective("grpo", TrainConfig(reward_funcs=[DIGITS], top_entropy_quantile=0.2), CPU)
    assert objective.loss.top_entropy_quantile == 0.2
    assert objective.loss.entropy_gather is None  # one process: its own tokens
    assert make_objective("grpo", TrainConfig(reward_funcs=[DIGITS]), CPU).loss.top_entropy_quantile == 1.0


def test_rloo_refuses_top_entropy_quantile():
    """TRL's RLOOConfig has no entropy mask."""
    config = TrainConfig(reward_funcs=[DIGITS], top_entropy_quantile=0.2)
    with pytest.raises(ConfigError, match=r"'top_entropy_quantile'.*is for grpo; rloo does not read it"):
        make_objective("rloo", config, CPU)


@pytest.mark.parametrize("value", [-0.1, 1.01])
def test_top_entropy_quantile_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        check_config(TrainConfig(reward_funcs=[DIGITS], top_entropy_quantile=value))


def test_the_threshold_is_over_every_process_tokens_as_trl():
    require("trl")  # the worker's oracle
    run_two_processes(Path(__file__).with_name("grpo_entropy_worker.py"), timeout=300)


@pytest.mark.slow
def test_a_run_with_the_entropy_mask_trains(tmp_path):
    rows = run(tmp_path, "grpo", top_entropy_quantile=0.2, beta=0.0)
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert all("entropy" in row for row in rows if "loss" in row)
