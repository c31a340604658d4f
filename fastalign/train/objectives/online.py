"""What the online objectives share: ``RolloutObjective`` (GRPO in ``grpo.py``, RLOO in ``rloo.py``, PPO
in ``ppo.py``), ``PromptObjective`` (those and online DPO) and the sampling helpers (those and
distillation on the student's samples).

Rows are prompts (TRL's prompt-only format; other columns reach the reward functions). The policy
samples ``num_generations`` completions of each prompt (``fastalign.train.rollout``), reward functions
score them (``fastalign.train.rewards``), the objective turns the rewards into advantages, and its loss
(fused: no logits) trains on them.

The data's micro-batches are prompts; ``prepare_step`` turns a generation batch of them into training
micro-batches once (``GenerationBatches`` says which generation and which slice of it a step trains
on), so ``steps_per_generation`` micro-batches share one generation and ``num_iterations`` optimizer
passes reuse it. When a generation serves more than one optimizer step, the log-probs at sampling
time are kept as the old policy's (the importance ratio's denominator); otherwise the ratio is 1 and
they are not computed (as TRL).

Sampling is seeded by the data position (``GenerationBatches``), so a run resumed from a checkpoint
at a generation boundary samples the next generation as the interrupted run would have. A checkpoint
inside a generation (any ``save_steps``, a run's last step, an early stop) holds the rest of it
(``pending_state``: this rank's training micro-batches, the generation's metrics and its completions not
yet logged), and a run resumed from it trains on those rather than sample them again with the newer
policy: exact wherever the checkpoint falls.

Evaluation (as TRL): the held-out prompts are sampled ``num_generations_eval`` times each (one
evaluation micro-batch is ``per_device_eval_batch_size`` completions), scored, and the loss and the
reward metrics are logged with an ``eval_`` prefix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from fastalign.data.preference import PromptCollator, tokenize_prompt_dataset
from fastalign.losses.completion import CompletionLoss
from fastalign.models.structure import disable_dropout
from fastalign.train.batches import BatchPosition, MicroBatches, batch_tokens
from fastalign.train.callbacks import truncate_jsonl_after
from fastalign.train.checkpoint import PendingState
from fastalign.train.config import ConfigError, TrainConfig, model_option
from fastalign.train.distributed import DistributedContext, all_reduce_max
from fastalign.train.engine import Callback
from fastalign.train.objectives.base import BatchPlan, Objective, Prepared, RunParts
from fastalign.train.objectives.router_aux import RouterAuxLoss
from fastalign.train.reference import Reference, reference_model, token_logprobs_of
from fastalign.train.rewards import RewardFunction, resolve_reward_funcs
from fastalign.train.rollout import (
    STRUCTURAL_GENERATION_KWARGS,
    Completions,
    Rewards,
    SamplingKeys,
    SamplingOptions,
    all_gather_list,
    decode_completions,
    gather_rewards,
    generate_completions,
    scoring_batch,
)

#: The key of a prompt micro-batch that says which generation it belongs to and which slice a step trains.
ROLLOUT_KEY = "fastalign_rollout"


def sample_completions(
    model: torch.nn.Module, prompt_batches: list[dict], sampling: SamplingOptions, tokenizer, ctx
) -> list[Completions]:
    """Each prompt micro-batch's completions, sampled with the seed ``GenerationBatches`` gave it (its
    ``ROLLOUT_KEY``; an evaluation micro-batch has none and samples from the current random state) in a
    forked random state, so that sampling neither depends on nor changes anything else's draws."""
    seeded = all(ROLLOUT_KEY in batch for batch in prompt_batches)
    seeds = [batch[ROLLOUT_KEY][3] for batch in prompt_batches] if seeded else None
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        return generate_completions(model, prompt_batches, sampling, tokenizer, ctx, seeds)


