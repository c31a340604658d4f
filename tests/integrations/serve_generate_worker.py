"""``torchrun`` worker of ``test_generate.py``: a served ``generate`` in 2 processes (gloo), rank 0's rows
ending within 2 steps and rank 1's running to the limit.

- Under FSDP2 the engine decodes synced: each rank's ids equal its own ``generate``'s on the unsharded
  model, and both ranks run the same forwards (a rank that stopped early would leave the other waiting).
- Where one rank's call is not the engine's (here rank 0 passes a logits processor), every rank's goes
  to the model's own ``generate``, which syncs itself: the ranks still pair up.
- An unsharded model is decoded by each rank alone: rank 0 stops after its 2 steps, and a rank may call
  ``generate`` more often than another (no collective pairs up with nothing)."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import copy

import torch
from transformers import LogitsProcessorList

from fastalign.builtin import tiny_model
from fastalign.integrations import generate as served
from fastalign.integrations.generate import serve_generate
from fastalign.train.distributed import init_distributed, shard_model
from tests.torchrun import finish_worker


def forwards_of_each_rank(count: int) -> list[int]:
    counts = [torch.zeros(1) for _ in range(2)]
    torch.distributed.all_gather(counts, torch.tensor([float(count)]))
    return [int(c) for c in counts]


if __name__ == "__main__":
    ctx = init_distributed()
    steps = int(sys.argv[1])
    model = tiny_model("llama", seed=8).eval()
    gen = torch.Generator().manual_seed(ctx.rank)
    prompts = torch.randint(3, 512, (1 + ctx.rank, 5), generator=gen)
    ids = prompts.repeat_interleave(2, 0)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    free = model.generate(**inputs, do_sample=False, max_new_tokens=steps, eos_token_id=511, pad_token_id=0)
    # rank 0: its second greedy token is the EOS (ends at step 2); rank 1: an id greedy never emits
    eos = int(free[0, 6]) if ctx.rank == 0 else 511
    options = dict(do_sample=False, max_new_tokens=steps, eos_token_id=eos, pad_token_id=0)
    expected = model.generate(**inputs, **options)
    assert expected.shape[1] == (7 if ctx.rank == 0 else 5 + steps), expected.shape
    unsharded = serve_generate(copy.deepcopy(model))

    calls, forwards = [], []
    sample = served.sample_groups
    served.sample_groups = lambda *args, **kwargs: calls.append(kwargs["synced"]) or sample(*args, **kwargs)
    shard_model(model, mixed_precision=False)
    serve_generate(model)
    model.register_forward_hook(lambda *args: forwards.append(1))

    ours = model.generate(**inputs, **options)
    assert torch.equal(ours, expected), (ctx.rank, ours, expected)
    assert calls == [True], calls
    assert forwards_of_each_rank(len(forwards)) == [steps, steps]  # a prefill + steps - 1 decode forwards

    calls.clear(), forwards.clear()
    refused = {"logits_processor": LogitsProcessorList([lambda ids, scores: scores])} if ctx.rank == 0 else {}
    theirs = model.generate(**inputs, **options, **refused)
    assert torch.equal(theirs, expected), (ctx.rank, theirs, expected)
    assert calls == [], calls  # neither rank's call went to the engine
    counts = forwards_of_each_rank(len(forwards))
    assert counts[0] == counts[1] >= steps, counts

    calls.clear()
    unsharded.register_forward_hook(lambda *args: forwards.append(1))
    forwards.clear()
    assert torch.equal(unsharded.generate(**inputs, **options), expected)
    assert calls == [False], calls
    assert forwards_of_each_rank(len(forwards)) == [2, steps]
    if ctx.rank == 0:  # a call rank 1 does not make: it waits in the barrier meanwhile
        assert torch.equal(unsharded.generate(**inputs, **options), expected)
    finish_worker()
