"""``fastalign train sft``: a real tiny run from a config with overrides, and one-line errors."""

from __future__ import annotations

import json

from fastalign.cli.main import main


def test_train_sft_from_config_with_overrides(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "max_steps: 3\nper_device_train_batch_size: 4\nlogging_steps: 1\nloss_curve_png: false\n"
    )
    out = tmp_path / "run"
    assert main(["train", "sft", "--config", str(config), "--output_dir", str(out), "--max_steps", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert (out / "model.safetensors").is_file() and "saved to" in capsys.readouterr().out


def test_a_bad_key_exits_2_with_one_line(tmp_path, capsys):
    assert main(["train", "sft", "--output_dir", str(tmp_path), "--learning_rat", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown config key 'learning_rat'") and "learning_rate" in err
    assert len(err.splitlines()) == 1


def test_a_missing_dataset_exits_2_naming_it(tmp_path, capsys):
    assert main(["train", "sft", "--dataset_name", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