def score_completions(
    reward_funcs: list[RewardFunction],
    reward_weights: list[float] | None,
    prompt_batches: list[dict],
    completions: list[Completions],
    repeat: int,
    tokenizer,
    conversational: bool,
    ctx: DistributedContext,
) -> tuple[Rewards, list, list]:
    """The whole generation batch's rewards (gathered from every rank), and this rank's prompts and
    decoded completions as the reward functions saw them. Each prompt of ``prompt_batches`` has
    ``repeat`` adjacent completions; the reward functions get every dataset column of its row."""
    examples = [e for batch in prompt_batches for e in batch["examples"] for _ in range(repeat)]
    prompts = [example.prompt for example in examples]
    texts = [text for done in completions for text in decode_completions(done, tokenizer, conversational)]
    ids = [
        row[: int(length)]
        for done in completions
        for row, length in zip(done.completion_ids.tolist(), done.lengths, strict=True)
    ]
    # every example's columns: in-memory rows need not all have the same ones
    names = dict.fromkeys(name for example in examples for name in example.columns)
    columns = {name: [example.columns.get(name) for example in examples] for name in names}
    truncated = torch.cat([done.truncated for done in completions])
    rewards = gather_rewards(reward_funcs, reward_weights, prompts, texts, ids, columns, truncated, ctx)
    return rewards, prompts, texts


class GenerationBatches:
    """The prompt micro-batches of every optimizer step, in generations.

    One generation is ``steps_per_generation`` micro-batches of prompts (per rank); it serves
    ``steps_per_generation / gradient_accumulation_steps`` optimizer steps, each on its own slice, and
    the whole is repeated ``num_iterations`` times. Every step gets the generation's micro-batches, each
    marked with ``ROLLOUT_KEY`` = (generation, slice, slices, sampling seed). The seed is a function of
    the run's seed, the generation and the micro-batch's number among all ranks' micro-batches, so the
    same prompts are sampled the same way however many processes share them, and a resumed run
    regenerates exactly what the interrupted one had."""

    def __init__(self, prompts: MicroBatches, accumulation: int, num_iterations: int):
        if prompts.accumulation % accumulation:
            raise ValueError(
                f"steps_per_generation ({prompts.accumulation}) must be a multiple of "
                f"gradient_accumulation_steps ({accumulation})"
            )
        self.prompts = prompts
        self.rank, self.world_size = prompts.rank, prompts.world_size
        self.slices = prompts.accumulation // accumulation
        self.steps_per_generation_batch = self.slices * num_iterations
        self.steps_per_epoch = prompts.steps_per_epoch * self.steps_per_generation_batch

    def step_batches(self, position: BatchPosition) -> list[dict]:
        generation, step = divmod(position.step_in_epoch, self.steps_per_generation_batch)
        batches = self.prompts.step_batches(BatchPosition(position.epoch, generation))
        first = (position.epoch * self.prompts.steps_per_epoch + generation) * len(batches) * self.world_size
        return [
            {
                **batch,
                ROLLOUT_KEY: (
                    (position.epoch, generation),
                    step % self.slices,
                    self.slices,
                    self.prompts.seed * 1_000_003 + first + k * self.world_size + self.rank,
                ),
            }
            for k, batch in enumerate(batches)
        ]

    def advance(self, position: BatchPosition) -> BatchPosition:
        step = position.step_in_epoch + 1
        if step == self.steps_per_epoch:
            return BatchPosition(position.epoch + 1, 0)
        return BatchPosition(position.epoch, step)


def check_generation_keys(
    use_vllm: bool,
    generation_kwargs: dict[str, Any] | None,
    reward_funcs: list[str],
    reward_weights: list[float] | None,
) -> None:
    """The checks every objective that samples and scores makes of those keys: a one-line
    ``ConfigError`` naming the key."""
    if use_vllm:  # installed or not: no sampling option is ever left out of a vLLM generation either
        raise ConfigError(
            "config key 'use_vllm': fastalign does not generate with vLLM (installing it changes nothing); "
            "remove it: completions come from fastalign's rollout engine (generation_engine)"
        )
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ConfigError(
            f"config key 'reward_weights' has {len(reward_weights)} values for {len(reward_funcs)} "
            "reward_funcs"
        )
    structural = sorted(set(generation_kwargs or ()) & set(STRUCTURAL_GENERATION_KWARGS))
    if structural:
        raise ConfigError(
            f"config key 'generation_kwargs' sets {', '.join(structural)}: the rollout decides it "
            "(the completions of each prompt)"
        )
    if (generation_kwargs or {}).get("stop_strings"):
        # generate needs the tokenizer for them, and a completion a string ends has no EOS: it would be
        # scored and masked as truncated (TRL fails the same way)
        raise ConfigError(
            "config key 'generation_kwargs' sets stop_strings, which the rollout does not support: a "
            "completion they end has no EOS and would count as truncated; end completions at an eos_token"
        )


