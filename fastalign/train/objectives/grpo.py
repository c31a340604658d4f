"""GRPO (and RLOO): the policy samples completions of each prompt, reward functions score them, group
advantages weigh them, and ``GRPOLoss`` (fused: no logits) trains on them.

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

import time
from dataclasses import dataclass

import torch

from fastalign.losses import GRPOLoss
from fastalign.train.batches import BatchPosition, MicroBatches
from fastalign.train.distributed import DistributedContext
from fastalign.train.reference import Reference, token_logprobs_of
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
            {**batch, ROLLOUT_KEY: ((position.epoch, generation), step % self.slices, self.slices,
                                    self.prompts.seed * 1_000_003 + first + k * self.world_size + self.rank)}
            for k, batch in enumerate(batches)
        ]  # fmt: skip

    def advance(self, position: BatchPosition) -> BatchPosition:
        step = position.step_in_epoch + 1
        if step == self.steps_per_epoch:
            return BatchPosition(position.epoch + 1, 0)
        return BatchPosition(position.epoch, step)


@dataclass(frozen=True)
class GRPOSettings:
    sampling: SamplingOptions
    scoring: Scoring
    mask_truncated_completions: bool
    keep_old_logprobs: bool  # a generation serves more than one optimizer step
    conversational: bool


class GRPOObjective:
    """Rollout in ``prepare_step``; ``GRPOLoss`` on prompt + completion rows in ``compute_loss``.

    A loss term is a completion (grpo, dr_grpo) or a completion token (bnpo, dapo, cispo), counted over
    the whole step on all ranks. So bnpo is the step's token mean, like dapo: TRL's bnpo averages each
    micro-batch over its own tokens and then the micro-batches, which weighs a token by its batch. The
    ``timing/*`` metrics are the logging rank's (rank 0's) own."""

    def __init__(
        self,
        loss: GRPOLoss,
        settings: GRPOSettings,
        tokenizer,
        ctx: DistributedContext,
        reference: Reference | None = None,
    ):
        if loss.config.beta > 0 and reference is None:
            raise ValueError("beta > 0 needs a reference model (the KL term): none was set up")
        self.loss, self.settings, self.tokenizer, self.ctx = loss, settings, tokenizer, ctx
        self.reference = reference
        self._generation: tuple | None = None
        self._batches: list[dict] = []
        self._metrics: dict[str, float] = {}

    # the loss's normalisation decides what a loss term is: a completion, or a completion token
    def _per_token(self) -> bool:
        return self.loss.loss_type in ("bnpo", "dapo", "cispo")

    def loss_tokens(self, batch: dict) -> int:
        mask = batch["completion_mask"]
        return int(mask.sum()) if self._per_token() else mask.shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        generation, part, slices, _ = micro_batches[0][ROLLOUT_KEY]
        if generation != self._generation:
            self._batches, self._metrics = self._rollout(model, micro_batches)
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
                hidden[:, prompt_width - 1 : -1], weight, completion_ids, mask, batch["advantages"],
                old_per_token_logps=batch.get("old_per_token_logps"),
                ref_per_token_logps=batch.get("ref_per_token_logps"), bias=bias,
                num_items_in_batch=global_count,
            )  # fmt: skip

        result = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"], head_fn=head,
        ).head_output  # fmt: skip
        share = self.loss_tokens(batch) / num_items_in_batch
        loss = result.loss if global_count is not None else result.loss * share
        return loss, {key: value * share for key, value in result.metrics.items()}

    # ---------------------------------------------------------------------------------------------
    def _rollout(self, model, prompt_batches: list[dict]) -> tuple[list[dict], dict[str, float]]:
        """Generate, score and build the training micro-batches of one generation batch."""
        start = time.perf_counter()
        completions = []
        for batch in prompt_batches:
            with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []):
                torch.manual_seed(batch[ROLLOUT_KEY][3])
                completions.append(
                    generate_completions(model, batch, self.settings.sampling, self.tokenizer, self.ctx)
                )
        generated = time.perf_counter()
        group = self.settings.sampling.num_generations
        examples = [e for batch in prompt_batches for e in batch["examples"] for _ in range(group)]
        texts = [
            text
            for done in completions
            for text in decode_completions(done, self.tokenizer, self.settings.conversational)
        ]
        ids = [
            row[: int(length)]
            for done in completions
            for row, length in zip(done.completion_ids.tolist(), done.lengths, strict=True)
        ]
        columns = {name: [example.columns[name] for example in examples] for name in examples[0].columns}
        truncated = torch.cat([done.truncated for done in completions])
        advantages, metrics = score_completions(
            self.settings.scoring, [example.prompt for example in examples], texts, ids, columns, truncated,
            self.ctx,
        )  # fmt: skip
        scored = time.perf_counter()
        batches, offset = [], 0
        for done in completions:
            rows = done.completion_ids.shape[0]
            batches.append(self._training_batch(model, done, advantages[offset : offset + rows]))
            offset += rows
        metrics |= {
            "timing/generation_seconds": generated - start,
            "timing/rewards_seconds": scored - generated,
            "timing/logprobs_seconds": time.perf_counter() - scored,
        }
        return batches, metrics

    def _training_batch(self, model, done: Completions, advantages: torch.Tensor) -> dict:
        mask = done.completion_mask
        if self.settings.mask_truncated_completions:
            mask = mask * (~done.truncated)[:, None]
        input_ids = torch.cat([done.prompt_ids, done.completion_ids], dim=1)
        attention_mask = torch.cat([done.prompt_mask, done.completion_mask], dim=1)
        batch = {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_of(attention_mask), "completion_mask": mask,
            "advantages": advantages.to(input_ids.device),
        }  # fmt: skip
        # position t scores token t + 1: the completion's tokens from the prompt's last position on
        scored = slice(done.prompt_ids.shape[1] - 1, -1)
        targets = torch.full_like(input_ids, -100)
        targets[:, scored] = done.completion_ids.masked_fill(done.completion_mask == 0, -100)
        temperature = self.settings.sampling.temperature
        inputs = (input_ids, attention_mask, targets, temperature, batch["position_ids"])
        with torch.no_grad():
            if self.settings.keep_old_logprobs:
                batch["old_per_token_logps"] = token_logprobs_of(model, *inputs)[:, scored]
            if self.loss.config.beta > 0:
                batch["ref_per_token_logps"] = self.reference.token_logprobs(*inputs)[:, scored]
        return {key: value.cpu() for key, value in batch.items()}
