"""Run directories, resume, divergence and export (issue 17: nothing lost, nothing silent).

Each case is a faulty input to ``fastalign train`` (or ``run_training``): a used or unusable
``output_dir``, a resume that would mix two runs, a disk that fills, a run that diverges, a kill during
the export. Each asserts the exit code (or exception type), one line naming the culprit, and that no file
of the earlier run changed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file
from torch.distributed.checkpoint import filesystem

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.train.checkpoint import list_checkpoints
from fastalign.train.config import TrainConfig
from fastalign.train.engine import Callback, NonFiniteLossError
from fastalign.train.run import run_training
from tests.reliability.conftest import assert_one_line_error, snapshot

#: A tiny run: 2 steps of tiny-llama on tiny-sft, a checkpoint after each, every step logged.
BASE = (
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
    "--max_length",
    "64",
    "--logging_steps",
    "1",
    "--loss_curve_png",
    "false",
    "--save_steps",
    "1",
    "--learning_rate",
    "1e-3",
    "--seed",
    "0",
)


def train(output_dir: Path, *flags: str) -> tuple[str, ...]:
    """``fastalign train sft`` into ``output_dir`` with the tiny run's options, then ``flags``."""
    return ("train", "sft", "--output_dir", str(output_dir), *BASE, *flags)


def api_config(output_dir: Path, **overrides) -> TrainConfig:
    options = dict(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=4,
        max_length=64,
        logging_steps=1,
        loss_curve_png=False,
        save_steps=2,
        learning_rate=1e-3,
        seed=0,
    )
    return TrainConfig(**{**options, **overrides})


def steps_logged(output_dir: Path) -> list[int]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run (cosine schedule): checkpoint-1, checkpoint-2, metrics, the final model."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(list(train(out))) == 0
    return out


