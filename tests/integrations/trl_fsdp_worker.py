"""``torchrun`` worker of ``test_trl_fused_head.py``: TRL's fused LM head under FSDP2 in 2 processes (gloo),
sharded as accelerate's FSDP2 plugin shards a causal LM for TRL's trainers (each decoder layer, then the
root, so the head's weight is gathered by the root's forward). On each rank, fastalign's head gives TRL's
loss, log-probs, entropy, mean logit and top-1 flags, and the same gradient of every (sharded) parameter,
for the entropy too (GRPO's entropy bonus); and it is the one that ran."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, before fastalign is imported

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from trl.trainer.utils import add_fused_lm_head

from fastalign.builtin import tiny_model
from fastalign.integrations import trl as integration
from tests.torchrun import finish_worker

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch before 2.6 kept FSDP2 here
    from torch.distributed._composable.fsdp import fully_shard

OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def step(serve: bool, rank: int, mesh) -> tuple[dict, dict]:
    model = tiny_model("llama", seed=0)
    add_fused_lm_head(model, temperature=0.7, outputs=OUTPUTS)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert integration.enable() if serve else integration.disable() is None
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch, as a data-parallel step
    ids = torch.randint(3, 512, (2, 12), generator=generator)
    labels = ids.clone()
    labels[:, :4] = -100
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss + 0.1 * out.entropy.sum()).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    return {field: getattr(out, field).detach() for field in ("loss", *OUTPUTS)}, grads


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    calls = []
    served = integration.token_logprobs
    integration.token_logprobs = lambda *args, **kwargs: calls.append(1) or served(*args, **kwargs)
    theirs, their_grads = step(False, rank, mesh)
    assert not calls
    ours, our_grads = step(True, rank, mesh)
    integration.disable()
    assert calls, "fastalign's head did not run"
    for field, value in theirs.items():
        if value.dtype == torch.bool:
            assert torch.equal(ours[field], value), (rank, field)
        else:
            torch.testing.assert_close(ours[field], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {field}")
    assert our_grads.keys() == their_grads.keys() and len(their_grads) > 10
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")
    finish_worker()
