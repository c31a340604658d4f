"""``fastalign train grpo``: TRL's ``GRPOTrainer``, on the rollout the online objectives share
(``online.py``: generation batches, sampling, rewards, evaluation, resume inside a generation).

GRPO: group advantages, and ``GRPOLoss`` with, for ``beta`` > 0, a reference model's log-probs in a
per-token KL term. ``advantage_estimator: rloo`` (a fastalign option) keeps all of that but for the
baseline, the mean of the group's other rewards; TRL's RLOO algorithm (sequence-level ratio, KL folded
into the reward) is ``fastalign train rloo``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fastalign.losses import GRPOLoss
from fastalign.losses.grpo import LOSS_TYPES
from fastalign.ops import group_advantages
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.online import RolloutObjective, RolloutOptions
from fastalign.train.rollout import Rewards, all_gather_rows


def all_gather_values(local: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Every rank's 1-D ``local`` values, of lengths that may differ, concatenated (rank 0's first): the
    completion-token entropies whose quantile is ``top_entropy_quantile``'s threshold, as TRL gathers
    them (``pad_across_processes``, then ``gather``). Needs every rank to call it, as each micro-batch's
    loss does."""
    counts = all_gather_rows(torch.tensor([local.numel()], device=local.device), ctx).tolist()
    padded = local.new_zeros(max(counts))
    padded[: local.numel()] = local
    parts = all_gather_rows(padded, ctx).view(len(counts), -1)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


#: TRL's GRPO defaults where the config leaves a key None.
GRPO_DEFAULTS = {
    "beta": 0.0,
    "num_generations": 8,
    "loss_type": ["dapo"],
    "disable_dropout": False,
}


@dataclass(frozen=True)
class GRPOOptions(RolloutOptions):
    """The keys GRPO reads besides the shared ones (TRL's GRPOConfig names)."""

    loss_type: list[str]
    delta: float | None
    shuffle_dataset: bool  # false: the prompts in the data's order (read by the batch plan)
    scale_rewards: str
    advantage_estimator: str
    importance_sampling_level: str
    use_bias_correction_kl: bool
    top_entropy_quantile: float
    router_aux_loss_coef: float | None  # a MoE policy's load-balancing loss weight (None: the model's)

    @classmethod
    def from_config(cls, config: TrainConfig, name: str) -> GRPOOptions:
        return options_from(config, cls, **GRPO_DEFAULTS)

    def check(self, name: str, config: TrainConfig) -> None:
        super().check(name, config)
        if self.beta == 0 and not self.use_bias_correction_kl:
            raise ConfigError(
                "config key 'use_bias_correction_kl' weighs the KL term, and beta is 0 (no KL term): set "
                "beta above 0, or remove it"
            )
        if len(self.loss_type) != 1 or self.loss_type[0] not in LOSS_TYPES:
            raise ConfigError(f"config key 'loss_type' for {name} must be one of {', '.join(LOSS_TYPES)}")


class GRPOObjective(RolloutObjective):
    """Group advantages; ``GRPOLoss`` on prompt + completion rows in ``compute_loss``.

    A loss term is a completion or a completion token, as the loss type normalises
    (``GRPOLoss.per_token``). So bnpo is the step's token mean, like dapo: TRL's bnpo averages each
    micro-batch over its own tokens and then the micro-batches, which weighs a token by its batch."""

    default_sampling_strategy = None  # TRL's sampler reads shuffle_dataset
    prompt_special_tokens = True

    options_class = GRPOOptions

    def __init__(
        self,
        name: str,
        options: GRPOOptions,
        ctx: DistributedContext | None = None,
        *,
        dtype: str | None = None,
    ):
        super().__init__(name, options, ctx, dtype=dtype)
        # top_entropy_quantile's threshold is over every process's tokens, as TRL's
        gather = functools.partial(all_gather_values, ctx=self.ctx) if self.ctx.enabled else None
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
                top_entropy_quantile=options.top_entropy_quantile,
                entropy_gather=gather,
            )
        except ValueError as error:
            raise ConfigError(f"config for {name}: {error}") from None
        self.normalises = self.loss.uses_item_count

    def keeps_policy_logprobs(self, reused: bool) -> bool:
        return reused

    def batch_loss_terms(self, batch: dict) -> int:
        mask = batch["completion_mask"]
        return int(mask.sum()) if self.loss.per_token else mask.shape[0]

    def advantages(self, rewards: Rewards, batches: list[dict], group: int, reused: bool):
        if group < 2:  # an evaluation with num_generations_eval 1: no group to compare with (as TRL)
            return torch.zeros_like(rewards.total), {"reward_std": 0.0, "frac_reward_zero_std": 1.0}
        result = group_advantages(
            rewards.total,
            group,
            scale_rewards=self.options.scale_rewards,
            advantage_estimator=self.options.advantage_estimator,
            backend="torch",
        )
        groups = result.group_std.numel()
        return result.advantages, {
            "reward_std": float(result.group_std.mean()),
            "frac_reward_zero_std": float(result.num_zero_std_groups) / max(groups, 1),
        }

    def loss_inputs(self, batch: dict, num_items) -> dict:
        return {
            "advantages": batch["advantages"],
            "old_per_token_logps": batch.get("old_per_token_logps"),
            "ref_per_token_logps": batch.get("ref_per_token_logps"),
            "num_items_in_batch": num_items,
        }
