"""transformers' training-loop options: when a run logs, evaluates and saves (strategies, step counts and
ratios, eval_on_start), save_total_limit, load_best_model_at_end, and fp16 with its gradient scaler.

Where transformers decides the same thing, it is the oracle: its ``DefaultFlowCallback`` (when to
evaluate and save), ``rotate_checkpoints`` (which checkpoints stay) and ``TrainingArguments`` (which
combinations are refused) are run beside fastalign's."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback
from transformers.trainer_utils import rotate_checkpoints

from fastalign.train.checkpoint import _beyond_limit, list_checkpoints, read_trainer_state
from fastalign.train.config import ConfigError, TrainConfig, check_config
from fastalign.train.engine import Schedule
from fastalign.train.sft import run_sft
from tests.train.test_engine import _Crash, config, logged, sft_in_two_processes, train_losses


def _transformers_args(tmp_path, **options) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], **options)


# --- when a run evaluates and saves ----------------------------------------------------------------


def _transformers_flow(args: TrainingArguments, max_steps: int, steps_per_epoch: int) -> dict[str, list]:
    """The steps at which transformers' trainer evaluates and saves: ``DefaultFlowCallback`` after each
    step, and at each epoch's end (also when the run stops mid-epoch, as ``_run_epoch`` does)."""
    callback, state = DefaultFlowCallback(), TrainerState()
    state.compute_steps(args, max_steps)
    state.max_steps = max_steps
    acted: dict[str, list] = {"eval": [], "save": []}
    for step in range(1, max_steps + 1):
        state.global_step, control = step, TrainerControl()
        callback.on_step_end(args, state, control)
        if step % steps_per_epoch == 0 or step == max_steps:
            callback.on_epoch_end(args, state, control)
        if control.should_evaluate:
            acted["eval"].append(step)
        if control.should_save:
            acted["save"].append(step)
    return acted


def _fastalign_flow(cfg: TrainConfig, max_steps: int, steps_per_epoch: int) -> dict[str, list]:
    schedule = Schedule.from_config(cfg, max_steps)
    return {
        kind: [
            step
            for step in range(1, max_steps + 1)
            if schedule.due(kind, step, step % steps_per_epoch == 0, step == max_steps)
        ]
        for kind in ("eval", "save")
    }


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"save_steps": 3},
        {"save_steps": 0.25},  # a ratio of the run's steps, rounded up
        {"save_strategy": "epoch"},
        {"save_strategy": "no"},
        {"eval_strategy": "steps"},  # eval_steps None: logging_steps
        {"eval_strategy": "steps", "eval_steps": 4},
        {"eval_strategy": "steps", "eval_steps": 0.3, "logging_steps": 2},
        {"eval_strategy": "epoch", "save_strategy": "epoch"},
    ],
    ids=repr,
)
@pytest.mark.parametrize(("max_steps", "steps_per_epoch"), [(10, 4), (12, 3)])
def test_evaluations_and_saves_fall_on_transformers_steps(tmp_path, options, max_steps, steps_per_epoch):
    options = {"logging_steps": 2, **options}
    data = {"eval_split_ratio": 0.1} if options.get("eval_strategy", "no") != "no" else {}
    cfg = TrainConfig(**options, **data)
    check_config(cfg)
    expected = _transformers_flow(_transformers_args(tmp_path, **options), max_steps, steps_per_epoch)
    assert _fastalign_flow(cfg, max_steps, steps_per_epoch) == expected


def test_schedule_resolves_ratios_and_the_best_metric():
    schedule = Schedule.from_config(
        TrainConfig(logging_steps=0.15, eval_strategy="steps", eval_split_ratio=0.1, save_steps=0.5), 10
    )
    assert (schedule.logging_steps, schedule.eval_steps, schedule.save_steps) == (2, 2, 5)
    assert schedule.best_metric is None  # no load_best_model_at_end: nothing compared
    best = dict(eval_strategy="steps", eval_split_ratio=0.1, load_best_model_at_end=True)
    for metric, key, greater in [
        (None, "eval_loss", False),
        ("rewards/accuracies", "eval_rewards/accuracies", True),
        ("eval_rewards/margins", "eval_rewards/margins", True),
        ("eval_nll_loss", "eval_nll_loss", False),
    ]:
        schedule = Schedule.from_config(TrainConfig(**best, metric_for_best_model=metric), 10)
        assert (schedule.best_metric, schedule.greater_is_better) == (key, greater)
    flipped = Schedule.from_config(TrainConfig(**best, greater_is_better=True), 10)
    assert flipped.greater_is_better


