"""``fastalign train online_dpo``: TRL's ``OnlineDPOTrainer`` (online AI feedback, Guo et al. 2024).

Rows are prompts (TRL's prompt-only format; other columns reach the reward functions). Every step the
current policy samples two completions of each prompt with GRPO's rollout (``sample_completions``: the
same seeding by data position, sampling options and FSDP2 generation), the reward functions score them
(``score_completions``; TRL's weighted ``nansum`` over the functions, so a completion none applies to
scores 0, and ``missing_eos_penalty`` off the score of one that did not end), and the better of the two is
the pair's chosen completion (on a tie, the first sampled, as TRL). Then a DPO step on the pairs:
``loss_type`` sigmoid, −log σ(β·m), or ipo, (m − 1/(2β))², where m is the chosen completion's log-ratio
log π/π_ref minus the rejected one's (summed over each completion's tokens, up to and including its EOS;
the ipo loss on sums, not DPO's length-normalised means, as TRL's online trainer). The reference is DPO's
(``fastalign.train.reference``): a frozen copy of the initial policy (or ``ref_model_name_or_path``), or
under LoRA the policy with its adapters off; its log-probs are taken once when the pairs are made.

Log-probs are at temperature 1 (TRL scores its samples with the raw logits, whatever ``temperature``
sampled them), from the fused head: the policy's inside the model's forward (``head_fn``), never [tokens,
vocab] logits. A sequence longer than ``max_length`` loses the prompt's first tokens, as TRL's.

A loss term is a pair (a prompt): the step's loss is the mean over all its pairs, however the micro-batches
and ranks split them. Metrics are TRL's: ``objective/kl`` Σ_t log π/π_ref, ``objective/entropy``
−Σ_t log π, ``objective/non_score_reward`` −β·KL and ``objective/rlhf_reward`` score + that, each a mean
over completions (their sums run over a completion's tokens, not also over the padding after its EOS as
TRL's do); ``objective/scores`` and ``objective/scores_margin`` (chosen − rejected), and
``val/contain_eos_token``, over the whole step on all ranks; DPO's ``rewards/*`` and ``logps/*`` over
pairs; and ``beta``. Evaluation (held-out prompts) samples and scores pairs the same way and logs the
loss and metrics with an ``eval_`` prefix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fastalign.models.structure import IGNORE_INDEX
from fastalign.ops import token_logprobs
from fastalign.ops.preference import pair_loss
from fastalign.train.config import ConfigError, TrainConfig, model_option, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import BatchPlan
from fastalign.train.objectives.online import (
    GenerationBatches,
    PromptObjective,
    check_generation_keys,
    sample_completions,
    score_completions,
)
from fastalign.train.rollout import Completions, SamplingKeys, SamplingOptions, scoring_batch

#: TRL's OnlineDPOConfig defaults where the config leaves a key None.
ONLINE_DPO_DEFAULTS = {
    "temperature": 0.9,
    "max_length": 512,
    "beta": 0.1,
    "loss_type": ["sigmoid"],
    "disable_dropout": True,
    "max_new_tokens": 64,
}
#: TRL's online DPO losses.
LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class OnlineDPOOptions(SamplingKeys):
    """The keys online DPO reads (TRL's OnlineDPOConfig names; ``ref_model_name_or_path`` is DPO's)."""

    beta: float
    loss_type: list[str]
    reward_funcs: list[str]
    reward_weights: list[float] | None
    missing_eos_penalty: float | None
    max_new_tokens: int
    max_length: int
    max_prompt_length: int | None
    truncation: bool
    chat_template_kwargs: dict[str, Any] | None
    use_vllm: bool
    ref_model_name_or_path: str | None
    disable_dropout: bool

    @classmethod
    def from_config(cls, config: TrainConfig) -> OnlineDPOOptions:
        options = options_from(config, cls, **ONLINE_DPO_DEFAULTS)
        options.check()
        return options

    def check(self) -> None:
        """The checks of options together: a one-line ``ConfigError`` naming the key."""
        if not self.reward_funcs:
            raise ConfigError(
                "config key 'reward_funcs' must name at least one reward function for online_dpo (they "
                "rank each prompt's two completions)"
            )
        if len(self.loss_type) != 1 or self.loss_type[0] not in LOSS_TYPES:
            raise ConfigError(
                f"config key 'loss_type' for online_dpo must be one of {', '.join(LOSS_TYPES)} (one value), "
                f"got {self.loss_type!r}"
            )
        if self.truncation and self.max_prompt_length is None:
            raise ConfigError(
                "config key 'truncation' is read by online_dpo only with max_prompt_length (it truncates "
                "prompts to that length): set max_prompt_length, or remove truncation"
            )
        if self.loss_type == ["ipo"] and self.beta == 0:
            raise ConfigError("config key 'beta' must be positive for loss_type ipo, whose target is 1/(2β)")
        if self.max_new_tokens >= self.max_length:
            raise ConfigError(
                f"config key 'max_new_tokens' ({self.max_new_tokens}) must be below max_length "
                f"({self.max_length}): a longer completion would leave no prompt to score it from"
            )
        check_generation_keys(self.use_vllm, self.generation_kwargs, self.reward_funcs, self.reward_weights)

    @property
    def sampling(self) -> SamplingOptions:
        """Two completions of each prompt, with TRL's sampling options."""
        return SamplingOptions.of(self, 2, self.max_new_tokens)


