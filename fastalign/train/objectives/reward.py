"""``fastalign train reward``: reward modelling from preference pairs, TRL's ``RewardTrainer``.

The model is the checkpoint's body under transformers' ``AutoModelForSequenceClassification`` with one
label (``task`` sequence_classification): a ``score`` head, [hidden → 1], newly drawn for a causal-LM
checkpoint, read at each row's last non-pad token (transformers finds it from ``config.pad_token_id``,
which ``setup`` sets to the tokenizer's, as TRL does). Under LoRA the head trains in full (peft's SEQ_CLS
task type saves it with the adapter). No LM head, so no fused loss head; ``use_liger_kernel`` still
patches the body's RMSNorm, RoPE and gated MLP.

Rows are TRL's preference format; each side of a pair is one whole sequence (``fastalign.data.reward``).
A micro-batch of P pairs is one forward of 2P rows, chosen first. The loss is Bradley–Terry with the
optional ``margin`` column and ``center_rewards_coefficient`` (``fastalign.losses.reward``); a loss term
is a pair, so the step's loss is the mean over all its pairs however they are split. Metrics are TRL's:
``accuracy``, ``margin``, ``min_reward``, ``mean_reward``, ``max_reward``; the extremes are each
micro-batch's over all ranks (TRL gathers before taking them), averaged over the step's micro-batches
(in evaluation, each batch's own, weighted by its size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.data.reward import RewardCollator, tokenize_reward_dataset
from fastalign.losses.reward import bradley_terry_loss, reward_metrics
from fastalign.models.structure import base_model, disable_dropout
from fastalign.train.config import TrainConfig, options_from
from fastalign.train.distributed import DistributedContext, all_reduce_min_max
from fastalign.train.objectives.base import Objective, Prepared, RunParts


@dataclass(frozen=True)
class RewardOptions:
    """The keys reward modelling reads (TRL's RewardConfig names)."""

    max_length: int  # pairs with a longer chosen or rejected sequence are left out, as TRL filters them
    center_rewards_coefficient: float | None
    disable_dropout: bool
    chat_template_kwargs: dict | None  # template variables of conversational rows

    @classmethod
    def from_config(cls, config: TrainConfig) -> RewardOptions:
        return options_from(config, cls, disable_dropout=True)


class RewardObjective(Objective):
    """Bradley–Terry on the scores of micro-batches of P pairs: rows 0..P-1 chosen, P..2P-1 rejected."""

    rows_per_example = 2  # the chosen and the rejected completion of a pair, one forward

    default_dataset = "tiny-preference"
    default_learning_rate = 1e-4  # TRL's RewardConfig
    needs_fused_head = False
    task = "sequence_classification"

    def __init__(self, options: RewardOptions, ctx: DistributedContext | None = None):
        super().__init__(ctx)
        self.options = options

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> RewardObjective:
        return cls(RewardOptions.from_config(config), ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(RewardOptions.__dataclass_fields__)

    # --- data --------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict], tokenizer) -> list:
        return tokenize_reward_dataset(
            rows,
            tokenizer,
            max_length=self.options.max_length,
            chat_template_kwargs=self.options.chat_template_kwargs,
        )

    def collate(self, tokenizer) -> RewardCollator:
        return RewardCollator(tokenizer.pad_token_id)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if self.options.disable_dropout:
            disable_dropout(model)
        # the score is read at the last token that is not padding: the model must know the tokenizer's pad
        base_model(model).config.get_text_config().pad_token_id = parts.tokenizer.pad_token_id
        return Prepared(train, evaluation)

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        pairs = self.loss_tokens(batch)
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        scores = scores.squeeze(-1).float()
        chosen, rejected = scores[:pairs], scores[pairs:]
        terms = bradley_terry_loss(
            chosen, rejected, batch.get("margin"), self.options.center_rewards_coefficient
        )
        metrics = reward_metrics(chosen, rejected)
        if model.training:  # every rank runs each micro-batch of a step (evaluation pads with fillers)
            metrics["min_reward"], metrics["max_reward"] = all_reduce_min_max(scores, self.ctx)
        share = pairs / num_items_in_batch
        return terms.mean() * share, {key: value * share for key, value in metrics.items()}
