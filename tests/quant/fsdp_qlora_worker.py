"""Worker of the 2-process QLoRA memory test (run by ``torchrun``; not a test module itself).

Usage: ``torchrun --standalone --nproc_per_node 2 fsdp_qlora_worker.py OUT_JSON``.

Quantizes a tiny Llama to NF4, adds LoRA, shards it with FSDP2 under a bf16 mixed-precision policy and
runs forward+backward, recording on rank 0: the bytes each rank holds of every 4-bit layer while
sharded, and what the layers see inside their forward (dtype and size of the gathered weight), so the
test can prove the weights stay 4-bit through shard and unshard.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import peft
import torch
import torch.distributed as dist

import fastalign
from fastalign.builtin import tiny_model
from fastalign.quant import FourBitLinear, QuantOptions, quantize_model
from fastalign.train.distributed import shard_model
from tests.torchrun import finish_worker


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    model = fastalign.patch_model(tiny_model("llama"))
    quantize_model(model, QuantOptions())
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    layers = [module for module in model.modules() if isinstance(module, FourBitLinear)]
    full_bytes = sum(layer.weight.numel() for layer in layers)  # packed bytes, before sharding
    dense_bytes = sum(layer.in_features * layer.out_features * 4 for layer in layers)
    seen = []
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda module, args: seen.append(
                [
                    str(module.weight.dtype),
                    module.weight.numel(),
                    module.in_features * module.out_features // 2,
                ]
            )
        )
    model = shard_model(model, mixed_precision=True)
    local_bytes = sum(layer.weight.to_local().numel() for layer in layers)
    ids = torch.randint(0, 512, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    lora_grads = [p.grad is not None for n, p in model.named_parameters() if "lora_" in n]
    totals = [torch.tensor(local_bytes)]
    dist.all_reduce(totals[0])
    if dist.get_rank() == 0:
        record = {
            "full_bytes": full_bytes,
            "dense_bytes": dense_bytes,
            "local_bytes": local_bytes,
            "sum_local_bytes": int(totals[0]),
            "seen": seen,
            "loss": float(out.loss),
            "all_lora_grads": all(lora_grads) and bool(lora_grads),
        }
        with open(out_path, "w") as f:
            json.dump(record, f)
    finish_worker()


if __name__ == "__main__":
    main(sys.argv[1])
