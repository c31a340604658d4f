"""``fastalign train ppo``: PPO with a critic, TRL's former ``PPOTrainer`` (trl 0.11-0.19; TRL 1.16 has none).

The rollout is GRPO's (``RolloutObjective``: prompts, seeded sampling with ``model.generate``, scoring by
``reward_funcs``, evaluation, completions log), with one completion per prompt. Then, per generation batch:

- the score of a completion is its (weighted) reward, less ``missing_eos_penalty`` when it has no EOS
  (a completion no reward function scored counts 0);
- per-token rewards: −``kl_coef``·KL(π_old ‖ π_ref) on every completion token (``kl_estimator`` k1 or
  k3), the score added at the last token; ``whiten_rewards`` scales them to unit variance;
- the critic's values V_t of every completion token, and GAE (``gamma``, ``lam``; value 0 after the last
  token) give advantages and returns; the advantages are whitened over the batch;
- ``num_ppo_epochs`` passes over the batch, each ``num_mini_batches`` optimizer steps of
  ``gradient_accumulation_steps`` micro-batches: the clipped policy loss (``cliprange``, fused from the
  hidden states: no logits) plus ``vf_coef`` × the clipped value loss (``cliprange_value``).

The critic is TRL's ``value_model``: ``AutoModelForSequenceClassification`` with one label on
``value_model_path`` (null: the policy's checkpoint), its ``score`` head newly drawn and applied to the
hidden state of every token (never a vocabulary). As TRL's ``PolicyAndValueWrapper``, it is attached to
the policy (as ``VALUE_MODEL``) for the run, so one optimizer, one gradient clipping and every checkpoint
take both; it is detached when training ends, so the exported model is the policy alone. Checkpoints hold
the critic and its optimizer state: a run resumed at a generation boundary continues exactly.

This first version trains in one process, without LoRA and without 4-bit weights (one-line
``ConfigError``s naming the key otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fastalign.losses.ppo import PPOLoss, shaped_rewards, value_loss, whiten
from fastalign.models.structure import disable_dropout
from fastalign.ops import generalized_advantage_estimation
from fastalign.train.config import ConfigError, TrainConfig, model_option, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.objectives.base import Prepared, RunParts
from fastalign.train.objectives.grpo import RolloutObjective, RolloutOptions
from fastalign.train.policy import prepare_policy
from fastalign.train.rollout import Rewards

#: The name of the critic as a submodule of the policy during training (its checkpoint keys' prefix).
VALUE_MODEL = "ppo_value_model"

#: TRL's PPO defaults where the config leaves a key None (its trainer disables dropout in every model).
PPO_DEFAULTS = {"disable_dropout": True}


@dataclass(frozen=True)
class PPOOptions(RolloutOptions):
    """The keys PPO reads (TRL's former PPOConfig names). The rollout's GRPO-named options that PPO
    spells its own way are derived from its keys (``DERIVED``), never read."""

    model_name_or_path: str
    value_model_path: str | None
    missing_eos_penalty: float | None
    num_ppo_epochs: int
    num_mini_batches: int
    whiten_rewards: bool
    kl_coef: float
    kl_estimator: str
    cliprange: float
    vf_coef: float
    cliprange_value: float
    gamma: float
    lam: float

    #: Rollout options PPO sets from its own keys (or fixes: one completion per prompt).
    DERIVED = (
        "beta",
        "epsilon",
        "epsilon_high",
        "num_iterations",
        "steps_per_generation",
        "num_generations",
        "num_generations_eval",
        "mask_truncated_completions",
    )

    @classmethod
    def from_config(cls, config: TrainConfig, name: str) -> PPOOptions:
        read = options_from(config, cls, **PPO_DEFAULTS)
        return dataclasses.replace(
            read,
            beta=read.kl_coef,  # the rollout loads a reference when it is > 0
            epsilon=read.cliprange,
            epsilon_high=None,
            num_iterations=read.num_ppo_epochs,
            steps_per_generation=read.num_mini_batches * config.gradient_accumulation_steps,
            num_generations=1,
            num_generations_eval=None,
            mask_truncated_completions=False,
        )

    def check(self, name: str, config: TrainConfig) -> None:
        super().check(name, config)
        if config.use_peft:
            raise ConfigError(
                "config key 'use_peft': ppo trains its critic in full beside the policy and has no LoRA "
                "path yet; set use_peft to false"
            )
        if config.quantization:
            raise ConfigError(
                f"config key 'quantization' ({config.quantization!r}): ppo trains in full precision"
            )


class PPOObjective(RolloutObjective):
    """GAE advantages from a critic; the clipped policy loss (``PPOLoss``) plus the clipped value loss.

    A loss term is a completion: each micro-batch's losses are means over its tokens, averaged over the
    step's micro-batches (TRL's ``masked_mean`` per micro-batch under gradient accumulation)."""

    options_class = PPOOptions
    options: PPOOptions
    default_learning_rate = 5e-5  # OnPolicyConfig keeps TrainingArguments' default

    def __init__(
        self, name: str, options: PPOOptions, config: TrainConfig, ctx: DistributedContext | None = None
    ):
        super().__init__(name, options, ctx, dtype=model_option(config, "dtype"))
        if self.ctx.enabled:
            raise ConfigError(
                "config key 'value_model_path': ppo's critic is not sharded yet (FSDP2); run ppo in one "
                "process"
            )
        self.loss = PPOLoss(cliprange=options.cliprange, temperature=options.temperature)
        self.config = config  # the critic loads as the policy did (dtype, attention, kernels, checkpointing)
        self.critic: torch.nn.Module | None = None

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> PPOObjective:
        options = PPOOptions.from_config(config, name)
        options.check(name, config)
        return cls(name, options, config, ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(PPOOptions.__dataclass_fields__) - set(PPOOptions.DERIVED)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        prepared = super().setup(model, train, evaluation, parts)
        path = self.options.value_model_path or self.options.model_name_or_path
        critic, _ = load_model_and_tokenizer(path, None, self.ctx.device, task="sequence_classification")
        critic_config = dataclasses.replace(self.config, model_name_or_path=path, use_peft=False)
        critic = prepare_policy(
            critic, critic_config, self.ctx, needs_fused_head=False, task="sequence_classification"
        )
        if self.options.disable_dropout:
            disable_dropout(critic)
        model.add_module(VALUE_MODEL, critic)
        self.critic = critic
        return dataclasses.replace(prepared, callbacks=[*prepared.callbacks, DetachCritic()])

    # --- the rollout's advantages ------------------------------------------------------------------
    def keeps_policy_logprobs(self, reused: bool) -> bool:
        return True  # the KL reward and the ratio's denominator

    def values(self, batch: dict) -> torch.Tensor:
        """The critic's value [B, T] fp32 of each completion token's state (the position before it)."""
        assert self.critic is not None, "setup() attaches the critic"
        width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        body = getattr(self.critic, self.critic.base_model_prefix)
        hidden = body(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).last_hidden_state
        return self.critic.score(hidden[:, width - 1 : -1]).squeeze(-1).float()

    def advantages(self, rewards: Rewards, batches: list[dict], group: int, reused: bool):
        """Per-token advantages, returns and the rollout's values into each batch; returns each
        completion's advantage at its first token (the completions log's) and TRL's ``objective/*``
        metrics."""
        device = self.ctx.device
        scores = torch.nan_to_num(rewards.total[rewards.rows], nan=0.0)
        if self.options.missing_eos_penalty is not None:
            scores = scores - self.options.missing_eos_penalty * rewards.truncated[rewards.rows].float()
        shaped, masks, offset = [], [], 0
        for batch in batches:
            mask = batch["completion_mask"].to(device) != 0
            rows = mask.shape[0]
            ref = batch.get("ref_per_token_logps")
            shaped.append(
                shaped_rewards(
                    scores[offset : offset + rows].to(device),
                    batch["old_per_token_logps"].to(device),
                    None if ref is None else ref.to(device),
                    mask,
                    self.options.kl_coef,
                    self.options.kl_estimator,
                )
            )
            masks.append(mask)
            offset += rows
        token_rewards = [part.rewards for part in shaped]
        if self.options.whiten_rewards:
            token_rewards = _whiten_masked(token_rewards, masks, shift_mean=False)
        advantages, returns = [], []
        with torch.no_grad():
            for batch, reward, mask in zip(batches, token_rewards, masks, strict=True):
                batch["values"] = self.values({key: value.to(device) for key, value in batch.items()})
                gae = generalized_advantage_estimation(
                    reward, batch["values"], mask, self.options.gamma, self.options.lam
                )
                advantages.append(gae[0])
                returns.append(gae[1])
        advantages = _whiten_masked(advantages, masks, shift_mean=True)
        for batch, advantage, ret in zip(batches, advantages, returns, strict=True):
            batch["token_advantages"], batch["returns"] = advantage.cpu(), ret.cpu()
            batch["values"] = batch["values"].cpu()
            batch.pop("ref_per_token_logps", None)  # folded into the rewards
        kl = torch.cat([part.kl.sum(-1) for part in shaped])
        non_score = torch.cat([part.non_score_reward.sum(-1) for part in shaped])
        entropy = torch.cat(
            [
                -torch.where(mask, batch["old_per_token_logps"].to(device), 0.0).sum(-1)
                for batch, mask in zip(batches, masks, strict=True)
            ]
        )
        first = torch.zeros_like(rewards.total)
        first[rewards.rows] = torch.cat([advantage[:, 0] for advantage in advantages]).cpu()
        return first, {
            "objective/kl": float(kl.mean()),
            "objective/entropy": float(entropy.mean()),
            "objective/non_score_reward": float(non_score.mean()),
            "objective/rlhf_reward": float(non_score.mean() + scores.mean()),
            "objective/scores": float(scores.mean()),
            "val/num_eos_tokens": float((~rewards.truncated).sum()),
        }

    # --- the loss ----------------------------------------------------------------------------------
    def loss_inputs(self, batch: dict, num_items) -> dict:
        return {"advantages": batch["token_advantages"], "old_logps": batch["old_per_token_logps"]}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        """The policy loss (``RolloutObjective``'s fused head) plus ``vf_coef`` × the value loss, each
        this micro-batch's mean times its share of the step's completions."""
        if "completion_mask" not in batch:
            return self._evaluate(model, batch)
        policy_loss, metrics = super().compute_loss(model, batch, num_items_in_batch)
        vf_loss, vf_clipfrac = value_loss(
            self.values(batch),
            batch["values"],
            batch["returns"],
            batch["completion_mask"] != 0,
            self.options.cliprange_value,
        )
        share = self.batch_loss_terms(batch) / num_items_in_batch
        metrics |= {"loss/value_avg": vf_loss.detach() * share, "val/clipfrac_avg": vf_clipfrac * share}
        return policy_loss + self.options.vf_coef * vf_loss * share, metrics


def _whiten_masked(
    tensors: list[torch.Tensor], masks: list[torch.Tensor], shift_mean: bool
) -> list[torch.Tensor]:
    """TRL's ``masked_whiten`` over the masked-in entries of several [B, T] tensors together (the
    generation batch's micro-batches, of different widths); 0 off the masks."""
    statistics = whiten(torch.cat([t[m] for t, m in zip(tensors, masks, strict=True)]), shift_mean)
    out, start = [], 0
    for tensor, mask in zip(tensors, masks, strict=True):
        count = int(mask.sum())
        whitened = torch.zeros_like(tensor, dtype=torch.float32)
        whitened[mask] = statistics[start : start + count]
        out.append(whitened)
        start += count
    return out


class DetachCritic(Callback):
    """When training ends (before the export), the critic leaves the policy: the exported model is the
    policy alone, as TRL's PPOTrainer saved only its policy."""

    def on_train_end(self, engine) -> None:
        if hasattr(engine.model, VALUE_MODEL):
            delattr(engine.model, VALUE_MODEL)


__all__ = ["PPOObjective", "PPOOptions"]
