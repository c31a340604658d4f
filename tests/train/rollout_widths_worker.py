"""``torchrun`` worker of ``test_generation.py``: the rollout under FSDP2 in 2 processes (gloo) with a
logits processor that reads the prompts' padding (no-repeat n-grams, a repetition penalty), so that the
engine samples each width of micro-batch in a call of its own, and the ranks' micro-batches of other
widths (rank 0: 5 only, rank 1: 5 and 7). Both ranks finish (the calls' collectives pair up; they used to
wait on each other until the timeout), each micro-batch's completions equal those of it sampled alone
without FSDP, and both ranks ran the same number of forwards."""

import datetime
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch
import torch.distributed as dist

from fastalign.builtin import tiny_model
from fastalign.train.distributed import DistributedContext, init_distributed, shard_model
from fastalign.train.rollout import SamplingOptions, generate_completions
from tests.torchrun import finish_worker


def micro_batch(lengths: list[int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, 512, (length,), generator=gen)
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask}


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a deadlock fails soon
    ctx = init_distributed()
    model = tiny_model("llama", seed=7).eval()
    shapes = [[5, 3], [4, 5]] if ctx.rank == 0 else [[5, 5], [7, 6]]  # rank 0: one width, rank 1: two
    batches = [micro_batch(lengths, seed=10 * ctx.rank + index) for index, lengths in enumerate(shapes)]
    seeds = [1 + ctx.rank, 3 + ctx.rank]
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": 0})()
    kwargs = {"no_repeat_ngram_size": 2}
    options = SamplingOptions(2, 6, repetition_penalty=1.2, generation_kwargs=kwargs)
    alone_ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    alone = [
        generate_completions(model, [batch], options, tokenizer, alone_ctx, seeds=[seed])[0]
        for batch, seed in zip(batches, seeds, strict=True)
    ]
    forwards = []
    shard_model(model, mixed_precision=False)
    model.register_forward_hook(lambda *args: forwards.append(1))
    synced = generate_completions(model, batches, options, tokenizer, ctx, seeds=seeds)
    for ours, expected in zip(synced, alone, strict=True):
        assert torch.equal(ours.completion_ids, expected.completion_ids), (ctx.rank, ours, expected)
        assert torch.equal(ours.truncated, expected.truncated), (ctx.rank, ours, expected)
    counts = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(counts, torch.tensor([float(len(forwards))]))
    assert counts[0] == counts[1], counts
    finish_worker()