@pytest.fixture
def earlier_run(finished_run, tmp_path) -> Path:
    """This test's own copy of ``finished_run``."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


@pytest.fixture(autouse=True)
def no_progress_bar(monkeypatch):
    """The training bar redraws itself on stderr, which the one-line check would count as lines."""
    import tqdm.auto

    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *args, **kwargs: real(*args, **{**kwargs, "disable": True}))


class Crash(Callback):
    """A kill right after step ``at`` was logged (an exception out of the loop, no cleanup)."""

    def __init__(self, at: int):
        self.at = at

    def on_log(self, engine, logs):
        if logs["step"] == self.at:
            raise KeyboardInterrupt("killed")


class ScaleWeights(Callback):
    """Multiplies every trainable weight by ``factor`` after step ``at`` (before that step's save)."""

    def __init__(self, at: int, factor: float):
        self.at, self.factor = at, factor

    def on_step_end(self, engine, metrics):
        if engine.state.step == self.at:
            with torch.no_grad():
                for parameter in engine.model.parameters():
                    parameter.mul_(self.factor)


def weights_finite(checkpoint: Path) -> bool:
    """Whether every tensor of a checkpoint's model (its dcp shards) is finite."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent.parent / f"{checkpoint.name}.pt"  # outside the run directory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp: "no process group" in a single process
        dcp_to_torch_save(str(checkpoint), str(target))
    state = torch.load(target, weights_only=True)["model"]
    target.unlink()
    return all(torch.isfinite(t).all() for t in state.values() if isinstance(t, torch.Tensor))


# --- a used or unusable output_dir -------------------------------------------------------------------


def test_a_second_run_into_a_used_output_dir_is_refused(bad_input, earlier_run):
    """Before: the second run pruned its own checkpoints (the old ones sort higher) or crashed renaming
    onto the old checkpoint-N, and mixed both runs in metrics.jsonl."""
    before = snapshot(earlier_run)
    outcome = bad_input(*train(earlier_run, "--learning_rate", "2e-3"), culprit="output_dir")
    assert "resume_from_checkpoint" in outcome.message and "overwrite_output_dir" in outcome.message
    assert snapshot(earlier_run) == before


def test_an_output_dir_that_is_a_file_is_named(bad_input, tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"someone's file")
    outcome = bad_input(*train(target), culprit=str(target))
    assert "output_dir" in outcome.message and "is a file" in outcome.message
    assert target.read_bytes() == b"someone's file"


def test_an_output_dir_under_a_file_is_named(bad_input, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a directory")
    outcome = bad_input(*train(blocker / "run"), culprit=str(blocker))
    assert "output_dir" in outcome.message and blocker.read_text() == "not a directory"


def test_a_read_only_output_dir_is_named(bad_input, tmp_path, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make access() answer as for a read-only mount
        real_access = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda path, mode, **kw: False if Path(path) == read_only else real_access(path, mode),
        )
    try:
        outcome = bad_input(*train(read_only), culprit=str(read_only))
    finally:
        read_only.chmod(0o755)
    assert "not writable" in outcome.message and list(read_only.iterdir()) == []


def test_overwrite_output_dir_replaces_the_earlier_run(earlier_run, capsys):
    """``overwrite_output_dir: true`` removes the earlier run first: nothing of it mixes with the new."""
    assert main(list(train(earlier_run, "--overwrite_output_dir", "true", "--max_steps", "1"))) == 0
    assert [p.name for p in list_checkpoints(earlier_run)] == ["checkpoint-1"]
    assert steps_logged(earlier_run) == [1]
    assert (earlier_run / "model.safetensors").is_file() and (earlier_run / "config.json").is_file()


def test_overwrite_refuses_a_directory_that_holds_no_run(bad_input, tmp_path):
    """Overwriting deletes: only a directory that holds a fastalign run, never someone's other files."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    outcome = bad_input(*train(out, "--overwrite_output_dir", "true"), culprit="overwrite_output_dir")
    assert "fastalign_config.yaml" in outcome.message
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_overwrite_refuses_to_delete_the_model_it_trains(bad_input, earlier_run):
    """Training on from a run's exported model into the same directory: overwriting would delete it."""
    before = snapshot(earlier_run)
    flags = ("--overwrite_output_dir", "true", "--model_name_or_path", str(earlier_run))
    outcome = bad_input(*train(earlier_run, *flags), culprit="model_name_or_path")
    assert "overwrite_output_dir" in outcome.message
    assert snapshot(earlier_run) == before


def test_overwrite_and_resume_together_are_refused(bad_input, earlier_run):
    before = snapshot(earlier_run)
    outcome = bad_input(
        *train(earlier_run, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "latest"),
        culprit="overwrite_output_dir",
    )
    assert "resume_from_checkpoint" in outcome.message
    assert snapshot(earlier_run) == before


# --- resume that would mix two runs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (("--learning_rate", "5e-3"), "learning_rate"),
        (("--lr_scheduler_type", "cosine"), "lr_scheduler_type"),
        (("--seed", "7"), "seed"),
        (("--max_steps", "4"), "max_steps"),  # a linear decay over 4 steps is another schedule
    ],
    ids=["learning_rate", "lr_scheduler_type", "seed", "max_steps-linear"],
)
def test_resume_with_a_changed_training_key_is_refused(bad_input, earlier_run, flags, culprit):
    """Before: the resumed run silently kept the checkpoint's schedule (or mixed old and new)."""
    before = snapshot(earlier_run)
    outcome = bad_input(*train(earlier_run, "--resume_from_checkpoint", "latest", *flags), culprit=culprit)
    assert "checkpoint-2" in outcome.message
    assert snapshot(earlier_run) == before


def test_resuming_another_models_checkpoint_names_both(bad_input, earlier_run):
    before = snapshot(earlier_run)
    outcome = bad_input(
        *train(earlier_run, "--resume_from_checkpoint", "latest", "--model_name_or_path", "tiny-qwen2"),
        culprit="tiny-qwen2",
    )
    assert "tiny-llama" in outcome.message
    assert snapshot(earlier_run) == before


def test_a_checkpoint_that_does_not_fit_the_model_names_both(bad_input, tmp_path):
    """The same model path, other weights' shapes (the directory was replaced): not a traceback."""
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "run"
    assert main(list(train(out, "--model_name_or_path", str(model_dir)))) == 0
    shutil.rmtree(model_dir)
    tiny_model("llama", hidden_size=32, intermediate_size=64, head_dim=8).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    before = snapshot(out)
    outcome = bad_input(
        *train(out, "--model_name_or_path", str(model_dir), "--resume_from_checkpoint", "latest"),
        culprit=str(model_dir),
    )
    assert "checkpoint-2" in outcome.message and "size mismatch" in outcome.message.lower()
    assert snapshot(out) == before