@dataclass(frozen=True)
class RolloutOptions(SamplingKeys):
    """The keys every online objective reads (TRL's GRPOConfig / RLOOConfig names)."""

    beta: float
    reward_funcs: list[str]
    reward_weights: list[float] | None
    num_generations: int
    num_generations_eval: int | None
    max_prompt_length: int | None
    max_completion_length: int
    truncation: bool
    chat_template_kwargs: dict[str, Any] | None  # template variables of conversational prompts
    epsilon: float
    epsilon_high: float | None
    num_iterations: int
    steps_per_generation: int | None
    mask_truncated_completions: bool
    log_completions: bool
    use_vllm: bool
    ref_model_name_or_path: str | None
    disable_dropout: bool

    def sampling(self, num_generations: int) -> SamplingOptions:
        return SamplingOptions.of(self, num_generations, self.max_completion_length)

    @property
    def eval_generations(self) -> int:
        return self.num_generations_eval or self.num_generations

    #: The config key of the KL term's weight (``beta``; PPO's ``kl_coef``): at 0 no reference is read.
    kl_key = "beta"  # not annotated: a class attribute, not an option (a config key)

    def check(self, name: str, config: TrainConfig) -> None:
        """The checks of options together (each key alone was checked with the config): a one-line
        ``ConfigError`` naming the key."""
        if not self.reward_funcs:
            raise ConfigError(f"config key 'reward_funcs' must name at least one reward function for {name}")
        if self.beta == 0 and self.ref_model_name_or_path is not None:
            raise ConfigError(
                f"config key 'ref_model_name_or_path' is read by {name} only with a KL term, and "
                f"{self.kl_key} is 0: set {self.kl_key} above 0, or remove it"
            )
        if config.per_device_train_batch_size % self.num_generations:
            raise ConfigError(
                f"config key 'per_device_train_batch_size' ({config.per_device_train_batch_size}) counts "
                f"completions and must be a multiple of num_generations ({self.num_generations})"
            )
        if (config.eval_dataset_name or config.eval_split_ratio) and (
            config.per_device_eval_batch_size % self.eval_generations
        ):
            raise ConfigError(
                f"config key 'per_device_eval_batch_size' ({config.per_device_eval_batch_size}) counts "
                f"completions and must be a multiple of num_generations_eval ({self.eval_generations})"
            )
        steps = self.steps_per_generation
        if steps is not None and steps % config.gradient_accumulation_steps:
            raise ConfigError(
                f"config key 'steps_per_generation' ({steps}) must be a multiple of "
                f"gradient_accumulation_steps ({config.gradient_accumulation_steps}): a generation serves "
                "whole optimizer steps"
            )
        check_generation_keys(self.use_vllm, self.generation_kwargs, self.reward_funcs, self.reward_weights)
        if config.truncation and self.max_prompt_length is None:
            raise ConfigError(
                f"config key 'truncation' is read by {name} only with max_prompt_length (it truncates "
                "prompts to that length): set max_prompt_length, or remove truncation"
            )


