"""``torchrun`` worker of ``test_generation.py``: the engine under FSDP2 in 2 processes (gloo), rank 0's
rows ending within 2 steps and rank 1's running to the limit. Both ranks finish, each rank's tokens equal
its rows sampled alone without FSDP, and both ran the same number of forwards (FSDP's all-gathers are
collective: a rank that stopped early would leave the other waiting)."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch

from fastalign.builtin import tiny_model
from fastalign.sampling.generation import sample_groups
from fastalign.train.distributed import init_distributed, shard_model
from tests.torchrun import finish_worker

if __name__ == "__main__":
    ctx = init_distributed()
    steps = int(sys.argv[1])
    model = tiny_model("llama", seed=8).eval()
    gen = torch.Generator().manual_seed(ctx.rank)
    ids = torch.randint(3, 512, (1, 5), generator=gen)  # one prompt: its 2 greedy rows end together
    mask = torch.ones_like(ids)
    free = dict(do_sample=False, max_new_tokens=steps, eos_token_id=511)
    with torch.no_grad():
        greedy = sample_groups(model, ids, mask, 2, free)
    # rank 0: its second greedy token is the EOS (ends at step 2); rank 1: an id greedy never emits
    eos = torch.tensor([int(greedy[0, 6]) if ctx.rank == 0 else 511])
    options = dict(do_sample=False, max_new_tokens=steps, eos_token_id=int(eos), pad_token_id=0)
    with torch.no_grad():
        alone = sample_groups(model, ids, mask, 2, options)
    forwards = []
    shard_model(model, mixed_precision=False)
    model.register_forward_hook(lambda *args: forwards.append(1))
    with torch.no_grad():
        synced = sample_groups(model, ids, mask, 2, options, synced=True)
    assert torch.equal(synced, alone), (ctx.rank, synced, alone)  # rank 0's ids end where its rows do
    counts = [torch.zeros(1) for _ in range(2)]
    torch.distributed.all_gather(counts, torch.tensor([float(len(forwards))]))
    assert counts[0] == counts[1] == steps, counts  # a prefill + steps - 1 decode forwards on both ranks
    assert alone.shape[1] == (7 if ctx.rank == 0 else 5 + steps), alone.shape
    finish_worker()
