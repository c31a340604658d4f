"""Worker of the 2-process real-model loading test (run by ``torchrun``; not a test module itself).

Usage: ``torchrun --standalone --nproc_per_node 2 fsdp_load_worker.py MODEL_DIR OUT_DIR``.

Each rank loads the checkpoint as the trainer does under FSDP2 (meta skeleton, sharded, each rank
filling only its shard), then the full weights are gathered and the model exported as a run's final
model is. Rank 0 writes what it found to OUT_DIR/result.json and the export to OUT_DIR/export.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from fastalign.train.config import TrainConfig
from fastalign.train.distributed import init_distributed, shutdown_distributed
from fastalign.train.export import export_model
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.policy import prepare_policy
from tests.torchrun import finish_worker


def main(model_dir: str, out_dir: str) -> None:
    ctx = init_distributed()
    assert ctx.world_size == 2 and ctx.device.type == "cpu", ctx
    model, tokenizer = load_model_and_tokenizer(model_dir, materialize=False)
    model = prepare_policy(model, TrainConfig(model_name_or_path=model_dir), ctx, needs_fused_head=True)
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    local_rows = head.to_local().shape[0] if isinstance(head, DTensor) else None
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    export_model(model, tokenizer, Path(out_dir) / "export", ctx)
    if ctx.is_main:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        result = {
            "tied": head is embedding,
            "sharded": isinstance(head, DTensor),
            "local_rows": local_rows,
            "keys_match": sorted(set(full) - {"lm_head.weight"})
            == sorted(set(reference) - {"lm_head.weight"}),
            "mismatched": [name for name, tensor in reference.items() if not torch.equal(full[name], tensor)],
        }
        (Path(out_dir) / "result.json").write_text(json.dumps(result))
    shutdown_distributed()
    finish_worker()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
