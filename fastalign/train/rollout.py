"""The online objectives' rollout (GRPO, RLOO, PPO, online DPO; distill's sampled completions): sample
completions and score them with the reward functions.

Generation runs in eval mode, without gradient, through fastalign's engine
(``fastalign.sampling.generation``: each prompt prefilled once for its group, ended rows dropped, the
tokens and distribution of ``model.generate``), or ``model.generate`` itself (``generation_engine:
generate``, or a model or option the engine cannot run, said once in a log line). The engine samples a
whole generation's micro-batches in one call (more rows per decode step), each prompt drawing from a
generator seeded by its micro-batch's seed, so its completions do not depend on which prompts shared the
call. Under FSDP2 the sharded model generates as is (each forward gathers the layers it runs), ranks
kept in step (``synced_gpus``): a rank whose completions all ended keeps stepping until every rank's
have, since FSDP's all-gathers are collective and a rank that stopped early would leave the others
waiting forever.

Rewards of all ranks are gathered (``gather_rewards``) before an objective turns them into advantages,
so batch statistics (``scale_rewards='batch'``, RLOO's ``normalize_advantages``) and the logged reward
statistics are over the whole generation batch; a prompt's completions are all generated on one rank,
so groups never straddle ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fastalign.models.structure import IGNORE_INDEX
from fastalign.ops import combine_rewards
from fastalign.sampling.generation import (
    engine_refusal,
    eos_token_ids,
    reads_prompt_padding,
    sample_groups,
    token_id_list,
)
from fastalign.train.distributed import DistributedContext, raise_on_every_rank
from fastalign.train.rewards import RewardFunction, compute_rewards, reward_metrics

logger = logging.getLogger(__name__)

#: ``generation_kwargs`` keys that would change the shape of what ``generate`` returns (the rollout
#: repeats each prompt ``num_generations`` times itself and reads plain token ids).
STRUCTURAL_GENERATION_KWARGS = ("num_return_sequences", "return_dict_in_generate", "synced_gpus")


@dataclass(frozen=True)
class SamplingKeys:
    """The config keys of sampling that every objective which samples completions reads (TRL's names,
    the same in GRPOConfig, RLOOConfig, OnlineDPOConfig and GKDConfig): a base of its options
    dataclass, turned into ``SamplingOptions`` by ``SamplingOptions.of``."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    repetition_penalty: float
    generation_kwargs: dict[str, Any] | None
    generation_engine: str


@dataclass(frozen=True)
class SamplingOptions:
    """How completions are sampled (TRL's GRPOConfig / RLOOConfig names). As in TRL, the options below
    make the generation config and ``generation_kwargs`` is merged over them (its keys win)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    engine: str = "fastalign"  # fastalign or generate (``generation_engine``)

    @classmethod
    def of(cls, options: SamplingKeys, num_generations: int, max_completion_length: int) -> SamplingOptions:
        """An objective's sampling keys, for ``num_generations`` completions of each prompt of up to
        ``max_completion_length`` tokens (each trainer names that length its own way)."""
        return cls(
            num_generations,
            max_completion_length,
            options.temperature,
            options.top_p,
            options.top_k,
            options.min_p,
            options.repetition_penalty,
            options.generation_kwargs,
            options.generation_engine,
        )

    def generate_kwargs(self, tokenizer, model: torch.nn.Module) -> dict[str, Any]:
        """The keyword arguments of ``model.generate`` besides the prompts: an unknown key in
        ``generation_kwargs`` is refused by ``generate`` itself rather than ignored."""
        return {
            "do_sample": True,
            "max_new_tokens": self.max_completion_length,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": stop_token_ids(tokenizer, model),
            **(self.generation_kwargs or {}),
        }


def stop_token_ids(tokenizer, model: torch.nn.Module) -> list[int] | None:
    """The ids that end a completion, as TRL 1.16's sampling trainers set them: the tokenizer's EOS, then
    every id the model's generation config ends on (an instruct model's end of turn, Llama-3's
    ``<|eot_id|>`` beside ``<|end_of_text|>``), which the tokenizer's alone would sample past."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [] if declared is None else token_id_list(declared)
    first = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return list(dict.fromkeys(first + declared)) or None


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
    model: torch.nn.Module,
    prompts: list[dict],
    options: SamplingOptions,
    tokenizer,
    ctx: DistributedContext,
    seeds: list[int] | None = None,
) -> list[Completions]:
    """Sample ``num_generations`` completions of every prompt of each micro-batch of ``prompts``
    (left-padded ids + mask). With ``seeds`` (one per micro-batch) each micro-batch's sampling is
    seeded by its own; without, the current random state draws."""
    kwargs = options.generate_kwargs(tokenizer, model)
    refusal, widths = None, []
    if options.engine == "fastalign":  # every rank's widths: the ranks decide alike, and call alike
        widths = sorted(set(all_gather_list([batch["input_ids"].shape[1] for batch in prompts], ctx)))
        refusal = engine_refusal(model, kwargs, width=max(widths, default=0))
    if refusal is not None:
        _say_once(
            f"fastalign: sampling with model.generate, as the rollout engine cannot run here ({refusal}); "
            "generation_engine: generate says so and silences this"
        )
    ends = _Ends(eos_token_ids(model, kwargs), tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    try:
        if options.engine == "fastalign" and refusal is None:
            return _engine_completions(model, prompts, options, kwargs, ends, ctx, seeds, widths)
        completions = []
        for index, batch in enumerate(prompts):
            with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
                if seeds is not None:
                    torch.manual_seed(seeds[index])
                completions.append(_generate(model, batch, options, kwargs, ends, ctx))
        return completions
    finally:
        model.train(was_training)


def _generate(model, prompts: dict, options: SamplingOptions, kwargs: dict, ends, ctx) -> Completions:
    """One micro-batch's completions from ``model.generate`` on its prompts repeated."""
    group = options.num_generations
    prompt_ids = prompts["input_ids"].repeat_interleave(group, 0).to(ctx.device)
    prompt_mask = prompts["attention_mask"].repeat_interleave(group, 0).to(ctx.device)
    kwargs = {"use_cache": True, **kwargs}  # generation_kwargs may set it (false: the engine refused)
    output = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, synced_gpus=ctx.enabled, **kwargs
    )
    return _completions(prompt_ids, prompt_mask, output[:, prompt_ids.shape[1] :], ends)