class PromptObjective(Objective):
    """What the objectives that sample completions of prompt-only rows and score them with reward
    functions share (online DPO, and GRPO, RLOO and PPO through ``RolloutObjective``): TRL's prompt data
    (``max_prompt_length``, ``truncation``, ``chat_template_kwargs``), the reward functions, and what
    ``setup`` readies: dropout off (``disable_dropout``), the reference (``fastalign.train.reference``)
    when the loss needs one, the tokenizer that decodes completions for the reward functions, and
    whether the prompts are conversational."""

    #: Whether text prompts start with the tokenizer's own special tokens (a Llama-style BOS), as TRL's
    #: GRPO and RLOO trainers tokenize them (``processing_class(text=...)``).
    prompt_special_tokens: ClassVar[bool] = False

    default_dataset = "tiny-prompts"

    def __init__(self, options, sampling: SamplingOptions, ctx: DistributedContext | None, dtype: str | None):
        super().__init__(ctx)
        self.options = options
        self.reward_funcs = reward_functions(options, self.ctx, dtype)
        self.sampling = sampling
        self.reference: Reference | None = None
        self.tokenizer = None  # set up with the model: it decodes completions for the reward functions
        self.conversational = False

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model."""
        return True

    def tokenize(self, rows: list[dict], tokenizer) -> list:
        return tokenize_prompt_dataset(
            rows,
            tokenizer,
            max_prompt_length=self.options.max_prompt_length,
            truncation=self.options.truncation,
            chat_template_kwargs=self.options.chat_template_kwargs,
            special_tokens=self.prompt_special_tokens,
        )

    def collate(self, tokenizer) -> PromptCollator:
        return PromptCollator(tokenizer.pad_token_id)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if self.options.disable_dropout:
            disable_dropout(model)
        if self.needs_reference:
            self.reference = reference_model(model, self.options.ref_model_name_or_path, parts)
        self.tokenizer = parts.tokenizer
        self.conversational = isinstance(train[0].prompt, list)
        return Prepared(train, evaluation)


class RolloutObjective(PromptObjective):
    """What GRPO, RLOO and PPO share: prompt data, generation batches, the rollout (sampling, the
    policy's and the reference's log-probs, rewards), evaluation by sampling and the completions log. A
    subclass says how rewards become advantages (``advantages``), which log-probs it needs, and its loss.

    A loss term is a completion or a completion token, as the subclass says (``loss_tokens``), counted
    over the whole step on all ranks. The ``timing/*`` metrics are the logging rank's (rank 0's) own."""

    options_class: ClassVar[type[RolloutOptions]]

    def __init__(
        self,
        name: str,
        options: RolloutOptions,
        ctx: DistributedContext | None = None,
        *,
        dtype: str | None = None,
    ):
        super().__init__(options, options.sampling(options.num_generations), ctx, dtype)
        self.name = name
        self._generation: tuple | None = None
        self._steps_left = 0  # the optimizer steps that still train on the generation (pending_state)
        self._generated_tokens = 0  # this rank's prompt and completion tokens of a new generation
        self._batches: list[dict] = []
        self._metrics: dict[str, float] = {}
        self.completion_rows: list[dict] = []  # the last generation's, for log_completions
        # a MoE policy's router loss, where the options have TRL's key (GRPO, RLOO; TRL's former PPO
        # trainer had none)
        coef = getattr(options, "router_aux_loss_coef", None)
        self.router_aux = RouterAuxLoss(coef) if hasattr(options, "router_aux_loss_coef") else None

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> RolloutObjective:
        options = cls.options_class.from_config(config, name)
        options.check(name, config)
        return cls(name, options, ctx, dtype=model_option(config, "dtype"))

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(cls.options_class.__dataclass_fields__)

    # --- what a subclass says ----------------------------------------------------------------------
    @abstractmethod
    def keeps_policy_logprobs(self, reused: bool) -> bool:
        """Whether the rollout computes the sampling policy's per-token log-probs
        (``old_per_token_logps``); ``reused``: the generation serves more than one optimizer step."""

    @abstractmethod
    def advantages(
        self, rewards: Rewards, batches: list[dict], group: int, reused: bool
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The whole generation batch's advantages [N] from its gathered ``rewards`` (groups of ``group``
        adjacent completions), and the metrics they make. ``batches`` are this rank's training
        micro-batches without advantages yet: a subclass may read their log-probs, and take out what its
        loss does not use."""

    #: The policy loss (an output with ``loss`` and ``metrics``), from the completion tokens' hidden states.
    loss: CompletionLoss

    @abstractmethod
    def loss_inputs(self, batch: dict, num_items) -> dict:
        """The keyword inputs of ``loss`` besides the hidden states, head, completions and mask: the
        advantages, the log-probs it needs from ``batch``, and ``num_items`` where the loss normalises by
        the step's count itself (``normalises``)."""

    #: Whether ``loss`` divides by the step's loss-term count itself (else: the micro-batch's mean).
    normalises = False

    def head_loss(self, hidden, weight, bias, completion_ids, batch: dict, num_items, softcap=None):
        """The loss of ``batch`` from the completion tokens' hidden states, inside the model's forward
        (``softcap``: the model's final-logit softcap, which the patched forward passes)."""
        mask = batch["completion_mask"]
        return self.loss(
            hidden,
            weight,
            completion_ids,
            mask,
            bias=bias,
            softcap=softcap,
            **self.loss_inputs(batch, num_items),
        )

    @property
    def needs_reference(self) -> bool:
        return self.options.beta > 0

    # --- data --------------------------------------------------------------------------------------
    def batches(self, examples: list, tokenizer, plan: BatchPlan) -> GenerationBatches:
        """Prompt micro-batches of ``per_device_train_batch_size / num_generations`` prompts, one
        generation's (``steps_per_generation`` or a step's) at a time."""
        prompts = dataclasses.replace(
            plan,
            batch_size=plan.batch_size // self.options.num_generations,
            accumulation=self.options.steps_per_generation or plan.accumulation,
        )
        micro_batches = super().batches(examples, tokenizer, prompts)
        return GenerationBatches(micro_batches, plan.accumulation, self.options.num_iterations)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        super().setup(model, train, evaluation, parts)
        if self.router_aux is not None:
            self.router_aux.setup(model)
        # each held-out prompt once per completion, adjacent: an evaluation micro-batch of
        # per_device_eval_batch_size rows (a multiple of the group) holds whole groups, as in TRL
        group = self.options.eval_generations
        repeated = [example for example in evaluation for _ in range(group)]
        callbacks = [CompletionsLog(self)] if self.options.log_completions else []
        return Prepared(train, repeated, callbacks)

    def sequence_length(self, config: TrainConfig, train: list) -> int:
        """A prompt and its completion: the longest training prompt (as tokenized: cut to
        ``max_prompt_length`` where set) and ``max_completion_length`` (these objectives read no
        ``max_length``: TRL's GRPOConfig and RLOOConfig have none)."""
        longest = max((len(example.prompt_ids) for example in train), default=0)
        return longest + self.options.max_completion_length

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        if "completion_mask" not in batch:  # an evaluation micro-batch of prompts, one row a completion
            return batch["input_ids"].shape[0]
        return self.batch_loss_terms(batch)

    def batch_loss_terms(self, batch: dict) -> int:
        """The loss terms of a training micro-batch: its completions (a subclass may count tokens)."""
        return batch["completion_mask"].shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        generation, part, slices, _ = micro_batches[0][ROLLOUT_KEY]
        if generation != self._generation:
            if self._steps_left:  # GenerationBatches and this count disagree: never resample silently
                raise RuntimeError(
                    f"generation {generation} begins while {self._steps_left} steps of {self._generation} "
                    "are left"
                )
            # a generation that serves more than one optimizer step keeps the sampling policy's log-probs
            # (the importance ratio's denominator); otherwise the ratio is 1 and they are not computed
            reused = slices > 1 or self.options.num_iterations > 1
            self._batches, self._metrics = self._rollout(model, micro_batches, reused)
            self._generation = generation
            self._steps_left = slices * self.options.num_iterations
            self._generated_tokens = sum(batch_tokens(batch) for batch in self._batches)
        else:
            self._generated_tokens = 0
        self._steps_left -= 1
        size = len(self._batches) // slices
        if self.router_aux is not None:
            self.router_aux.start_step(size, self.ctx.world_size)
        return self._batches[part * size : (part + 1) * size], self._metrics

    def pending_state(self) -> PendingState | None:
        """The generation the next steps still train on (None after its last step): this rank's training
        micro-batches (their tensors as ``<micro-batch>.<key>``), which generation it is and how many steps
        it has left, its metrics (logged at each of its steps) and its completions not yet logged."""
        if not self._steps_left:
            return None
        tensors = {
            f"{index}.{key}": value
            for index, batch in enumerate(self._batches)
            for key, value in batch.items()
        }
        meta = {
            "generation": list(self._generation),
            "steps_left": self._steps_left,
            "micro_batches": len(self._batches),
            "world_size": self.ctx.world_size,
            "metrics": {key: float(value) for key, value in self._metrics.items()},
            "completion_rows": self.completion_rows,
        }
        return PendingState(tensors, meta)

    def load_pending_state(self, state: PendingState) -> None:
        meta = state.meta
        try:
            generation = tuple(int(value) for value in meta["generation"])
            steps_left, count = int(meta["steps_left"]), int(meta["micro_batches"])
            world_size = int(meta["world_size"])
            metrics = {str(key): float(value) for key, value in meta["metrics"].items()}
            rows = list(meta["completion_rows"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(
                f"its metadata is not a generation's ({type(error).__name__}: {error})"
            ) from None
        if world_size != self.ctx.world_size:
            raise ValueError(
                f"its generation was dealt to {world_size} processes, this run has {self.ctx.world_size}: "
                f"resume it with {world_size}"
            )
        most = count * self.options.num_iterations  # a step trains on one slice of at least 1 micro-batch
        if not 1 <= steps_left <= most:  # saved only inside a generation: some of its steps are left
            raise ValueError(
                f"its steps_left {steps_left} is not inside a generation of {count} micro-batches × "
                f"num_iterations {self.options.num_iterations} (1 to {most})"
            )
        batches: list[dict] = [{} for _ in range(count)]
        for name, tensor in state.tensors.items():
            index, _, key = name.partition(".")
            if not (index.isdigit() and int(index) < count and key):
                raise ValueError(f"tensor {name!r} is no micro-batch's of the {count} it lists")
            batches[int(index)][key] = tensor
        for index, batch in enumerate(batches):
            _check_training_batch(batch, index)
        self._generation, self._steps_left = generation, steps_left
        self._batches, self._metrics, self.completion_rows = batches, metrics, rows
        self._generated_tokens = 0

    def num_tokens(self, micro_batches: list[dict]) -> int:
        """TRL's GRPO and RLOO count a generation's prompt and completion tokens (up to the EOS) once,
        when it is sampled, however many steps and ``num_iterations`` passes train on it."""
        return self._generated_tokens

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        if "completion_mask" not in batch:
            return self._evaluate(model, batch)
        mask = batch["completion_mask"]
        prompt_width = batch["input_ids"].shape[1] - mask.shape[1]
        completion_ids = batch["input_ids"][:, prompt_width:]
        num_items = num_items_in_batch if self.normalises else None

        def head(hidden, weight, bias, softcap=None):
            states = hidden[:, prompt_width - 1 : -1]
            return self.head_loss(states, weight, bias, completion_ids, batch, num_items, softcap)

        output = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            head_fn=head,
            **(self.router_aux.forward_kwargs() if self.router_aux is not None else {}),
        )
        result = output.head_output
        share = self.batch_loss_terms(batch) / num_items_in_batch
        loss = result.loss if self.normalises else result.loss * share
        metrics = {key: value * share for key, value in self._global_extremes(result.metrics, batch).items()}
        if self.router_aux is None:
            return loss, metrics
        return self.router_aux.add(model, loss, output, metrics)

    def _global_extremes(self, metrics: dict, batch: dict) -> dict:
        """TRL gathers every rank's per-completion clip shares of a micro-batch and logs their smallest
        (``clip_ratio/low_min``) and largest (``clip_ratio/high_max``): the loss's own are this rank's,
        so they become the extremes over all ranks (each rank's micro-batches come in step, so the
        collective pairs them). A rank whose micro-batch has no completion token (its 0 stands for
        TRL's NaN) takes no part, as TRL's ``nanmin``/``nanmax`` skip it. Then, like every metric, they
        are weighted by the micro-batch's share: over the step, the mean of its micro-batches' values,
        as TRL averages its logged list."""
        if not self.ctx.enabled or "clip_ratio/low_min" not in metrics:
            return metrics
        low, high = metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"]
        if not bool(batch["completion_mask"].any()):
            low, high = torch.full_like(low, float("inf")), torch.full_like(high, float("-inf"))
        found = all_reduce_max(torch.stack([-low, high]), self.ctx)
        low_min, high_max = -found[0], found[1]
        return {
            **metrics,
            "clip_ratio/low_min": torch.where(low_min.isinf(), 0.0, low_min),
            "clip_ratio/high_max": torch.where(high_max.isinf(), 0.0, high_max),
        }

    # ---------------------------------------------------------------------------------------------
    def _evaluate(self, model, prompts: dict) -> tuple[torch.Tensor, dict]:
        """An evaluation micro-batch (its prompts repeated, one row a completion): sample one completion
        a row, score the groups, and return the micro-batch's mean loss and metrics."""
        (batch,), metrics = self._rollout(model, [prompts], reused=False, evaluation=True)
        batch = {key: value.to(self.ctx.device) for key, value in batch.items()}
        loss, loss_metrics = self.compute_loss(model, batch, torch.tensor(self.batch_loss_terms(batch)))
        rollout = {key: value for key, value in metrics.items() if not key.startswith("timing/")}
        return loss, {**loss_metrics, **rollout}

    def _rollout(
        self, model, prompt_batches: list[dict], reused: bool, evaluation: bool = False
    ) -> tuple[list[dict], dict[str, float]]:
        """Generate, score and build the training micro-batches of one generation batch (an evaluation
        micro-batch: its rows already repeat each prompt, and are sampled once each)."""
        start = time.perf_counter()
        sampling, group = self.sampling, self.sampling.num_generations
        if evaluation:
            sampling, group = (
                dataclasses.replace(self.sampling, num_generations=1),
                self.options.eval_generations,
            )
        completions = sample_completions(model, prompt_batches, sampling, self.tokenizer, self.ctx)
        generated = time.perf_counter()
        keep_old = self.keeps_policy_logprobs(reused)
        batches = [self._training_batch(model, done, keep_old) for done in completions]
        scored = time.perf_counter()
        rewards, prompts, texts = score_completions(
            self.reward_funcs,
            self.options.reward_weights,
            prompt_batches,
            completions,
            1 if evaluation else group,
            self.tokenizer,
            self.conversational,
            self.ctx,
        )
        advantages, metrics = self.advantages(rewards, batches, group, reused)
        local, offset = advantages[rewards.rows], 0
        for batch in batches:
            rows = batch["input_ids"].shape[0]
            batch["advantages"] = local[offset : offset + rows].clone()
            offset += rows
        if self.options.log_completions and not evaluation:
            self._log_rows(prompts, texts, rewards, advantages)
        metrics = {
            **rewards.metrics(self.reward_funcs),
            **metrics,
            "timing/generation_seconds": generated - start,
            "timing/logprobs_seconds": scored - generated,
            "timing/rewards_seconds": time.perf_counter() - scored,
        }
        return batches, metrics

    def _training_batch(self, model, done: Completions, keep_old_logprobs: bool) -> dict:
        mask = done.completion_mask
        if self.options.mask_truncated_completions:
            mask = mask * (~done.truncated)[:, None]
        batch, targets, scored = scoring_batch(done, mask)
        temperature = self.sampling.temperature
        inputs = (batch["input_ids"], batch["attention_mask"], targets, temperature, batch["position_ids"])
        with torch.no_grad():
            if keep_old_logprobs:
                batch["old_per_token_logps"] = token_logprobs_of(model, *inputs)[:, scored]
            if self.reference is not None:
                batch["ref_per_token_logps"] = self.reference.token_logprobs(*inputs)[:, scored]
        return {key: value.cpu() for key, value in batch.items()}

    def _log_rows(self, prompts: list, completions: list, rewards: Rewards, advantages: torch.Tensor) -> None:
        """Keep the generation's rows (every rank's, as TRL's table) for ``CompletionsLog``."""
        prompts, completions = all_gather_list(prompts, self.ctx), all_gather_list(completions, self.ctx)
        per_func = rewards.per_func.tolist()
        self.completion_rows = [
            {
                "prompt": prompt,
                "completion": completion,
                **{
                    func.name: None if math.isnan(value) else value
                    for func, value in zip(self.reward_funcs, values, strict=True)
                },
                "advantage": advantage,
            }
            for prompt, completion, values, advantage in zip(
                prompts, completions, per_func, advantages.tolist(), strict=True
            )
        ]


#: The tensors of every training micro-batch of a generation; and those [rows, completion width] like its
#: ``completion_mask``, where a subclass's rollout keeps them.
_ROW_KEYS = ("input_ids", "attention_mask", "position_ids", "completion_mask", "advantages")
_COMPLETION_KEYS = ("old_per_token_logps", "ref_per_token_logps", "token_advantages", "returns", "values")


def _check_training_batch(batch: dict, index: int) -> None:
    """A ValueError unless ``batch`` (a pending generation's micro-batch ``index``, as read back) has a
    training micro-batch's tensors, of shapes that fit together."""
    missing = [key for key in _ROW_KEYS if key not in batch]
    if missing:
        raise ValueError(f"micro-batch {index} has no {', '.join(missing)}")
    rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
    completion = batch["completion_mask"].shape
    wrong = [key for key, value in batch.items() if value.dim() == 0 or value.shape[0] != rows]
    wrong += [key for key in ("attention_mask", "position_ids") if batch[key].shape != (rows, width)]
    wrong += [key for key in _COMPLETION_KEYS if key in batch and batch[key].shape != completion]
    if wrong or batch["input_ids"].dim() != 2 or len(completion) != 2 or completion[1] >= width:
        shapes = ", ".join(
            f"{key} {list(batch[key].shape)}"
            for key in dict.fromkeys([*wrong, "input_ids", "completion_mask"])
        )
        raise ValueError(f"micro-batch {index}'s tensors do not fit together ({shapes})")


def reward_functions(options, ctx: DistributedContext, dtype: str | None) -> list[RewardFunction]:
    """The ``reward_funcs`` of ``options`` resolved; a reward model among them loads on this rank's
    device in the run's ``dtype`` and reads conversational rows with the options'
    ``chat_template_kwargs``. A bad spec is a one-line ConfigError."""
    try:
        return resolve_reward_funcs(
            options.reward_funcs,
            device=ctx.device,
            dtype=dtype,
            chat_template_kwargs=options.chat_template_kwargs,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


class CompletionsLog(Callback):
    """``log_completions``: at each logging step, the main rank appends the rows of the generations made
    since the last one to ``<output_dir>/completions.jsonl`` (TRL logs the same table, step, prompt,
    completion, each reward function's reward and the advantage, to its trackers)."""

    FILE = "completions.jsonl"

    def __init__(self, objective: RolloutObjective):
        self.objective = objective

    def on_train_begin(self, engine) -> None:
        """A run resumed from step N drops the rows a killed run logged after N (as ``metrics.jsonl``)."""
        if engine.ctx.is_main:
            truncate_jsonl_after(Path(engine.output_dir, self.FILE), engine.state.step)

    def on_log(self, engine, logs: dict) -> None:
        rows, self.objective.completion_rows = self.objective.completion_rows, []
        if not rows or not engine.ctx.is_main:
            return
        with Path(engine.output_dir, self.FILE).open("a", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps({"step": engine.state.step, **row}, ensure_ascii=False) + "\n")
