"""``torchrun`` entry point of the multi-process SFT test: run_sft with the config given as JSON."""

import json
import sys

from fastalign.train.config import TrainConfig
from fastalign.train.sft import run_sft

if __name__ == "__main__":
    run_sft(TrainConfig(**json.loads(sys.argv[1])))
