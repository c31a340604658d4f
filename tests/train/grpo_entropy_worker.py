"""``torchrun`` worker of ``test_grpo_entropy_mask``: ``all_gather_values`` and the entropy mask of GRPO's
``top_entropy_quantile`` across 2 processes (gloo), each holding a different number of completion tokens
(and rank 1 none at all), against TRL's own ``get_high_entropy_mask`` with accelerate's collectives."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch

from fastalign.ops.grpo import high_entropy_mask
from fastalign.train.distributed import init_distributed
from fastalign.train.objectives.grpo import all_gather_values
from tests.torchrun import finish_worker


def local_batch(rank: int, empty_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    entropy = (torch.rand(3, 5 + 2 * rank, generator=gen) * 12).round() / 4 + rank  # ties across ranks too
    mask = torch.rand(entropy.shape, generator=gen) > 0.4
    return entropy, mask & (rank != empty_rank)  # empty_rank: a micro-batch without a completion token


if __name__ == "__main__":
    ctx = init_distributed()
    from accelerate import Accelerator
    from trl import GRPOTrainer

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == ctx.world_size == 2
    trainer = type("Trainer", (), {"accelerator": accelerator})()
    for empty_rank in (None, 1):
        entropy, mask = local_batch(ctx.rank, empty_rank)
        everyone = [local_batch(rank, empty_rank) for rank in range(ctx.world_size)]
        gathered = all_gather_values(entropy[mask], ctx)
        assert torch.equal(gathered, torch.cat([e[m] for e, m in everyone])), gathered
        for quantile in (1.0, 0.8, 0.2, 0.0):
            ours = high_entropy_mask(entropy, mask, quantile, lambda values: all_gather_values(values, ctx))
            theirs = GRPOTrainer.get_high_entropy_mask(trainer, entropy, mask.long(), 1 - quantile)
            assert torch.equal(ours, theirs), (ctx.rank, quantile, ours, theirs)
            if ctx.rank == 0 and empty_rank is None and quantile == 0.2:  # the other's tokens count
                assert not torch.equal(high_entropy_mask(entropy, mask, quantile), ours)
    finish_worker()
