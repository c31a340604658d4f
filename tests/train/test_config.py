"""TrainConfig from YAML and flags: TRL names, coercion, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastalign.train.config import ConfigError, TrainConfig, load_config, save_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_tiny.yaml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_file_and_flags_in_that_order(tmp_path):
    assert load_config() == TrainConfig()
    path = write(tmp_path, "learning_rate: 2e-4\nmax_steps: 10\npacking: true\n")
    config = load_config(
        path, ["--max_steps", "20", "--max-length=128", "--lora_target_modules", "q_proj,v_proj"]
    )
    assert config.learning_rate == 2e-4  # YAML 1.1 reads 2e-4 as a string: coerced
    assert (config.max_steps, config.max_length, config.packing) == (20, 128, True)
    assert config.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--bf16", "yes"], "bf16", True),
        (["--bf16", "False"], "bf16", False),
        (["--resume_from_checkpoint", "none"], "resume_from_checkpoint", None),
        (["--resume_from_checkpoint", "latest"], "resume_from_checkpoint", "latest"),
        (["--num_train_epochs", "2"], "num_train_epochs", 2.0),
        (["--save_steps", "1e3"], "save_steps", 1000),
        (["--report_to", "tensorboard"], "report_to", ["tensorboard"]),
    ],
)
def test_flag_values_are_coerced_to_the_field_type(flags, field, value):
    assert getattr(load_config(None, flags), field) == value


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        (
            "learning_rat: 1e-4\n",
            [],
            r"unknown config key 'learning_rat' \(in .*cfg.yaml\); did you mean 'learning_rate'\?",
        ),
        (
            "",
            ["--max_stepz", "3"],
            r"unknown config key 'max_stepz' \(on the command line\); did you mean 'max_steps'",
        ),
        ("max_steps: ten\n", [], r"'max_steps' \(in .*\) must be an integer, got 'ten' \(str\)"),
        ("max_steps: 1.5\n", [], r"'max_steps' .* must be an integer, got 1.5"),
        ("packing: maybe\n", [], r"'packing' .* must be a boolean"),
        ("lora_target_modules: 3\n", [], r"'lora_target_modules' .* must be a list of strings"),
        ("per_device_train_batch_size: 0\n", [], r"'per_device_train_batch_size' must be positive"),
        ("lr_scheduler_type: cosin\n", [], r"'lr_scheduler_type' must be one of"),
        ("warmup_ratio: 1.5\n", [], r"'warmup_ratio' must be in \[0, 1\)"),
        ("report_to: [mlflow]\n", [], r"'report_to' accepts tensorboard and wandb"),
        ("- a\n- b\n", [], r"must be a mapping"),
        ("a: [1\n", [], r"cannot read config .*cfg.yaml"),
        ("", ["--max_steps"], r"--max_steps needs a value"),
    ],
)
def test_bad_configs_fail_in_one_line_naming_the_key(tmp_path, text, flags, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(write(tmp_path, text), flags)
    assert "\n" not in str(error.value)


def test_save_and_load_round_trip_and_the_example_loads(tmp_path):
    config = load_config(EXAMPLE, ["--use_peft", "true", "--lora_target_modules", "q_proj"])
    save_config(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config
    assert config.model_name_or_path == "tiny-llama" and config.max_steps == 60
