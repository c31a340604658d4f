"""``fastalign train sft``: supervised fine-tuning (the SFT recipe of ``fastalign.train.run``)."""

from __future__ import annotations

from pathlib import Path

from fastalign.train.config import TrainConfig
from fastalign.train.engine import Callback
from fastalign.train.run import run_training


def run_sft(config: TrainConfig, callbacks: list[Callback] | None = None) -> Path:
    """Train, save the final model (or adapter) in ``config.output_dir``, and return that path."""
    return run_training(config, "sft", callbacks)
