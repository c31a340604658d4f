"""``torchrun`` entry point of the multi-process training tests: one or more runs in one process group.

Usage: ``train_worker.py '[["sft", {config}], ["dpo", {config}], ...]'`` — each pair an objective and a
``TrainConfig`` as JSON, trained one after the other (starting processes once saves most of the time).
"""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch.distributed as dist

from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training
from tests.torchrun import finish_worker

if __name__ == "__main__":
    dist.init_process_group("gloo")  # outlives each run: run_training leaves a group it did not create
    for objective, config in json.loads(sys.argv[1]):
        run_training(TrainConfig(**config), objective)
    finish_worker()
