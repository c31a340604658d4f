"""Under torchrun: ``fastalign.train.teacher_logprobs.score_teacher`` on a config (JSON) with
``shard_rows`` and ``tail_samples``; each rank records how many shards it wrote in
``<output_dir>/rank<r>.json``. (No process group of its own after scoring: a second rendezvous on the
port the first one just closed failed now and then on a loaded machine.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from fastalign.train.config import TrainConfig
from fastalign.train.teacher_logprobs import ScoringOptions, score_teacher

config = TrainConfig(**json.loads(sys.argv[1]))
report = score_teacher(config, ScoringOptions(shard_rows=int(sys.argv[2]), tail_samples=int(sys.argv[3])))
Path(config.output_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(report.shards_written))