def _engine_completions(model, prompts: list[dict], options, kwargs, ends, ctx, seeds, widths) -> list:
    """Every micro-batch's completions from one call of the engine: the prompts left-padded to a common
    width, each prompt seeded by its micro-batch's seed and its place in it (or the random state). Where
    a logits processor sees the padding (``reads_prompt_padding``), one call per width of micro-batch
    instead, so that each samples as it would alone. ``widths``: the micro-batches' widths on every rank;
    under torchrun each rank makes a call for each of them, with a row of its own where it has no
    micro-batch of that width, so that the calls' collectives (the sharded layers' all-gathers, the
    all-reduce of each step) pair up across ranks."""
    if not reads_prompt_padding(model, kwargs) or (len(prompts) == 1 and not ctx.enabled):
        return _engine_call(model, prompts, options, kwargs, ends, ctx, seeds)
    local = [batch["input_ids"].shape[1] for batch in prompts]
    done: dict[int, Completions] = {}
    for width in widths:
        same = [index for index, w in enumerate(local) if w == width]
        if not same:  # another rank's width: one row, sampled for the collectives and dropped
            filler = {
                "input_ids": torch.full((1, width), ends.pad),
                "attention_mask": torch.zeros(1, width, dtype=torch.long),
            }
            filler["attention_mask"][:, -1] = 1
            alone = replace(options, num_generations=1)
            _engine_call(model, [filler], alone, kwargs, ends, ctx, None if seeds is None else [0])
            continue
        got = _engine_call(
            model, [prompts[i] for i in same], options, kwargs, ends, ctx,
            None if seeds is None else [seeds[i] for i in same],
        )  # fmt: skip
        done.update(zip(same, got, strict=True))
    return [done[index] for index in range(len(prompts))]


def _engine_call(model, prompts: list[dict], options, kwargs, ends, ctx, seeds) -> list:
    """``_engine_completions`` of micro-batches sampled in one call."""
    width = max(batch["input_ids"].shape[1] for batch in prompts)
    ids = torch.cat([_left_pad(batch["input_ids"], width, ends.pad) for batch in prompts])
    mask = torch.cat([_left_pad(batch["attention_mask"], width, 0) for batch in prompts])
    prompt_seeds = None
    if seeds is not None:  # a seed of each prompt, from its micro-batch's (63 bits, distinct per prompt)
        prompt_seeds = [
            (seed * 1_000_003 + index) % 2**63
            for seed, batch in zip(seeds, prompts, strict=True)
            for index in range(batch["input_ids"].shape[0])
        ]
    group = options.num_generations
    output = sample_groups(
        model, ids.to(ctx.device), mask.to(ctx.device), group, kwargs, synced=ctx.enabled, seeds=prompt_seeds
    )
    completions, start = [], 0
    for batch in prompts:
        rows = slice(start, start + batch["input_ids"].shape[0] * group)
        start = rows.stop
        prompt_ids = batch["input_ids"].repeat_interleave(group, 0).to(ctx.device)
        prompt_mask = batch["attention_mask"].repeat_interleave(group, 0).to(ctx.device)
        done = _completions(prompt_ids, prompt_mask, output[rows, width:], ends)
        ended = not bool(done.truncated.any())
        completions.append(_trimmed(done, int(done.lengths.max()) if ended else done.completion_ids.shape[1]))
    return completions


def _left_pad(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0), value=value)


def _trimmed(done: Completions, width: int) -> Completions:
    """``done`` with its completions cut to ``width`` columns (the micro-batch's own longest, as
    ``generate`` on it alone would have returned)."""
    ids, mask = done.completion_ids[:, :width], done.completion_mask[:, :width]
    return Completions(done.prompt_ids, done.prompt_mask, ids, mask, done.truncated)


