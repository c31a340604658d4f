"""``fastalign train rloo``: TRL's ``RLOOTrainer`` (REINFORCE Leave-One-Out, Ahmadian et al. 2024).

The rollout is GRPO's (``RolloutObjective``: prompts, sampling, rewards, evaluation, completions log);
what differs is the algorithm, all at the sequence level:

- with ``beta`` > 0 the KL to the reference is folded into the reward: each completion's reward loses
  ``beta`` · Σ_t (log π_old − log π_ref) over its tokens (the first-order log ratio, which can be
  negative; TRL's choice, after the paper), so there is no KL term in the loss;
- its advantage is its (KL-adjusted, optionally ``reward_clip_range``-clamped) reward minus the mean of
  its group's other rewards, unscaled unless ``normalize_advantages`` standardises them over the whole
  generation batch; a completion no reward function scored gets advantage 0 and stays out of every
  baseline;
- the loss (``RLOOLoss``) clips the completion's whole importance ratio exp(log π − log π_old), and is
  the mean over completions.

Defaults are TRL's RLOOConfig's: ``num_generations`` 2, ``beta`` 0.05 (so a reference model is loaded),
``max_completion_length`` 512.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.losses.rloo import RLOOLoss
from fastalign.ops import group_advantages
from fastalign.ops.grpo import nan_std, normalize_advantages
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.online import RolloutObjective, RolloutOptions
from fastalign.train.rollout import Rewards, all_gather_rows

#: TRL's RLOO defaults where the config leaves a key None.
RLOO_DEFAULTS = {"beta": 0.05, "num_generations": 2, "disable_dropout": False}


@dataclass(frozen=True)
class RLOOOptions(RolloutOptions):
    """The keys RLOO reads besides the shared ones (TRL's RLOOConfig names)."""

    normalize_advantages: bool
    shuffle_dataset: bool  # false: the prompts in the data's order (read by the batch plan)
    reward_clip_range: list[float] | None
    router_aux_loss_coef: float | None  # a MoE policy's load-balancing loss weight (None: the model's)

    @classmethod
    def from_config(cls, config: TrainConfig, name: str) -> RLOOOptions:
        return options_from(config, cls, **RLOO_DEFAULTS)


class RLOOObjective(RolloutObjective):
    """Leave-one-out advantages of KL-adjusted rewards; ``RLOOLoss`` on prompt + completion rows. A loss
    term is a completion (the loss is a mean over completions, as TRL's)."""

    default_sampling_strategy = None  # TRL's sampler reads shuffle_dataset
    prompt_special_tokens = True

    options_class = RLOOOptions
    options: RLOOOptions

    def __init__(
        self,
        name: str,
        options: RLOOOptions,
        ctx: DistributedContext | None = None,
        *,
        dtype: str | None = None,
    ):
        super().__init__(name, options, ctx, dtype=dtype)
        try:
            self.loss = RLOOLoss(
                epsilon=options.epsilon, epsilon_high=options.epsilon_high, temperature=options.temperature
            )
        except ValueError as error:
            raise ConfigError(f"config for {name}: {error}") from None

    def keeps_policy_logprobs(self, reused: bool) -> bool:
        # the KL penalty needs the sampling policy's log-probs even when the ratio does not
        return reused or self.options.beta > 0

    def advantages(self, rewards: Rewards, batches: list[dict], group: int, reused: bool):
        total, metrics = rewards.total, {}
        if self.options.reward_clip_range is not None:
            low, high = self.options.reward_clip_range
            total = total.clamp(min=low, max=high)
        if self.options.beta > 0:
            kl, tokens = self._sequence_kl(batches)
            total = total - self.options.beta * kl
            metrics["kl"] = float(kl.sum() / tokens.sum().clamp(min=1.0))
        for batch in batches:  # the loss takes sequence log-probs, and no reference's
            batch.pop("ref_per_token_logps", None)
            old = batch.pop("old_per_token_logps", None)
            if reused:
                batch["old_logps"] = (old * batch["completion_mask"]).sum(-1)
        if group < 2:  # an evaluation with num_generations_eval 1: no baseline (as TRL)
            advantages, zero_std = torch.zeros_like(total), 1.0
        else:
            result = group_advantages(
                total, group, scale_rewards="none", advantage_estimator="rloo", backend="torch"
            )
            advantages = result.advantages
            zero_std = float(result.num_zero_std_groups) / max(result.group_std.numel(), 1)
            if self.options.normalize_advantages:
                advantages = normalize_advantages(advantages, ~torch.isnan(total))
        reward_std = float(nan_std(rewards.total))  # TRL's: over the batch, before the KL and the clip
        return advantages, {"reward_std": reward_std, "frac_reward_zero_std": zero_std, **metrics}

    def _sequence_kl(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every completion's Σ_t (log π_old − log π_ref) over its (loss) tokens, and its token count,
        gathered from every rank like the rewards: [N] each."""
        local = []
        for batch in batches:
            mask = batch["completion_mask"] != 0
            difference = batch["old_per_token_logps"] - batch["ref_per_token_logps"]
            local.append(torch.stack([torch.where(mask, difference, 0.0).sum(-1), mask.sum(-1).float()], 1))
        everything = all_gather_rows(torch.cat(local).to(self.ctx.device), self.ctx).cpu()
        return everything[:, 0], everything[:, 1]

    def loss_inputs(self, batch: dict, num_items) -> dict:
        return {"advantages": batch["advantages"], "old_logps": batch.get("old_logps")}