class OnlineDPOObjective(PromptObjective):
    """Pairs sampled and ranked in ``prepare_step``; the DPO loss on them in ``compute_loss``. A training
    micro-batch holds P pairs as 2P prompt + completion rows, the chosen completions first."""

    rows_per_example = 2  # the chosen and the rejected completion of a pair, one forward

    default_learning_rate = 5e-7  # TRL's OnlineDPOConfig
    shared_defaults: ClassVar[dict[str, Any]] = {
        key: ONLINE_DPO_DEFAULTS[key] for key in ("max_length", "temperature")
    }

    def __init__(
        self, options: OnlineDPOOptions, ctx: DistributedContext | None = None, *, dtype: str | None = None
    ):
        super().__init__(options, options.sampling, ctx, dtype)

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> OnlineDPOObjective:
        return cls(OnlineDPOOptions.from_config(config), ctx, dtype=model_option(config, "dtype"))

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(OnlineDPOOptions.__dataclass_fields__)

    # --- data --------------------------------------------------------------------------------------
    def batches(self, examples: list, tokenizer, plan: BatchPlan) -> GenerationBatches:
        """``per_device_train_batch_size`` prompts a micro-batch (as TRL: each makes one pair), every
        step's micro-batches one generation, seeded by their position in the data."""
        return GenerationBatches(
            super().batches(examples, tokenizer, plan), plan.accumulation, num_iterations=1
        )

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        rows = batch["input_ids"].shape[0]
        return rows // 2 if "completion_mask" in batch else rows  # pairs; an evaluation batch: prompts

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        return self._pairs(model, micro_batches)

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        if "completion_mask" not in batch:
            return self._evaluate(model, batch)
        mask = batch["completion_mask"]
        prompt_width = batch["input_ids"].shape[1] - mask.shape[1]
        targets = batch["input_ids"][:, prompt_width:].masked_fill(mask == 0, IGNORE_INDEX)

        def head(hidden, weight, bias, softcap=None):
            tokens = token_logprobs(hidden[:, prompt_width - 1 : -1], weight, targets, bias, softcap=softcap)
            return self._loss(tokens.sum(-1), batch["ref_logps"], batch["scores"])

        loss, metrics = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            head_fn=head,
        ).head_output
        count = num_items_in_batch.to(loss.device)
        return loss / count, {key: value / count for key, value in metrics.items()}

    def _loss(
        self, logps: torch.Tensor, ref_logps: torch.Tensor, scores: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The sum over the micro-batch's pairs of the DPO loss and of each metric's per-pair value, from
        the 2P completions' policy and reference log-probs and scores (chosen first). A completion metric
        (TRL's mean over completions) is a pair's mean over its two."""
        beta = self.options.beta
        ratios = logps - ref_logps  # log π/π_ref of each completion
        chosen, rejected = ratios.chunk(2)
        loss = pair_loss(chosen, rejected, self.options.loss_type[0], beta=beta).sum()
        ratios, logps = ratios.detach(), logps.detach()
        chosen, rejected = chosen.detach(), rejected.detach()
        policy_chosen, policy_rejected = logps.chunk(2)
        non_score = -beta * ratios
        margins = beta * (chosen - rejected)
        metrics = {
            "objective/kl": ratios.sum() / 2,
            "objective/entropy": -logps.sum() / 2,
            "objective/non_score_reward": non_score.sum() / 2,
            "objective/rlhf_reward": (scores + non_score).sum() / 2,
            "rewards/chosen": beta * chosen.sum(),
            "rewards/rejected": beta * rejected.sum(),
            "rewards/accuracies": (margins > 0).float().sum(),
            "rewards/margins": margins.sum(),
            "logps/chosen": policy_chosen.sum(),
            "logps/rejected": policy_rejected.sum(),
        }
        return loss, metrics

    # ---------------------------------------------------------------------------------------------
    def _pairs(self, model, prompt_batches: list[dict]) -> tuple[list[dict], dict[str, float]]:
        """Sample two completions of every prompt, score and rank them, and build the training
        micro-batches (chosen rows, then rejected) with the reference's log-probs; and the step's score
        metrics, over every rank's completions."""
        completions = sample_completions(model, prompt_batches, self.sampling, self.tokenizer, self.ctx)
        rewards, _, _ = score_completions(
            self.reward_funcs,
            self.options.reward_weights,
            prompt_batches,
            completions,
            2,
            self.tokenizer,
            self.conversational,
            self.ctx,
        )
        scores = rewards.total.nan_to_num(0.0)  # TRL's nansum: 0 where no function applied
        if self.options.missing_eos_penalty is not None:
            scores = scores - self.options.missing_eos_penalty * rewards.truncated.float()
        local, batches, offset = scores[rewards.rows], [], 0
        for done in completions:
            rows = done.prompt_ids.shape[0]
            batches.append(self._pair_batch(done, local[offset : offset + rows]))
            offset += rows
        first, second = scores[0::2], scores[1::2]  # a prompt's two completions are adjacent
        metrics = {
            "objective/scores": float(scores.mean()),
            "objective/scores_margin": float((first - second).abs().mean()),  # chosen − rejected
            "val/contain_eos_token": float((~rewards.truncated).float().mean()),
            "beta": self.options.beta,
        }
        return batches, metrics

    def _pair_batch(self, done: Completions, scores: torch.Tensor) -> dict:
        """One micro-batch's pairs: its 2P completions (a prompt's two adjacent) reordered chosen first,
        the prompts cut to fit ``max_length``, with their scores and the reference's log-probs."""
        first_wins = scores[0::2] >= scores[1::2]
        firsts = torch.arange(first_wins.numel()) * 2
        order = torch.cat([firsts + (~first_wins).long(), firsts + first_wins.long()])
        rows = order.to(done.prompt_ids.device)
        done = Completions(*(getattr(done, field.name)[rows] for field in dataclasses.fields(Completions)))
        cut = max(done.prompt_ids.shape[1] + done.completion_ids.shape[1] - self.options.max_length, 0)
        done = dataclasses.replace(
            done, prompt_ids=done.prompt_ids[:, cut:], prompt_mask=done.prompt_mask[:, cut:]
        )
        batch, targets, scored = scoring_batch(done, done.completion_mask)
        assert self.reference is not None  # set up before any step
        ref = self.reference.token_logprobs(
            batch["input_ids"], batch["attention_mask"], targets, position_ids=batch["position_ids"]
        )
        batch |= {"ref_logps": ref[:, scored].sum(-1).float(), "scores": scores[order]}
        return {key: value.cpu() for key, value in batch.items()}

    def _evaluate(self, model, prompts: dict) -> tuple[torch.Tensor, dict]:
        """An evaluation micro-batch of prompts: sample, rank and score its pairs, and return their mean
        loss and metrics."""
        (batch,), metrics = self._pairs(model, [prompts])
        batch = {key: value.to(self.ctx.device) for key, value in batch.items()}
        loss, loss_metrics = self.compute_loss(model, batch, torch.tensor(self.loss_tokens(batch)))
        return loss, {**loss_metrics, **metrics}
