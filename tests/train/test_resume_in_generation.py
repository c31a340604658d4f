"""A checkpoint inside a generation (GRPO, RLOO, PPO: one generation serves several optimizer steps) holds
the rest of it, and a run resumed from it trains on that instead of sampling it again with the newer
policy: the same losses, metrics and final weights as the run that was never stopped, after a kill or
an early stop, in one process and in two (each rank its own rows). A pending-generation file that is
missing, corrupt or not as listed is a one-line error naming it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastalign.train.checkpoint import PENDING_KEY, TRAINER_STATE
from fastalign.train.config import TrainConfig
from fastalign.train.engine import Callback
from fastalign.train.run import run_training
from tests import torchrun
from tests.train.test_alignment import config
from tests.train.test_ppo import tiny_config as ppo_config

TRAIN_WORKER = Path(__file__).with_name("train_worker.py")
#: What differs between two runs of the same training: throughput, memory and rollout timings.
UNTIMED = ("tokens_per_second", "step_seconds", "peak_memory_gib", "mfu")


class _Crash(Callback):
    """A kill after step ``at`` (before it is logged or saved): the run resumes from an earlier checkpoint."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, engine, metrics):
        if engine.state.step == self.at:
            raise KeyboardInterrupt


class _Stop(Callback):
    """An early stop after step ``at``: the run's last step, so it is logged and saved."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, engine, metrics):
        engine.should_stop = engine.state.step == self.at


def logged(output_dir: Path) -> dict[int, dict]:
    """The training rows of a run's ``metrics.jsonl`` by step, without the timings."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        row["step"]: {
            key: value for key, value in row.items() if key not in UNTIMED and not key.startswith("timing/")
        }
        for row in rows
        if "loss" in row
    }