# --- what the config refuses --------------------------------------------------------------------------

EVAL = {"eval_split_ratio": 0.1}


BEST = {"eval_strategy": "steps", "load_best_model_at_end": True}


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"fp16": True, "bf16": True}, "fp16"),
        ({**BEST, "save_strategy": "epoch"}, "load_best_model_at_end"),
        ({**BEST, "eval_steps": 3, "save_steps": 10}, "load_best_model_at_end"),
        ({**BEST, "eval_steps": 0.1, "save_steps": 10}, "load_best_model_at_end"),  # a ratio and a count
        ({**BEST, "eval_steps": 0.2, "save_steps": 0.3}, "load_best_model_at_end"),
    ],
    ids=repr,
)
def test_combinations_transformers_refuses_are_config_errors(tmp_path, options, key):
    with pytest.raises(ValueError):
        _transformers_args(tmp_path, **options)
    with pytest.raises(ConfigError, match=rf"^config key '{key}' ") as caught:
        check_config(TrainConfig(**options, **EVAL))
    assert "\n" not in str(caught.value)


def test_combinations_transformers_accepts_pass(tmp_path):
    for options in (
        {"eval_strategy": "steps", "eval_steps": 5, "save_steps": 10, "load_best_model_at_end": True},
        {"eval_strategy": "steps", "eval_steps": 0.1, "save_steps": 0.3, "load_best_model_at_end": True},
        {"eval_strategy": "epoch", "save_strategy": "epoch", "load_best_model_at_end": True},
    ):
        _transformers_args(tmp_path, **options)
        check_config(TrainConfig(**options, **EVAL))


@pytest.mark.parametrize(
    ("options", "key", "says"),
    [
        ({"eval_steps": 0}, "eval_steps", "set eval_strategy no"),  # fastalign's old "no evaluation"
        ({"save_steps": 0}, "save_steps", "set save_strategy no"),  # fastalign's old "only the final model"
        ({"save_steps": 2.5}, "save_steps", "whole number of steps"),
        ({"eval_strategy": "sometimes"}, "eval_strategy", "one of no, steps, epoch"),
        ({"save_total_limit": 0}, "save_total_limit", "at least 1, or null"),
        ({"eval_strategy": "steps"}, "eval_strategy", "needs held-out data"),
        ({"eval_on_start": True}, "eval_on_start", "needs held-out data"),
        (EVAL, "eval_split_ratio", "eval_strategy is 'no'"),
        ({"eval_steps": 5}, "eval_steps", "only with eval_strategy steps"),
        ({"save_strategy": "epoch", "save_steps": 5}, "save_steps", "only with save_strategy steps"),
        ({"logging_strategy": "no", "logging_steps": 5}, "logging_steps", "only with logging_strategy steps"),
        ({"metric_for_best_model": "loss"}, "metric_for_best_model", "only with load_best_model_at_end"),
        ({"greater_is_better": True}, "greater_is_better", "only with load_best_model_at_end"),
        ({**EVAL, "load_best_model_at_end": True}, "load_best_model_at_end", "needs evaluations"),
        (
            {**EVAL, "eval_strategy": "epoch", "load_best_model_at_end": True},
            "load_best_model_at_end",
            r"save_strategy \('steps'\) to match eval_strategy \('epoch'\)",
        ),
    ],
    ids=repr,
)
def test_settings_that_cannot_work_or_would_be_ignored_are_errors(options, key, says):
    with pytest.raises(ConfigError, match=rf"^config key '{key}'.*{says}"):
        check_config(TrainConfig(**options))


def test_logging_steps_are_read_by_eval_steps_left_unset():
    check_config(TrainConfig(**EVAL, logging_strategy="epoch", logging_steps=5, eval_strategy="steps"))