class _Evil:
    """Unpickled, it would create the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_pickle(file: Path) -> None:
    file.write_bytes(pickle.dumps(_Evil(file.parent.parent / "evil-ran")))


@pytest.mark.parametrize(
    ("damage", "culprit"),
    [
        (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json"),
        (lambda c: (c / ".metadata").unlink(), ".metadata is missing"),
        (lambda c: (c / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
        (lambda c: os.truncate(c / "__0_0.distcp", 1000), "__0_0.distcp holds 1,000 bytes"),
        (lambda c: os.truncate(c / "__0_0.distcp", 0), "__0_0.distcp holds 0 bytes"),
        (lambda c: (c / "rng-0.pt").unlink(), "rng-0.pt is missing"),
        (lambda c: os.truncate(c / "rng-0.pt", 100), "rng-0.pt"),
        (lambda c: _evil_pickle(c / "rng-0.pt"), "rng-0.pt is damaged or holds something other than"),
        (lambda c: (c / "rng-0.pt").write_text("not a torch file"), "rng-0.pt"),
        (lambda c: (c / "rng-0.pt").write_bytes(bytes(4096)), "rng-0.pt"),
        (lambda c: os.truncate(c / ".metadata", 100), ".metadata cannot be read"),
    ],
    ids=[
        "no-state",
        "no-metadata",
        "no-shard",
        "short-shard",
        "empty-shard",
        "no-rng",
        "short-rng",
        "evil-rng",
        "text-rng",
        "zero-rng",
        "short-metadata",
    ],
)
def test_a_damaged_checkpoint_is_named_with_the_one_before_it(bad_input, earlier_run, damage, culprit):
    """Before: a missing RNG file resumed silently with another random stream (losses parted from the
    uninterrupted run's), a damaged one was a torch traceback suggesting weights_only=False, and a damaged
    shard was "saved by a run of 'tiny-llama' whose weights do not fit this run's model 'tiny-llama'"."""
    damage(earlier_run / "checkpoint-2")
    before = snapshot(earlier_run)
    outcome = bad_input(*train(earlier_run, "--resume_from_checkpoint", "latest"), culprit=culprit)
    assert "checkpoint-2" in outcome.message and "resume from checkpoint-1" in outcome.message
    assert "weights_only" not in outcome.message
    assert snapshot(earlier_run) == before
    assert not (earlier_run / "evil-ran").exists()


def test_resuming_an_earlier_checkpoint_beside_later_ones_is_refused(bad_input, earlier_run):
    """Before: training on from checkpoint-1 crashed renaming onto the old checkpoint-2, after pruning."""
    before = snapshot(earlier_run)
    outcome = bad_input(
        *train(earlier_run, "--resume_from_checkpoint", str(earlier_run / "checkpoint-1")),
        culprit="checkpoint-2",
    )
    assert snapshot(earlier_run) == before
    assert "output_dir" in outcome.message


def test_resuming_into_another_runs_output_dir_is_refused(bad_input, earlier_run, finished_run):
    """A checkpoint of one directory continued in a directory that holds another run would mix both."""
    before = snapshot(earlier_run)
    outcome = bad_input(
        *train(earlier_run, "--resume_from_checkpoint", str(finished_run / "checkpoint-1")),
        culprit="output_dir",
    )
    assert str(earlier_run) in outcome.message
    assert snapshot(earlier_run) == before


def test_resume_latest_of_a_finished_run_without_checkpoints_is_refused(bad_input, tmp_path):
    """Nothing to resume from, and starting again would replace the finished run's model."""
    out = tmp_path / "run"
    no_saves = ("--save_strategy", "no", "--save_steps", "500")  # BASE's save_steps: read under "steps" only
    assert main(list(train(out, *no_saves))) == 0
    before = snapshot(out)
    bad_input(*train(out, *no_saves, "--resume_from_checkpoint", "latest"), culprit="checkpoint")
    assert snapshot(out) == before


def test_resume_applies_the_keys_that_are_safe_to_change(tmp_path):
    """logging_steps and save_total_limit may change on resume; both apply. Rows the crashed run logged
    after its checkpoint are dropped, not duplicated."""
    cfg = api_config(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "sft", callbacks=[Crash(at=3)])
    assert steps_logged(tmp_path / "run") == [1, 2, 3]
    resumed = api_config(
        tmp_path / "run", resume_from_checkpoint="latest", logging_steps=2, save_total_limit=1
    )
    run_training(resumed, "sft")
    assert steps_logged(tmp_path / "run") == [1, 2, 4]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-4"]


def test_resume_after_a_crash_logs_every_step_once(tmp_path):
    """Before: steps 3 (logged by the crashed run after checkpoint-2) appeared twice in metrics.jsonl."""
    cfg = api_config(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "sft", callbacks=[Crash(at=3)])
    cfg.resume_from_checkpoint = "latest"
    run_training(cfg, "sft")
    assert steps_logged(tmp_path / "run") == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "schedule",
    [
        ("--lr_scheduler_type", "constant"),
        ("--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "1"),
    ],
    ids=["constant", "constant-after-a-warmup-in-steps"],
)
def test_max_steps_may_grow_on_resume_under_a_constant_schedule(tmp_path, schedule):
    """A constant schedule (after a warmup in steps, or none) does not depend on the run's length:
    extending is exact. Before, only ``constant`` with a warmup in steps could grow, which the schedule
    check refuses (transformers' ``constant`` has no warmup)."""
    out = tmp_path / "run"
    assert main(list(train(out, *schedule))) == 0
    flags = (*schedule, "--resume_from_checkpoint", "latest", "--max_steps", "3")
    assert main(list(train(out, *flags))) == 0
    assert steps_logged(out) == [1, 2, 3]


# --- disk full, kill during the export ---------------------------------------------------------------


def test_a_disk_that_fills_during_a_checkpoint_is_one_line(bad_input, tmp_path, monkeypatch):
    """Before: a CheckpointException traceback, and the partial .tmp-checkpoint-2 left behind."""
    real_write_item = filesystem._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if ".tmp-checkpoint-2" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)
    out = tmp_path / "run"
    outcome = bad_input(*train(out), culprit="no space left on device")
    assert "checkpoint-2" in outcome.message
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob(".tmp-*"))