def assert_same_run(expected: Path, got: Path, steps: range) -> None:
    """The same metrics at ``steps`` and the same exported weights."""
    want, have = logged(expected), logged(got)
    for step in steps:
        assert have[step].keys() == want[step].keys(), step
        for key, value in want[step].items():
            assert have[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    weights, resumed = load_file(expected / "model.safetensors"), load_file(got / "model.safetensors")
    assert weights.keys() == resumed.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def kill_and_resume(cfg: TrainConfig, objective: str, tmp_path: Path, at: int) -> tuple[Path, Path]:
    """``cfg`` run straight, and run again killed after step ``at`` and resumed from its latest
    checkpoint; returns both output directories."""
    straight = dataclasses.replace(cfg, output_dir=str(tmp_path / "straight"))
    run_training(straight, objective)
    killed = dataclasses.replace(cfg, output_dir=str(tmp_path / "killed"))
    with pytest.raises(KeyboardInterrupt):
        run_training(killed, objective, callbacks=[_Crash(at)])
    run_training(dataclasses.replace(killed, resume_from_checkpoint="latest"), objective)
    return Path(straight.output_dir), Path(killed.output_dir)


def stop_and_resume(cfg: TrainConfig, objective: str, tmp_path: Path, at: int) -> tuple[Path, Path]:
    """``cfg`` run straight, and run again stopped early after step ``at`` (its last checkpoint) and
    resumed from there; returns both output directories."""
    straight = dataclasses.replace(cfg, output_dir=str(tmp_path / "straight"))
    run_training(straight, objective)
    stopped = dataclasses.replace(cfg, output_dir=str(tmp_path / "stopped"))
    run_training(stopped, objective, callbacks=[_Stop(at)])
    saved = json.loads((tmp_path / "stopped" / f"checkpoint-{at}" / TRAINER_STATE).read_text())
    assert saved[PENDING_KEY] is True  # inside a generation
    run_training(dataclasses.replace(stopped, resume_from_checkpoint="latest"), objective)
    return Path(straight.output_dir), Path(stopped.output_dir)


@pytest.mark.slow
def test_grpo_killed_inside_a_generation_resumes_exactly(tmp_path):
    """steps_per_generation 4 over gradient_accumulation_steps 2: a generation serves 2 steps, each on its
    own half (steps 1-2, then 3-4). A checkpoint after every step, a log line every 2, and a kill after
    step 4: the run resumes from checkpoint-3, inside the second generation, and logs step 4 (the mean of
    steps 3 and 4) and that generation's completions as the run that went on did."""
    cfg = config(
        tmp_path,
        "grpo",
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        save_steps=1,
        logging_steps=2,
        log_completions=True,
        learning_rate=1e-2,
    )
    straight, killed = kill_and_resume(cfg, "grpo", tmp_path, at=4)
    pending = json.loads((killed / "checkpoint-3" / "pending-0.json").read_text())["meta"]
    assert (pending["generation"], pending["steps_left"], pending["micro_batches"]) == ([0, 1], 1, 4)
    assert len(pending["completion_rows"]) == 16  # not logged yet: 4 prompts × 4 completions
    assert not (killed / "checkpoint-2" / "pending-0.json").exists()  # a generation's last step
    assert_same_run(straight, killed, range(2, 5, 2))
    assert (killed / "completions.jsonl").read_text() == (straight / "completions.jsonl").read_text()


@pytest.mark.slow
def test_grpo_stopped_early_inside_a_generation_resumes_exactly(tmp_path):
    """num_iterations 2: steps 1-2 train on one generation, 3-4 on the next. A callback stops the run
    after step 3 (its last checkpoint is inside the second generation); resumed, it trains step 4 on
    that generation again, as the run that went on did."""
    cfg = config(tmp_path, "grpo", max_steps=4, num_iterations=2, learning_rate=1e-2)
    straight, stopped = stop_and_resume(cfg, "grpo", tmp_path, at=3)
    assert_same_run(straight, stopped, range(1, 5))


@pytest.mark.slow
def test_rloo_stopped_early_inside_a_generation_resumes_exactly(tmp_path):
    cfg = config(
        tmp_path,
        "rloo",
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        learning_rate=1e-2,
    )
    straight, stopped = stop_and_resume(cfg, "rloo", tmp_path, at=1)
    assert_same_run(straight, stopped, range(1, 5))


@pytest.mark.slow
def test_ppo_killed_inside_a_generation_resumes_exactly(tmp_path):
    """num_ppo_epochs 2 × num_mini_batches 2: a generation serves 4 steps; the kill after step 3 resumes
    from checkpoint-2, halfway through it (policy, critic, and the rollout's values and advantages)."""
    cfg = ppo_config(
        tmp_path, max_steps=4, save_strategy="steps", save_steps=1, num_mini_batches=2, learning_rate=1e-2
    )
    straight, killed = kill_and_resume(cfg, "ppo", tmp_path, at=3)
    assert_same_run(straight, killed, range(1, 5))


@pytest.fixture(scope="module")
def pending_checkpoint(tmp_path_factory) -> Path:
    """checkpoint-1 of a GRPO run whose generation serves 2 steps (num_iterations 2), saved as the run
    ended (max_steps 1; a constant learning rate, so a resume may go on to a later max_steps)."""
    run = tmp_path_factory.mktemp("pending") / "run"
    run_training(config(run, "grpo", max_steps=1, num_iterations=2, lr_scheduler_type="constant"), "grpo")
    return run / "checkpoint-1"


def _cut_short(checkpoint: Path) -> None:
    data = checkpoint / "pending-0.safetensors"
    data.write_bytes(data.read_bytes()[:-7])


def _no_listing(checkpoint: Path) -> None:
    (checkpoint / "pending-0.json").unlink()


def _another_shape(checkpoint: Path) -> None:
    """Files that agree with each other, but a micro-batch whose advantages are one row short."""
    data, listing = checkpoint / "pending-0.safetensors", checkpoint / "pending-0.json"
    tensors = load_file(data)
    tensors["0.advantages"] = tensors["0.advantages"][:-1].clone()
    save_file(tensors, data)
    saved = json.loads(listing.read_text())
    saved["tensors"]["0.advantages"][1][0] -= 1
    listing.write_text(json.dumps(saved))


def _no_steps_left(checkpoint: Path) -> None:
    listing = checkpoint / "pending-0.json"
    saved = json.loads(listing.read_text())
    saved["meta"]["steps_left"] = 0
    listing.write_text(json.dumps(saved))


def _not_as_listed(checkpoint: Path) -> None:
    listing = checkpoint / "pending-0.json"
    saved = json.loads(listing.read_text())
    saved["tensors"]["0.input_ids"][1][1] += 1
    listing.write_text(json.dumps(saved))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_cut_short, "pending-0.safetensors: Error while deserializing"),
        (_no_listing, "pending-0.json: missing, though its trainer_state.json says every rank saved"),
        (_another_shape, "pending-0.safetensors: micro-batch 0's tensors do not fit together (advantages"),
        (_not_as_listed, "pending-0.safetensors: tensor '0.input_ids' is int64 ["),
        (_no_steps_left, "pending-0.safetensors: its steps_left 0 is not inside a generation of"),
    ],
    ids=["corrupt", "missing", "shape", "listing", "steps_left"],
)
def test_a_damaged_pending_generation_is_one_line_naming_the_file(
    tmp_path, pending_checkpoint, damage, reason
):
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(pending_checkpoint, checkpoint)
    damage(checkpoint)
    cfg = config(
        tmp_path / "resumed",
        "grpo",
        max_steps=2,
        num_iterations=2,
        lr_scheduler_type="constant",
        resume_from_checkpoint=str(checkpoint),
    )
    with pytest.raises(ValueError) as caught:
        run_training(cfg, "grpo")
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"checkpoint {checkpoint} cannot be resumed: {reason}"), message