@dataclass(frozen=True)
class _Ends:
    """The ids that end a completion (every EOS id the sampling stopped at: ``generation_kwargs``' or the
    generation config's, one or several) and the pad id after it."""

    eos: list[int]
    pad: int


def _completions(prompt_ids, prompt_mask, completion_ids: torch.Tensor, ends: _Ends) -> Completions:
    """Completions of sampled ids: each cut after its first EOS (mask), padded with the pad id."""
    is_eos = torch.isin(
        completion_ids, torch.tensor(ends.eos, dtype=torch.long, device=completion_ids.device)
    )
    has_eos = is_eos.any(-1)
    end = torch.where(has_eos, is_eos.int().argmax(-1), completion_ids.shape[1])  # index of the first EOS
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion_mask = (positions[None, :] <= end[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, ends.pad)
    return Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, ~has_eos)


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)


def scoring_batch(done: Completions, completion_mask: torch.Tensor) -> tuple[dict, torch.Tensor, slice]:
    """The prompt + completion rows that the policy (and a reference) score: ``input_ids``,
    ``attention_mask``, ``position_ids`` (as ``generate`` numbered them) and ``completion_mask`` (the
    tokens that count; ``done``'s, or fewer); the full-width targets of the log-probs of ``done``'s
    completion tokens; and the slice of positions that score them (position t scores token t + 1: the
    completion's tokens from the prompt's last position on)."""
    input_ids = torch.cat([done.prompt_ids, done.completion_ids], dim=1)
    attention_mask = torch.cat([done.prompt_mask, done.completion_mask], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_of(attention_mask),
        "completion_mask": completion_mask,
    }
    scored = slice(done.prompt_ids.shape[1] - 1, -1)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, scored] = done.completion_ids.masked_fill(done.completion_mask == 0, IGNORE_INDEX)
    return batch, targets, scored


def decode_completions(completions: Completions, tokenizer, conversational: bool) -> list:
    """Completion texts (up to the EOS), or assistant messages for conversational prompts (as TRL)."""
    texts = [
        tokenizer.decode(ids[: int(length)], skip_special_tokens=True)
        for ids, length in zip(completions.completion_ids.tolist(), completions.lengths, strict=True)
    ]
    return [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts


def all_gather_rows(local: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Every rank's rows, rank 0 first (every rank has the same number)."""
    if not ctx.enabled:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)


def all_gather_list(local: list, ctx: DistributedContext) -> list:
    """Every rank's items (any picklable objects), rank 0's first."""
    if not ctx.enabled:
        return list(local)
    parts: list[list | None] = [None] * ctx.world_size
    dist.all_gather_object(parts, list(local))
    return [item for part in parts for item in part]


@dataclass(frozen=True)
class Rewards:
    """A generation batch's rewards and completion statistics, gathered from every rank (rank 0's rows
    first); ``rows`` are this rank's."""

    per_func: torch.Tensor  # [N, F] fp32, NaN where a function returned None
    total: torch.Tensor  # [N] weighted sum over the functions, NaN where none applied
    lengths: torch.Tensor  # [N] completion lengths (tokens, up to and including the EOS)
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    rows: slice

    def metrics(self, reward_funcs: list[RewardFunction]) -> dict[str, float]:
        """The metrics GRPO and RLOO log alike (TRL's names): the mean reward, the completion lengths and
        the truncated share, the lengths of those that ended (with an EOS; as TRL, all 0 when none did),
        and each function's mean and std."""
        return {
            "reward": float(self.total.nanmean()),
            **completion_length_metrics(self.lengths, self.truncated),
            **reward_metrics(reward_funcs, self.per_func),
        }


def completion_length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's ``completions/*`` metrics of a generation batch (every rank's rows): the lengths, the share
    cut at ``max_completion_length``, and the lengths of those that ended with an EOS (all 0 when none
    did, as TRL)."""
    terminated = lengths[~truncated].float()
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    return {
        "completions/mean_length": float(lengths.float().mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
    }


def gather_rewards(
    reward_funcs: list[RewardFunction],
    reward_weights: list[float] | None,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    truncated: torch.Tensor,
    ctx: DistributedContext,
) -> Rewards:
    """Score this rank's completions with every reward function and gather the whole batch's scores
    (one collective). A reward function that fails on any rank raises on every rank."""
    local, error = None, None
    try:
        local = compute_rewards(reward_funcs, prompts, completions, completion_ids, columns)
    except ValueError as failure:  # a reward function that raised or returned nonsense, named
        error = str(failure)
    raise_on_every_rank(error, ctx)
    lengths = torch.tensor([float(len(ids)) for ids in completion_ids])
    stats = torch.cat([local, lengths[:, None], truncated.float().cpu()[:, None]], dim=1).to(ctx.device)
    everything = all_gather_rows(stats, ctx).cpu()
    per_func = everything[:, :-2]
    weights = None if reward_weights is None else torch.tensor(reward_weights)
    start = ctx.rank * local.shape[0]
    return Rewards(
        per_func,
        combine_rewards(per_func, weights),
        everything[:, -2],
        everything[:, -1].bool(),
        slice(start, start + local.shape[0]),
    )
