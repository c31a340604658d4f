"""GRPO's rollout: sample completions of each prompt with the current policy, score them with the
reward functions, and turn the scores into group advantages.

Generation is ``model.generate`` with a KV cache, in eval mode, without gradient. Under FSDP2 the
sharded model generates as is (each forward gathers the layers it runs), with ``synced_gpus`` so that a
rank whose completions all ended keeps stepping until every rank's have: FSDP's all-gathers are
collective, and a rank that stopped early would leave the others waiting forever.

Rewards of all ranks are gathered before the advantages, so ``scale_rewards='batch'`` and the logged
reward statistics are over the whole generation batch; a prompt's completions are all generated on one
rank, so groups never straddle ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastalign.ops import combine_rewards, group_advantages
from fastalign.train.distributed import DistributedContext
from fastalign.train.rewards import RewardFunction, compute_rewards, reward_metrics


@dataclass(frozen=True)
class SamplingOptions:
    """How completions are sampled (TRL's GRPOConfig names)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Completions:
    """The completions of a micro-batch of prompts, each prompt repeated ``num_generations`` times
    (a group's completions adjacent). Widths: P (left-padded prompts) and C (longest completion)."""

    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, C], pad after the end
    completion_mask: torch.Tensor  # [N, C], 1 up to and including the first EOS
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)


def position_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` numbers them (so scoring matches sampling)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module, prompts: dict, options: SamplingOptions, tokenizer, ctx: DistributedContext
) -> Completions:
    """Sample ``num_generations`` completions of every prompt in ``prompts`` (left-padded ids + mask)."""
    group = options.num_generations
    prompt_ids = prompts["input_ids"].repeat_interleave(group, 0).to(ctx.device)
    prompt_mask = prompts["attention_mask"].repeat_interleave(group, 0).to(ctx.device)
    was_training = model.training
    model.eval()
    try:
        output = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            top_k=0,
            temperature=options.temperature,
            top_p=options.top_p,
            max_new_tokens=options.max_completion_length,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
            synced_gpus=ctx.enabled,
        )
    finally:
        model.train(was_training)
    completion_ids = output[:, prompt_ids.shape[1] :]
    is_eos = completion_ids == tokenizer.eos_token_id
    has_eos = is_eos.any(-1)
    end = torch.where(has_eos, is_eos.int().argmax(-1), completion_ids.shape[1])  # index of the first EOS
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion_mask = (positions[None, :] <= end[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    return Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, ~has_eos)


def decode_completions(completions: Completions, tokenizer, conversational: bool) -> list:
    """Completion texts (up to the EOS), or assistant messages for conversational prompts (as TRL)."""
    texts = [
        tokenizer.decode(ids[: int(length)], skip_special_tokens=True)
        for ids, length in zip(completions.completion_ids.tolist(), completions.lengths, strict=True)
    ]
    return [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts


def raise_on_every_rank(error: str | None, ctx: DistributedContext) -> None:
    """Raise ``error`` (a one-line message) on every rank if any rank has one: a rank that raised alone
    would leave the others waiting in their next collective until the process group times out."""
    if ctx.enabled:
        errors: list[str | None] = [None] * ctx.world_size
        dist.all_gather_object(errors, error)
        error = next((found for found in errors if found is not None), None)
    if error is not None:
        raise ValueError(error)


def _all_gather_rows(local: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Every rank's rows, rank 0 first (every rank has the same number)."""
    if not ctx.enabled:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


@dataclass(frozen=True)
class Scoring:
    """How completions become advantages (TRL's GRPOConfig names)."""

    reward_funcs: list[RewardFunction]
    reward_weights: list[float] | None
    num_generations: int
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"


def score_completions(
    scoring: Scoring,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    truncated: torch.Tensor,
    ctx: DistributedContext,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's advantages [N] and the generation batch's reward metrics (global over ranks)."""
    local, error = None, None
    try:
        local = compute_rewards(scoring.reward_funcs, prompts, completions, completion_ids, columns)
    except ValueError as failure:  # a reward function that raised or returned nonsense, named
        error = str(failure)
    raise_on_every_rank(error, ctx)
    lengths = torch.tensor([float(len(ids)) for ids in completion_ids])
    # rewards of every function, length and truncation: one gather for all of them
    stats = torch.cat([local, lengths[:, None], truncated.float().cpu()[:, None]], dim=1).to(ctx.device)
    everything = _all_gather_rows(stats, ctx).cpu()
    rewards_per_func, all_lengths, all_truncated = everything[:, :-2], everything[:, -2], everything[:, -1]
    weights = None if scoring.reward_weights is None else torch.tensor(scoring.reward_weights)
    rewards = combine_rewards(rewards_per_func, weights)
    result = group_advantages(
        rewards,
        scoring.num_generations,
        scale_rewards=scoring.scale_rewards,
        advantage_estimator=scoring.advantage_estimator,
        backend="torch",
    )
    start = ctx.rank * local.shape[0]
    groups = result.group_std.numel()
    metrics = {
        "reward": float(rewards.nanmean()),
        "reward_std": float(result.group_std.mean()),
        "frac_reward_zero_std": float(result.num_zero_std_groups) / max(groups, 1),
        "completions/mean_length": float(all_lengths.mean()),
        "completions/min_length": float(all_lengths.min()),
        "completions/max_length": float(all_lengths.max()),
        "completions/clipped_ratio": float(all_truncated.mean()),
        **reward_metrics(scoring.reward_funcs, rewards_per_func),
    }
    return result.advantages.reshape(-1)[start : start + local.shape[0]], metrics