@pytest.mark.slow
def test_two_processes_resume_inside_a_generation_with_each_ranks_rows(tmp_path):
    """Under torchrun × 2 (gloo, FSDP2) each rank saves its own part of the generation: a run that ends
    after step 3 (its checkpoint inside the second generation) and is continued to step 4 from there
    logs step 4 and exports the weights of the run that went straight to step 4. The learning rate is
    constant, so the continued run may set a later max_steps."""
    common = dict(
        per_device_train_batch_size=4,
        num_iterations=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
    )
    straight = config(tmp_path / "straight", "grpo", max_steps=4, **common)
    ended = config(tmp_path / "ended", "grpo", max_steps=3, **common)
    continued = config(
        tmp_path / "continued",
        "grpo",
        max_steps=4,
        resume_from_checkpoint=str(tmp_path / "ended" / "checkpoint-3"),
        **common,
    )
    runs = [["grpo", dataclasses.asdict(cfg)] for cfg in (straight, ended, continued)]
    torchrun.run_two_processes(TRAIN_WORKER, json.dumps(runs), timeout=900)
    checkpoint = tmp_path / "ended" / "checkpoint-3"
    rows = [load_file(checkpoint / f"pending-{rank}.safetensors")["0.input_ids"] for rank in (0, 1)]
    assert not torch.equal(rows[0], rows[1])  # each rank's own prompts and completions
    assert_same_run(tmp_path / "straight", tmp_path / "continued", range(4, 5))


@pytest.mark.slow
def test_completions_logged_after_the_resumed_checkpoint_are_logged_once(tmp_path):
    """A checkpoint every 2 steps, a log line every step, a kill after step 4: step 3 was logged (with
    its completions) but not saved, so the run resumes from checkpoint-2 and logs step 3 again. Its
    completions.jsonl holds each generation once, as the unbroken run's (as metrics.jsonl does)."""
    cfg = config(
        tmp_path,
        "grpo",
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        save_steps=2,
        logging_steps=1,
        log_completions=True,
        learning_rate=1e-2,
    )
    straight, killed = kill_and_resume(cfg, "grpo", tmp_path, at=4)
    steps = [json.loads(line)["step"] for line in (killed / "completions.jsonl").read_text().splitlines()]
    assert steps == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert (killed / "completions.jsonl").read_text() == (straight / "completions.jsonl").read_text()
