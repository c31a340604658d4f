"""Under torchrun: a training run in which rank 1 alone raises at step 1 (a user's callback; as an
out-of-memory error on one card would). The job must end with that rank's error, not hang."""

from __future__ import annotations

import sys

import torch.distributed as dist

from fastalign.train.config import TrainConfig
from fastalign.train.engine import Callback
from fastalign.train.run import run_training


class FailOnRankOne(Callback):
    def on_step_end(self, engine, metrics):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 alone failed at step 1")


if __name__ == "__main__":
    config = TrainConfig(
        output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=2, max_length=32, logging_steps=1,
        loss_curve_png=False, save_strategy="no",
    )  # fmt: skip
    run_training(config, "sft", callbacks=[FailOnRankOne()])
