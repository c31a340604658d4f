"""Process groups, FSDP2 sharding and global sums for data-parallel training under ``torchrun``.

Sharding (``shard_model``) is FSDP2 ``fully_shard`` applied to each decoder layer, then to the root model:

* One unit per layer lets FSDP all-gather layer i+1's parameters while layer i computes (and reshard
  it afterwards), so at most a couple of layers are unsharded at a time and communication overlaps
  compute in both forward and backward.
* Everything outside the layers — embeddings, final norm and the loss head ``lm_head`` (or a reward
  model's ``score`` head) — belongs to the root unit, which is unsharded for the whole root forward.
  fastalign's patched forward computes the fused linear cross-entropy *inside* that forward, so it sees
  the full ``lm_head.weight``; the score head likewise scores the last hidden states there. With tied
  embeddings ``lm_head.weight`` *is* ``embed_tokens.weight``: one Parameter in one unit, so it is
  gathered once and its two gradient contributions are summed before the reduce-scatter.
* Mixed precision computes in bf16 but reduces gradients in fp32: summing many ranks' bf16 gradients
  (8 mantissa bits) loses small contributions, and the fp32 reduce costs only one collective's bandwidth.

Gradients are averaged over ranks by FSDP, so an exact global token mean needs each rank's loss to be its
token sum divided by the *global* token count (``all_reduce_sum`` of the local counts), times
``world_size`` before ``backward``.

Without CUDA the group uses gloo on CPU, so multi-process behaviour is testable on any machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from fastalign.models.structure import decoder_layers

#: Whether ``init_distributed`` created the default process group (so ``shutdown_distributed`` may end it).
_created_group = False


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its rank among ``world_size`` and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs and writes files."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """More than one process: collectives and sharding are needed."""
        return self.world_size > 1

    @property
    def local_world_size(self) -> int:
        """The run's processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 alone): they share its
        host memory."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.enabled else 1


def _default_device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed() -> DistributedContext:
    """The context of this process; under ``torchrun`` with several processes, also the process group.

    nccl on CUDA (one GPU per local rank), gloo on CPU. An already initialised group is reused.
    """
    global _created_group
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world_size <= 1:
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=_default_device(0))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = _default_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        _created_group = True
    return DistributedContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device
    )


def shutdown_distributed(failed: bool = False) -> None:
    """Destroy the process group ``init_distributed`` created, once every rank has got here; a rank that
    ``failed`` (an error on it alone, say) leaves at once instead: the others wait in a collective it will
    never join, and only its exit lets torchrun stop them (a barrier here hung both until gloo's 30-minute
    timeout, the error unsaid)."""
    global _created_group
    if _created_group and dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()
    _created_group = False


def _torch_before(major: int, minor: int) -> bool:
    found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return found < (major, minor)


def shard_model(model: nn.Module, *, mixed_precision: bool, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2 over all ranks (each decoder layer, then the root); returns it.

    A no-op without a process group of more than one rank. ``mixed_precision``: bf16 parameters in
    forward/backward, fp32 gradient reduction (the sharded parameters stay in their own dtype).
    ``reshard_after_forward=False`` keeps layers unsharded between forward and backward: fewer
    all-gathers, more memory.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return model
    if _torch_before(2, 13) and any(not p.is_floating_point() for p in model.parameters()):
        # torch 2.11's FSDPParam wraps every shard in nn.Parameter(requires_grad=True) before it copies
        # the flag over, which an integer tensor refuses deep inside fully_shard (found on torch 2.11;
        # 2.13 is the next version tested)
        raise RuntimeError(
            f"sharding 4-bit (integer) weights with FSDP2 needs torch >= 2.13 (this is {torch.__version__}): "
            "upgrade torch, or train QLoRA on one process"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    options: dict[str, Any] = {
        "mesh": init_device_mesh(device_type, (dist.get_world_size(),)),
        "reshard_after_forward": reshard_after_forward,
    }
    if mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    if hasattr(model, "generate"):
        # generate() (GRPO's rollout) may reach the inner model without the root's forward, e.g. through
        # peft's wrapper: this makes it run the root's unshard/reshard around the whole call
        register_fsdp_forward_method(model, "generate")
    return model


def all_reduce_sum(value: torch.Tensor | int | float, ctx: DistributedContext) -> torch.Tensor:
    """The sum of ``value`` over all ranks, as a tensor on ``ctx.device`` (``value`` is left untouched).

    Used for global counts (loss tokens of an accumulated batch) and for logging global loss sums.
    """
    tensor = torch.as_tensor(value, device=ctx.device).detach()
    if not ctx.enabled:
        return tensor
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min_max(values: torch.Tensor, ctx: DistributedContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest and the largest of ``values`` over all ranks (one collective), e.g. a metric's
    extremes over a micro-batch that data parallelism split across ranks."""
    local = torch.stack([-values.detach().min(), values.detach().max()])
    if ctx.enabled:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return -local[0], local[1]


def all_reduce_max(values: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """The elementwise largest of ``values`` over all ranks (one collective; ``values`` untouched)."""
    tensor = values.detach().to(ctx.device).clone()
    if ctx.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def raise_on_every_rank(error: str | None, ctx: DistributedContext) -> None:
    """Raise ``error`` (a one-line message) on every rank if any rank has one: a rank that raised alone
    would leave the others waiting in their next collective until the process group times out."""
    if ctx.enabled:
        errors: list[str | None] = [None] * ctx.world_size
        dist.all_gather_object(errors, error)
        error = next((found for found in errors if found is not None), None)
    if error is not None:
        raise ValueError(error)


def broadcast_object(obj: Any, ctx: DistributedContext) -> Any:
    """Rank 0's ``obj`` (any picklable object) on every rank, e.g. a run name or a resolved path."""
    if not ctx.enabled:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