def test_a_disk_that_fills_during_the_export_is_one_line(bad_input, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "run"
    outcome = bad_input(*train(out), culprit="no space left on device")
    assert "export" in outcome.message
    assert not (out / "config.json").exists() and not list(out.glob(".tmp-*"))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]


def test_a_kill_during_the_export_leaves_no_config_without_weights(tmp_path, monkeypatch):
    """Before: config.json (written first by save_pretrained) without model.safetensors. Now the files
    move into place with config.json last, so a directory with config.json holds a whole model."""

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the export")

    real = transformers.modeling_utils.safe_save_file
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", killed)
    cfg = api_config(tmp_path / "run", max_steps=2)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "sft")
    out = tmp_path / "run"
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    cfg.resume_from_checkpoint = "latest"  # the restart finishes the export
    run_training(cfg, "sft")
    assert (out / "config.json").is_file() and load_file(out / "model.safetensors")
    assert not list(out.glob(".tmp-*"))


# --- divergence ---------------------------------------------------------------------------------------


def test_divergence_is_one_line_and_no_diverged_checkpoint_is_resumed(bad_input, tmp_path):
    """learning_rate 1e30: step 1 leaves |w| ~ 1e30 (finite, saved as checkpoint-1), step 2's loss is
    NaN. Before: a traceback naming checkpoint-1, which holds those weights, as the last good one."""
    out = tmp_path / "run"
    outcome = bad_input(*train(out, "--learning_rate", "1e30", "--max_steps", "3"), culprit="step 2")
    assert "not finite" in outcome.message and "checkpoint-1" in outcome.message
    assert list_checkpoints(out) == []  # 'latest' would resume straight into the NaN
    assert (out / "checkpoint-1.diverged").is_dir()  # kept for inspection, under a name resume never picks


def test_weights_that_turn_non_finite_are_never_checkpointed(tmp_path):
    cfg = api_config(tmp_path / "run", save_steps=1)
    with pytest.raises(NonFiniteLossError) as error:
        run_training(cfg, "sft", callbacks=[ScaleWeights(at=2, factor=math.inf)])
    assert isinstance(error.value, ValueError)  # the CLI prints it as one line
    assert_one_line_error(error.value, "checkpoint-1")
    assert "weights" in str(error.value)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-1"]
    assert weights_finite(tmp_path / "run" / "checkpoint-1")