# --- which checkpoints stay ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "limit", "best"),
    [(5, 2, None), (5, 2, 2), (5, 3, 1), (5, 1, 3), (6, 4, 5), (5, None, 2), (3, 5, None), (4, 2, 4)],
)
def test_save_total_limit_keeps_what_transformers_keeps(tmp_path, saved, limit, best):
    """During a run; transformers sorts its checkpoints by mtime, which these share: by step then."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for root in (ours, theirs):
        for step in range(1, saved + 1):
            (root / f"checkpoint-{step}").mkdir(parents=True)
    best_path = None if best is None else f"checkpoint-{best}"
    rotate_checkpoints(str(theirs), limit, best_model_checkpoint=best_path and str(theirs / best_path))
    doomed = _beyond_limit(list_checkpoints(ours), limit, best_path and ours / best_path, step=saved)
    kept = [path.name for path in list_checkpoints(ours) if path not in doomed]
    assert kept == [path.name for path in list_checkpoints(theirs)]


def test_at_the_end_one_checkpoint_left_is_the_best():
    checkpoints = [Path(f"checkpoint-{step}") for step in (2, 4)]
    assert _beyond_limit(checkpoints, 1, Path("checkpoint-2")) == [Path("checkpoint-4")]
    assert _beyond_limit(checkpoints, 1, None) == [Path("checkpoint-2")]


# --- end to end on the tiny model ---------------------------------------------------------------------


def test_default_saves_at_the_last_step_and_keeps_every_checkpoint(tmp_path):
    out = run_sft(config(tmp_path / "a", max_steps=3))
    assert [path.name for path in list_checkpoints(out)] == ["checkpoint-3"]  # save_steps 500
    out = run_sft(config(tmp_path / "b", max_steps=3, save_steps=1))
    assert [path.name for path in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    out = run_sft(config(tmp_path / "c", max_steps=3, save_strategy="no"))
    assert list_checkpoints(out) == [] and (out / "model.safetensors").is_file()


def test_epoch_strategies_act_at_each_epoch_end(tmp_path):
    """16 rows, 4 per step: 4 steps an epoch; 2.5 epochs end at step 10, mid-epoch (where they act too),
    and eval_on_start evaluates the untrained model first."""
    cfg = config(
        tmp_path,
        dataset_name=str(_rows(tmp_path, 20)),  # 16 train, 4 held out
        max_steps=-1,
        num_train_epochs=2.5,
        eval_split_ratio=0.2,
        logging_strategy="epoch",
        logging_steps=10,  # the default's value: not read under epoch, so not refused
        eval_strategy="epoch",
        save_strategy="epoch",
        eval_on_start=True,
    )
    out = run_sft(cfg)
    rows = logged(out)
    assert [row["step"] for row in rows if "eval_loss" in row] == [0, 4, 8, 10]
    assert [row["step"] for row in rows if "loss" in row] == [4, 8, 10]
    assert [row["epoch"] for row in rows if "loss" in row] == [1.0, 2.0, 2.5]
    assert [path.name for path in list_checkpoints(out)] == ["checkpoint-4", "checkpoint-8", "checkpoint-10"]


def _rows(tmp_path: Path, count: int) -> Path:
    from tests.train.test_engine import write_rows

    return write_rows(tmp_path / f"rows{count}.jsonl", count=count)


def _weights(output_dir: Path) -> dict[str, torch.Tensor]:
    name = (
        "adapter_model.safetensors" if (output_dir / "adapter_config.json").is_file() else "model.safetensors"
    )
    return load_file(output_dir / name)


@pytest.mark.parametrize(
    "use_peft", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"]
)
def test_the_exported_model_is_the_best_checkpoints(tmp_path, use_peft):
    """``greater_is_better`` on the eval loss makes the worst evaluation the best: the first (the loss
    falls). With a constant learning rate, a run that stops there exports the same weights; only that
    checkpoint stays (save_total_limit 1), and a resume keeps the best it had found."""
    common = dict(
        eval_split_ratio=0.25,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        lr_scheduler_type="constant",
        **(dict(use_peft=True, lora_r=4, lora_dropout=0.0) if use_peft else {}),
    )
    best = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    stopped = run_sft(config(tmp_path / "stopped", max_steps=2, **common))
    out = run_sft(config(tmp_path / "best", max_steps=6, save_total_limit=1, **common, **best))
    evaluations = [row["eval_loss"] for row in logged(out) if "eval_loss" in row]
    assert len(evaluations) == 3 and evaluations[0] > max(evaluations[1:])  # the last weights differ
    assert [path.name for path in list_checkpoints(out)] == ["checkpoint-2"]
    state = read_trainer_state(out / "checkpoint-2")
    assert (state["best_step"], state["best_metric"]) == (2, evaluations[0])
    expected, got = _weights(stopped), _weights(out)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=name)

    crashed = config(tmp_path / "resumed", max_steps=6, save_total_limit=2, **common, **best)
    with pytest.raises(KeyboardInterrupt):
        run_sft(crashed, callbacks=[_Crash(at=5)])
    resumed = run_sft(dataclasses.replace(crashed, resume_from_checkpoint="latest"))
    assert [path.name for path in list_checkpoints(resumed)] == ["checkpoint-2", "checkpoint-6"]
    for name, tensor in expected.items():
        torch.testing.assert_close(_weights(resumed)[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_an_unknown_metric_for_best_model_names_the_evaluations_metrics(tmp_path):
    cfg = config(
        tmp_path,
        eval_split_ratio=0.25,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
    )
    with pytest.raises(ConfigError, match=r"'eval_accuracy' is not an evaluation metric.*: eval_loss"):
        run_sft(cfg)


# --- fp16 ---------------------------------------------------------------------------------------------


def test_fp16_scales_the_loss_skips_overflowing_steps_and_resumes_exactly(tmp_path):
    """CPU autocast to float16 with torch's GradScaler (as transformers on CUDA). The first step's scaled
    gradients overflow fp16 (scale 2**16): that step is skipped — no optimizer or scheduler step — and the
    scale halves. The scaler's state is in each checkpoint: a killed run resumes with the same losses."""
    options = dict(max_steps=6, save_steps=2, fp16=True, lr_scheduler_type="linear")
    reference = run_sft(config(tmp_path / "a", **options))
    rows = [row for row in logged(reference) if "loss" in row]
    # the skipped step's gradient norm is not finite: null in metrics.jsonl (JSON has no inf)
    assert rows[0]["grad_norm"] is None and all(math.isfinite(r["grad_norm"]) for r in rows[1:])
    assert rows[1]["learning_rate"] == rows[0]["learning_rate"] > rows[2]["learning_rate"]
    scaler = read_trainer_state(reference / "checkpoint-2")["scaler"]
    assert scaler["scale"] == 2.0**15 and scaler["_growth_tracker"] == 1
    fp32 = train_losses(run_sft(config(tmp_path / "fp32", **{**options, "fp16": False})))
    assert train_losses(reference)[1] != fp32[1]  # the matmuls ran in fp16
    assert train_losses(reference)[1] == pytest.approx(fp32[1], rel=1e-2)

    cfg = config(tmp_path / "b", **options)
    with pytest.raises(KeyboardInterrupt):
        run_sft(cfg, callbacks=[_Crash(at=5)])
    resumed = run_sft(dataclasses.replace(cfg, resume_from_checkpoint="latest"))
    expected, got = train_losses(reference), train_losses(resumed)
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, expected, got)
    final = json.loads((resumed / "checkpoint-6" / "trainer_state.json").read_text())["scaler"]
    assert final == read_trainer_state(reference / "checkpoint-6")["scaler"]


