"""``fastalign train grpo|rloo``: TRL's ``GRPOTrainer`` (and ``RLOOTrainer``'s leave-one-out baseline).

Rows are prompts (TRL's prompt-only format; other columns reach the reward functions). The policy
samples ``num_generations`` completions of each prompt (``fastalign.train.rollout``), reward functions
score them (``fastalign.train.rewards``), group advantages weigh them, and ``GRPOLoss`` (fused: no
logits) trains on them; with ``beta`` > 0 a reference model's log-probs add the KL term.

The data's micro-batches are prompts; ``prepare_step`` turns a generation batch of them into training
micro-batches once (``GenerationBatches`` says which generation and which slice of it a step trains
on), so ``steps_per_generation`` micro-batches share one generation and ``num_iterations`` optimizer
passes reuse it. When a generation serves more than one optimizer step, the log-probs at sampling
time are kept as the old policy's (the importance ratio's denominator); otherwise the ratio is 1 and
they are not computed (as TRL).

Sampling is seeded by the data position (``GenerationBatches``), so a run resumed from a checkpoint
at a generation boundary continues exactly; one resumed in the middle of a generation's
``num_iterations`` passes samples that generation again with the newer policy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass

import torch

from fastalign.data.preference import PromptCollator, tokenize_prompt_dataset
from fastalign.losses import GRPOLoss
from fastalign.losses.grpo import LOSS_TYPES
from fastalign.models.structure import IGNORE_INDEX, disable_dropout
from fastalign.train.batches import BatchPosition, MicroBatches
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import BatchPlan, Objective, Prepared, RunParts
from fastalign.train.reference import Reference, reference_model, token_logprobs_of
from fastalign.train.rewards import resolve_reward_funcs
from fastalign.train.rollout import (
    Completions,
    SamplingOptions,
    Scoring,
    decode_completions,
    generate_completions,
    position_ids_of,
    score_completions,
)

#: The key of a prompt micro-batch that says which generation it belongs to and which slice a step trains.
ROLLOUT_KEY = "fastalign_rollout"


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


#: TRL's default ``beta`` (``beta: null`` in the config): no KL term, so no reference model.
DEFAULT_BETA = 0.0


@dataclass(frozen=True)
class GRPOOptions:
    """The keys GRPO and RLOO read (TRL's GRPOConfig / RLOOConfig names)."""

    beta: float
    loss_type: list[str]
    reward_funcs: list[str]
    reward_weights: list[float] | None
    num_generations: int
    max_prompt_length: int | None
    max_completion_length: int
    truncation: bool
    temperature: float
    top_p: float
    epsilon: float
    epsilon_high: float | None
    delta: float | None
    scale_rewards: str
    advantage_estimator: str
    num_iterations: int
    steps_per_generation: int | None
    importance_sampling_level: str
    use_bias_correction_kl: bool
    mask_truncated_completions: bool
    use_vllm: bool
    ref_model_name_or_path: str | None
    disable_dropout: bool

    @classmethod
    def from_config(cls, config: TrainConfig, name: str) -> GRPOOptions:
        """The options, checked together (each key alone was checked with the config): a one-line
        ``ConfigError`` naming the key."""
        options = options_from(config, cls, beta=DEFAULT_BETA, loss_type=["dapo"], disable_dropout=False)
        if name == "rloo":
            options = dataclasses.replace(options, advantage_estimator="rloo")
        _check(options, name, config)
        return options


def _check(options: GRPOOptions, name: str, config: TrainConfig) -> None:
    if not options.reward_funcs:
        raise ConfigError(f"config key 'reward_funcs' must name at least one reward function for {name}")
    if config.per_device_train_batch_size % options.num_generations:
        raise ConfigError(
            f"config key 'per_device_train_batch_size' ({config.per_device_train_batch_size}) counts "
            f"completions and must be a multiple of num_generations ({options.num_generations})"
        )
    if len(options.loss_type) != 1 or options.loss_type[0] not in LOSS_TYPES:
        raise ConfigError(f"config key 'loss_type' for {name} must be one of {', '.join(LOSS_TYPES)}")
    if config.eval_dataset_name or config.eval_split_ratio:
        raise ConfigError(f"evaluation (eval_dataset_name, eval_split_ratio) is not available for {name}")
    steps = options.steps_per_generation
    if steps is not None and steps % config.gradient_accumulation_steps:
        raise ConfigError(
            f"config key 'steps_per_generation' ({steps}) must be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): a generation serves whole optimizer steps"
        )
    if options.use_vllm:
        found = importlib.util.find_spec("vllm") is not None
        raise ConfigError(
            "config key 'use_vllm': "
            + ("vLLM generation is not wired in yet" if found else "the vllm package is not installed")
            + "; set it to false to generate with model.generate"
        )
    if options.reward_weights is not None and len(options.reward_weights) != len(options.reward_funcs):
        raise ConfigError(
            f"config key 'reward_weights' has {len(options.reward_weights)} values for "
            f"{len(options.reward_funcs)} reward_funcs"
        )


class GRPOObjective(Objective):
    """Rollout in ``prepare_step``; ``GRPOLoss`` on prompt + completion rows in ``compute_loss``.

    A loss term is a completion or a completion token, as the loss type normalises
    (``GRPOLoss.per_token``), counted over the whole step on all ranks. So bnpo is the step's token mean,
    like dapo: TRL's bnpo averages each micro-batch over its own tokens and then the micro-batches, which
    weighs a token by its batch. The ``timing/*`` metrics are the logging rank's (rank 0's) own."""

    default_dataset = "tiny-prompts"

    def __init__(self, name: str, options: GRPOOptions, ctx: DistributedContext | None = None):
        super().__init__(ctx)
        self.name, self.options = name, options
        try:
            self.reward_funcs = resolve_reward_funcs(options.reward_funcs)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        try:
            self.loss = GRPOLoss(
                beta=options.beta,
                epsilon=options.epsilon,
                epsilon_high=options.epsilon_high,
                delta=options.delta,
                loss_type=options.loss_type[0],
                importance_sampling_level=options.importance_sampling_level,
                temperature=options.temperature,
                max_completion_length=options.max_completion_length,
                use_bias_correction_kl=options.use_bias_correction_kl,
            )
        except ValueError as error:
            raise ConfigError(f"config for {name}: {error}") from None
        self.sampling = SamplingOptions(
            options.num_generations, options.max_completion_length, options.temperature, options.top_p
        )
        self.scoring = Scoring(
            self.reward_funcs,
            options.reward_weights,
            options.num_generations,
            options.scale_rewards,
            options.advantage_estimator,
        )
        self.reference: Reference | None = None
        self.tokenizer = None  # set up with the model: it decodes completions for the reward functions
        self.conversational = False
        self._generation: tuple | None = None
        self._batches: list[dict] = []
        self._metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> GRPOObjective:
        return cls(name, GRPOOptions.from_config(config, name), ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(GRPOOptions.__dataclass_fields__)

    # --- data --------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict], tokenizer) -> list:
        return tokenize_prompt_dataset(
            rows,
            tokenizer,
            max_prompt_length=self.options.max_prompt_length,
            truncation=self.options.truncation,
        )

    def collate(self, tokenizer) -> PromptCollator:
        return PromptCollator(tokenizer.pad_token_id)

    def batches(self, examples: list, tokenizer, plan: BatchPlan) -> GenerationBatches:
        prompts = MicroBatches(
            examples,
            batch_size=plan.batch_size // self.options.num_generations,
            accumulation=self.options.steps_per_generation or plan.accumulation,  # one generation's
            pad_token_id=plan.pad_token_id,
            seed=plan.seed,
            rank=plan.rank,
            world_size=plan.world_size,
            collate=self.collate(tokenizer),
        )
        return GenerationBatches(prompts, plan.accumulation, self.options.num_iterations)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if self.options.disable_dropout:
            disable_dropout(model)
        if self.loss.config.beta > 0:
            self.reference = reference_model(model, self.options.ref_model_name_or_path, parts)
        self.tokenizer = parts.tokenizer
        self.conversational = isinstance(train[0].prompt, list)
        return Prepared(train, evaluation)

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        mask = batch["completion_mask"]
        return int(mask.sum()) if self.loss.per_token else mask.shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        generation, part, slices, _ = micro_batches[0][ROLLOUT_KEY]
        if generation != self._generation:
            # a generation that serves more than one optimizer step keeps the sampling policy's log-probs
            # (the importance ratio's denominator); otherwise the ratio is 1 and they are not computed
            keep_old_logprobs = slices > 1 or self.options.num_iterations > 1
            self._batches, self._metrics = self._rollout(model, micro_batches, keep_old_logprobs)
            self._generation = generation
        size = len(self._batches) // slices
        return self._batches[part * size : (part + 1) * size], self._metrics

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        mask = batch["completion_mask"]
        prompt_width = batch["input_ids"].shape[1] - mask.shape[1]
        completion_ids = batch["input_ids"][:, prompt_width:]
        global_count = num_items_in_batch if self.loss.uses_item_count else None

        def head(hidden, weight, bias):
            return self.loss(
                hidden[:, prompt_width - 1 : -1],
                weight,
                completion_ids,
                mask,
                batch["advantages"],
                old_per_token_logps=batch.get("old_per_token_logps"),
                ref_per_token_logps=batch.get("ref_per_token_logps"),
                bias=bias,
                num_items_in_batch=global_count,
            )

        result = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            head_fn=head,
        ).head_output
        share = self.loss_tokens(batch) / num_items_in_batch
        loss = result.loss if global_count is not None else result.loss * share
        return loss, {key: value * share for key, value in result.metrics.items()}

    # ---------------------------------------------------------------------------------------------
    def _rollout(
        self, model, prompt_batches: list[dict], keep_old_logprobs: bool
    ) -> tuple[list[dict], dict[str, float]]:
        """Generate, score and build the training micro-batches of one generation batch."""
        start = time.perf_counter()
        completions = []
        for batch in prompt_batches:
            with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []):
                torch.manual_seed(batch[ROLLOUT_KEY][3])
                completions.append(
                    generate_completions(model, batch, self.sampling, self.tokenizer, self.ctx)
                )
        generated = time.perf_counter()
        group = self.sampling.num_generations
        examples = [e for batch in prompt_batches for e in batch["examples"] for _ in range(group)]
        texts = [
            text
            for done in completions
            for text in decode_completions(done, self.tokenizer, self.conversational)
        ]
        ids = [
            row[: int(length)]
            for done in completions
            for row, length in zip(done.completion_ids.tolist(), done.lengths, strict=True)
        ]
        # every example's columns: in-memory rows need not all have the same ones
        names = dict.fromkeys(name for example in examples for name in example.columns)
        columns = {name: [example.columns.get(name) for example in examples] for name in names}
        truncated = torch.cat([done.truncated for done in completions])
        advantages, metrics = score_completions(
            self.scoring,
            [example.prompt for example in examples],
            texts,
            ids,
            columns,
            truncated,
            self.ctx,
        )
        scored = time.perf_counter()
        batches, offset = [], 0
        for done in completions:
            rows = done.completion_ids.shape[0]
            batches.append(
                self._training_batch(model, done, advantages[offset : offset + rows], keep_old_logprobs)
            )
            offset += rows
        metrics |= {
            "timing/generation_seconds": generated - start,
            "timing/rewards_seconds": scored - generated,
            "timing/logprobs_seconds": time.perf_counter() - scored,
        }
        return batches, metrics

    def _training_batch(
        self, model, done: Completions, advantages: torch.Tensor, keep_old_logprobs: bool
    ) -> dict:
        mask = done.completion_mask
        if self.options.mask_truncated_completions:
            mask = mask * (~done.truncated)[:, None]
        input_ids = torch.cat([done.prompt_ids, done.completion_ids], dim=1)
        attention_mask = torch.cat([done.prompt_mask, done.completion_mask], dim=1)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_of(attention_mask),
            "completion_mask": mask,
            "advantages": advantages.to(input_ids.device),
        }
        # position t scores token t + 1: the completion's tokens from the prompt's last position on
        scored = slice(done.prompt_ids.shape[1] - 1, -1)
        targets = torch.full_like(input_ids, IGNORE_INDEX)
        targets[:, scored] = done.completion_ids.masked_fill(done.completion_mask == 0, IGNORE_INDEX)
        temperature = self.sampling.temperature
        inputs = (input_ids, attention_mask, targets, temperature, batch["position_ids"])
        with torch.no_grad():
            if keep_old_logprobs:
                batch["old_per_token_logps"] = token_logprobs_of(model, *inputs)[:, scored]
            if self.loss.config.beta > 0:
                batch["ref_per_token_logps"] = self.reference.token_logprobs(*inputs)[:, scored]
        return {key: value.cpu() for key, value in batch.items()}