def test_the_checkpoint_named_after_a_nan_holds_weights_that_train(tmp_path):
    """Weights scaled by 1e30 after step 2 (finite, so checkpoint-2 is written); step 3's loss is NaN:
    the error names checkpoint-1, and checkpoint-2 (the weights that gave the NaN) is set aside."""
    cfg = api_config(tmp_path / "run", save_steps=1, save_total_limit=1)
    with pytest.raises(NonFiniteLossError) as error:
        run_training(cfg, "sft", callbacks=[ScaleWeights(at=2, factor=1e30)])
    assert_one_line_error(error.value, "step 3")
    assert "checkpoint-1" in str(error.value)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-1"]
    cfg.resume_from_checkpoint = "latest"  # the named checkpoint trains on
    run_training(cfg, "sft")
    assert steps_logged(tmp_path / "run") == [1, 2, 3, 4]


def test_a_collapsed_run_warns_once(tmp_path):
    """All weights zero: the loss is ln V at every step and the gradient norm 0. Trains, but says so."""

    class Collapse(Callback):
        def on_train_begin(self, engine):
            with torch.no_grad():
                for parameter in engine.model.parameters():
                    parameter.zero_()

    with pytest.warns(UserWarning, match="collapsed") as caught:
        run_training(api_config(tmp_path / "run", max_steps=3), "sft", callbacks=[Collapse()])
    assert len([w for w in caught if "collapsed" in str(w.message)]) == 1


@pytest.mark.parametrize("change", ["objective", "processes"])
def test_resume_as_another_objective_or_on_other_processes_is_refused(tmp_path, change):
    """Before: a cpo checkpoint resumed as simpo trained on with another loss (same keys, same data), and
    one resumed on another number of processes read its data position in another global batch."""
    out = tmp_path / "run"
    constant = dict(save_steps=2, learning_rate=1e-4, lr_scheduler_type="constant")  # max_steps may grow
    run_training(api_config(out, max_steps=2, **constant), "cpo")
    before = snapshot(out)
    state = out / "checkpoint-2" / "trainer_state.json"
    if change == "processes":  # as if two processes had written it
        data = json.loads(state.read_text())
        data["config"]["fastalign_world_size"] = 2
        state.write_text(json.dumps(data))
        shutil.copy(state.parent / "rng-0.pt", state.parent / "rng-1.pt")  # the second process's
        before = snapshot(out)
    resumed = api_config(out, max_steps=4, resume_from_checkpoint="latest", **constant)
    with pytest.raises(ValueError) as caught:
        run_training(resumed, "simpo" if change == "objective" else "cpo")
    culprit = (
        "another objective ('cpo', this run 'simpo')"
        if change == "objective"
        else "processes (2, this run 1)"
    )
    assert_one_line_error(caught.value, culprit)
    assert snapshot(out) == before


class _GemmDecision(Callback):
    """Records, at each step, whether the process runs bf16 GEMMs as fp32 ones."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, engine, metrics):
        from fastalign.ops import cpu_gemm

        self.seen.append(cpu_gemm.low_precision_gemm_is_slow(torch.bfloat16))


def test_a_resumed_bf16_run_keeps_the_cpu_gemms_it_began_with(tmp_path):
    """Whether bf16 GEMMs on a CPU run natively or as fp32 ones is timed when a run begins; the two round
    differently, so a resumed run (another process, another timing) takes the checkpoint's decision."""
    from fastalign.ops import cpu_gemm

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_training(api_config(out, bf16=True), "sft", callbacks=[Crash(at=3)])
    state = out / "checkpoint-2" / "trainer_state.json"
    data = json.loads(state.read_text())
    measured = data["fp32_gemms"]
    assert measured is cpu_gemm._measured_slow(torch.bfloat16)
    data["fp32_gemms"] = not measured  # as if the run had begun where the timing came out otherwise
    state.write_text(json.dumps(data))
    cpu_gemm._PINNED.clear()  # a new process
    decision = _GemmDecision()
    run_training(api_config(out, bf16=True, resume_from_checkpoint="latest"), "sft", callbacks=[decision])
    assert decision.seen == [not measured, not measured]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["fp32_gemms"] is (
        not measured
    )
    run_training(api_config(tmp_path / "fp32", max_steps=2), "sft")  # fp32: nothing to decide
    assert (
        json.loads((tmp_path / "fp32" / "checkpoint-2" / "trainer_state.json").read_text())["fp32_gemms"]
        is None
    )
