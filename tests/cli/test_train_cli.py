"""``fastalign train <objective>``: config file + overrides reach ``run_training``, errors are one line
and exit 2.

Most tests replace ``fastalign.train.run`` with a fake module, so they check the command, not training; one
slow test does a real tiny run end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from fastalign.cli.main import main
from fastalign.train.config import TrainConfig


@pytest.fixture
def fake_sft(monkeypatch, tmp_path):
    """A stand-in ``fastalign.train.run`` whose ``run_training`` records its configs (and can be made to
    fail); ``objectives`` records what it was asked to train."""
    module = types.ModuleType("fastalign.train.run")
    module.calls, module.objectives = [], []
    module.error = None

    def run_training(config, objective):
        module.calls.append(config)
        module.objectives.append(objective)
        if module.error is not None:
            raise module.error
        return tmp_path / "out"

    module.run_training = run_training
    monkeypatch.setitem(sys.modules, "fastalign.train.run", module)
    return module


def write_config(tmp_path, text="max_steps: 60\nlearning_rate: 3e-3\npacking: true\n"):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def test_config_and_overrides_reach_run_sft(tmp_path, capsys, fake_sft):
    cfg = write_config(tmp_path)
    assert main(["train", "sft", "--config", str(cfg), "--max_steps", "5"]) == 0
    (config,) = fake_sft.calls
    assert isinstance(config, TrainConfig)
    assert config.max_steps == 5  # the flag over the file
    assert (config.learning_rate, config.packing) == (3e-3, True)  # the rest of the file kept
    assert f"saved to {tmp_path / 'out'}" in capsys.readouterr().out


def test_config_equals_form_and_hyphenated_overrides(tmp_path, fake_sft):
    cfg = write_config(tmp_path)
    assert (
        main(
            [
                "train",
                "sft",
                f"--config={cfg}",
                "--max-steps=7",
                "--use-peft",
                "true",
                "--lora-target-modules",
                "q,v",
            ]
        )
        == 0
    )
    (config,) = fake_sft.calls
    assert (config.max_steps, config.lora_target_modules) == (7, ["q", "v"])


def test_no_config_runs_the_built_in_defaults(fake_sft):
    assert main(["train", "sft"]) == 0
    assert fake_sft.calls == [TrainConfig()]


def test_a_bad_key_exits_2_with_one_line_naming_it(tmp_path, capsys, fake_sft):
    cfg = write_config(tmp_path)
    assert main(["train", "sft", "--config", str(cfg), "--learning_rat", "1"]) == 2
    err = one_error_line(capsys)
    assert (
        err == "error: unknown config key 'learning_rat' (on the command line); did you mean 'learning_rate'?"
    )
    assert fake_sft.calls == []  # nothing ran


def test_a_bad_key_in_the_file_names_the_file(tmp_path, capsys, fake_sft):
    cfg = write_config(tmp_path, "max_steps: ten\n")
    assert main(["train", "sft", "--config", str(cfg)]) == 2
    assert (
        one_error_line(capsys)
        == f"error: config key 'max_steps' (in {cfg}) must be an integer, got 'ten' (str)"
    )


def test_a_missing_config_file_exits_2(tmp_path, capsys, fake_sft):
    assert main(["train", "sft", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in one_error_line(capsys)


def test_an_abbreviation_is_not_taken_for_config(capsys, fake_sft):
    """``--c 5`` is an unknown override, not ``--config 5`` (argparse would expand prefixes by default)."""
    assert main(["train", "sft", "--c", "5"]) == 2
    assert one_error_line(capsys).startswith("error: unknown config key 'c' (on the command line)")


def test_a_value_error_from_training_is_one_line(capsys, fake_sft):
    fake_sft.error = ValueError("dataset row 3 is too long:\n  4096 tokens > max_length 512")
    assert main(["train", "sft", "--max_steps", "1"]) == 2
    assert one_error_line(capsys) == "error: dataset row 3 is too long: 4096 tokens > max_length 512"


def test_an_unknown_objective_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "nope"])
    assert exit_.value.code == 2 and "'nope' is not an objective" in capsys.readouterr().err


@pytest.mark.slow
def test_train_sft_from_config_with_overrides(tmp_path, capsys):
    """The real ``run_sft``: a two-step tiny run writes its metrics and model."""
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "max_steps: 3\nper_device_train_batch_size: 4\nlogging_steps: 1\nloss_curve_png: false\n"
    )
    out = tmp_path / "run"
    assert main(["train", "sft", "--config", str(config), "--output_dir", str(out), "--max_steps", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert (out / "model.safetensors").is_file() and "saved to" in capsys.readouterr().out


def test_a_missing_dataset_exits_2_naming_it(tmp_path, capsys):
    """The real ``run_sft``: a bad data path is a ValueError, printed as one line."""
    assert (
        main(
            [
                "train",
                "sft",
                "--dataset_name",
                str(tmp_path / "nope.jsonl"),
                "--output_dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )
    assert "nope.jsonl" in one_error_line(capsys)


def test_python_dash_m_fastalign_is_the_cli():
    """``python -m fastalign`` (and so ``torchrun -m fastalign``) runs the same command line."""
    done = subprocess.run(
        [sys.executable, "-m", "fastalign", "train", "nope"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "'nope' is not an objective" in done.stderr and "sft" in done.stderr
