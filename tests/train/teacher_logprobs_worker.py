"""Under torchrun: ``fastalign.train.teacher_logprobs.score_teacher`` on a config (JSON) with
``shard_rows``; each rank records how many shards it wrote in ``<output_dir>/ranks.json`` (rank 0
gathers them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from fastalign.train.config import TrainConfig
from fastalign.train.teacher_logprobs import ScoringOptions, score_teacher

config = TrainConfig(**json.loads(sys.argv[1]))
report = score_teacher(config, ScoringOptions(shard_rows=int(sys.argv[2])))
dist.init_process_group("gloo")
written = [None, None]
dist.all_gather_object(written, report.shards_written)
if dist.get_rank() == 0:
    Path(config.output_dir, "ranks.json").write_text(json.dumps(dict(enumerate(written))))
dist.destroy_process_group()
