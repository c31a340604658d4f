"""Short runs through the runner for the objective tests: the rows as a data file, a ``TrainConfig``
with the tests' small defaults (two steps, each logged), and the metrics the run logged."""

from __future__ import annotations

import json
from pathlib import Path

from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

#: What every short run shares unless a test says otherwise.
#: (No max_length: grpo, rloo and ppo refuse it; the others' tests set it where it matters.)
DEFAULTS = dict(max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0, loss_curve_png=False)


def short_config(directory: Path, rows: list[dict], **options) -> TrainConfig:
    """A config training on ``rows`` (written under ``directory``) into ``directory / "run"``."""
    data = directory / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return TrainConfig(
        **{"dataset_name": str(data), "output_dir": str(directory / "run"), **DEFAULTS, **options}
    )


def logged(output_dir: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def train(config: TrainConfig, name: str) -> list[dict]:
    """Run objective ``name`` and return what it logged."""
    run_training(config, name)
    return logged(config.output_dir)