@pytest.mark.slow
def test_two_processes_export_the_best_checkpoints_weights(tmp_path):
    """Under FSDP2 (torchrun × 2, 2 examples per rank) every rank loads its shards of the best checkpoint
    before the export gathers them: the weights a one-process run of 2 steps (4 examples) exports."""
    common = dict(
        eval_split_ratio=0.25, eval_strategy="steps", eval_steps=2, save_steps=2, lr_scheduler_type="constant"
    )
    stopped = run_sft(config(tmp_path / "one", max_steps=2, **common))
    cfg = config(
        tmp_path / "two",
        max_steps=4,
        per_device_train_batch_size=2,
        load_best_model_at_end=True,
        greater_is_better=True,
        **common,
    )
    sft_in_two_processes(cfg)
    assert [path.name for path in list_checkpoints(cfg.output_dir)] == ["checkpoint-2", "checkpoint-4"]
    # The two runs sum the same gradients in another order (per-rank means, then an all-reduce; the
    # GEMMs' sizes, so their kernels, differ too): a gradient element differs by fp32 rounding of the
    # sum of its terms' magnitudes, which is no bound relative to the element where its terms cancel.
    # AdamW divides each element by its own running magnitude (a weight moves about lr a step whatever
    # its gradient's scale), so a relative difference r in a gradient moves the weight by up to r·lr:
    # ulps of the weights bound nothing (3.3e-6 after two steps on an AVX-512/AMX CPU). 0.1·lr needs a
    # gradient that cancels to ~1e-6 of its terms; the bugs guarded (another checkpoint's weights, a
    # shard not loaded or misplaced) move weights by a whole step (~lr) or by their own scale.
    atol = 0.1 * cfg.learning_rate
    for name, tensor in _weights(stopped).items():
        torch.testing.assert_close(_weights(Path(cfg.output_dir))[name], tensor, rtol=0, atol=atol, msg=name)
