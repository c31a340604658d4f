"""Worker of the 2-process FSDP2 test (run by ``torchrun``; not a test module itself).

Usage: ``torchrun --standalone --nproc_per_node 2 fsdp_worker.py OUT_JSON TIE_WORD_EMBEDDINGS [OUT_JSON
TIE_WORD_EMBEDDINGS ...]``: one run per pair, one after the other in the same process group.

Each rank trains the same tiny patched Llama, sharded with FSDP2 on gloo, on its half of a fixed
batch whose halves hold different numbers of label tokens, normalising by the global count. Rank 0
writes the global loss of every step and the update of every parameter (final minus initial,
gathered unsharded) to OUT_JSON, for comparison with one process training on the whole batch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch

import fastalign
from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.train.distributed import (
    all_reduce_sum,
    broadcast_object,
    init_distributed,
    shard_model,
    shutdown_distributed,
)
from tests.torchrun import finish_worker

#: The global batch: uneven lengths, so the halves differ in padded length and in label tokens.
TEXTS = [
    "What is 3 plus 5? The answer is 8.",
    "the model learns",
    "please think step by step about the answer to what is 12 times 7 and then the answer is 84",
    "user assistant system",
]
STEPS = 3
LR = 1e-2


def batch_of(texts: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded input ids and mask, labels = ids with -100 at the padding."""
    batch = dict(tiny_tokenizer()(texts, padding=True, return_tensors="pt"))
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def build_model(tie_word_embeddings: bool) -> torch.nn.Module:
    """The model both the workers and the single-process reference train: fp32, fixed seed, patched."""
    return fastalign.patch_model(tiny_model("llama", tie_word_embeddings=tie_word_embeddings))


def main(runs: list[tuple[str, bool]]) -> None:
    ctx = init_distributed()
    assert ctx.world_size == 2 and ctx.device.type == "cpu", ctx
    for out_path, tie_word_embeddings in runs:
        train(ctx, out_path, tie_word_embeddings)
    shutdown_distributed()
    finish_worker()


def train(ctx, out_path: str, tie_word_embeddings: bool) -> None:
    model = build_model(tie_word_embeddings)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    model = shard_model(model, mixed_precision=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    half = len(TEXTS) // ctx.world_size
    batch = batch_of(TEXTS[ctx.rank * half : (ctx.rank + 1) * half])
    local_tokens = int((batch["labels"][:, 1:] != -100).sum())
    num_items = all_reduce_sum(local_tokens, ctx)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch, num_items_in_batch=num_items).loss
        # FSDP averages gradients over ranks: scale so they are those of the global token mean
        (loss * ctx.world_size).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(all_reduce_sum(loss.detach(), ctx)))

    # full_tensor() is a collective: every rank gathers, rank 0 writes
    updates = {
        name: (param.full_tensor() - initial[name]).tolist() for name, param in model.named_parameters()
    }
    result = {
        "losses": losses,
        "updates": updates,
        "local_tokens": [int(count) for count in all_reduce_one_hot(local_tokens, ctx)],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "broadcast": broadcast_object({"from": ctx.rank}, ctx),
    }
    if ctx.is_main:
        with open(out_path, "w") as handle:
            json.dump(result, handle)


def all_reduce_one_hot(value: int, ctx) -> torch.Tensor:
    """Every rank's ``value``, by rank (a sum of one-hot vectors)."""
    slots = torch.zeros(ctx.world_size, dtype=torch.long)
    slots[ctx.rank] = value
    return all_reduce_sum(slots, ctx)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([(out_path, tie == "True") for out_path, tie in zip(args[::2], args[1::2], strict=True)])
