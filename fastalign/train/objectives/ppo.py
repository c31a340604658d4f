"""``fastalign train ppo``: PPO with a critic, TRL's former ``PPOTrainer`` (trl 0.11-0.19; TRL 1.16 has none).

The rollout is GRPO's (``RolloutObjective``: prompts, seeded sampling with the rollout engine, scoring by
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

The critic is a body whose last hidden state at every token a [D → 1] value head scores (never a
vocabulary), in one of two shapes:

- Full fine-tuning (``SeparateCritic``): TRL's ``value_model``, ``AutoModelForSequenceClassification``
  with one label on ``value_model_path`` (null: the policy's checkpoint), its new ``score`` head the value
  head. As TRL's ``PolicyAndValueWrapper`` it is attached to the policy (as ``VALUE_MODEL``) for the run,
  so one optimizer, one gradient clipping and every checkpoint take both. Under ``torchrun`` it is
  sharded with FSDP2 as the policy is (each decoder layer, then its root), and its values go through its
  root's forward hooks (``register_fsdp_forward_method``), so its root weights are gathered for them.
- LoRA (``use_peft``, ``AdapterCritic``): one base model for every role, as OpenRLHF's and TRL's former
  peft PPO: the frozen base (4-bit with ``quantization``), the policy's adapter, a second adapter for the
  critic (the policy's LoRA settings) with a value head in fp32, and the reference = the adapters
  disabled. So a run holds about one base model (plus the reward model when ``reward_funcs`` names one).
  The critic starts from the policy's base: ``value_model_path`` may only name that model.

Either way the critic leaves the policy when training ends (``DetachCritic``): the export is the policy
alone (the full model, or the policy's adapter only), as TRL's PPOTrainer saved only its policy.
Checkpoints hold the critic (its weights, or its adapter and value head) and its optimizer state, and
inside a generation the rest of it (``RolloutObjective.pending_state``: the rollout's values, returns and
advantages with the rest): a run resumed from any checkpoint continues exactly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from fastalign.losses.ppo import PPOLoss, shaped_rewards, value_loss, whiten
from fastalign.models.structure import disable_dropout
from fastalign.ops import generalized_advantage_estimation
from fastalign.train.config import ConfigError, TrainConfig, model_option, options_from
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.engine import Callback
from fastalign.train.loading import load_model_and_tokenizer, resolve_model
from fastalign.train.objectives.base import Prepared, RunParts
from fastalign.train.objectives.online import RolloutObjective, RolloutOptions
from fastalign.train.policy import prepare_policy
from fastalign.train.reference import AdapterDisabledReference
from fastalign.train.rollout import Rewards, all_gather_rows

#: The separate critic's name as a submodule of the policy during training (its checkpoint keys' prefix).
VALUE_MODEL = "ppo_value_model"
#: Under LoRA: the policy's adapter (peft's default name), the critic's, and the value head's submodule name.
POLICY_ADAPTER, CRITIC_ADAPTER, VALUE_HEAD = "default", "ppo_critic", "ppo_value_head"

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

    kl_key = "kl_coef"

    def check(self, name: str, config: TrainConfig) -> None:
        super().check(name, config)
        if self.kl_coef == 0 and self.kl_estimator != "k1":
            raise ConfigError(
                f"config key 'kl_estimator' ({self.kl_estimator!r}) estimates the KL penalty, and kl_coef is "
                "0 (no penalty): set kl_coef above 0, or remove it"
            )
        if not config.use_peft:
            return
        path = self.value_model_path
        if path is not None and not _same_model(path, config.model_name_or_path):
            raise ConfigError(
                f"config key 'value_model_path' ({path!r}): under use_peft the critic is an adapter with a "
                f"value head on the policy's base model ({config.model_name_or_path!r}); leave it null, or "
                "set use_peft to false for a separate critic"
            )
        if config.gradient_checkpointing:
            raise ConfigError(
                "config key 'gradient_checkpointing': under use_peft the policy and the critic are two "
                "adapters of one model, and a layer recomputed in backward would take whichever adapter is "
                "active then; set it to false (or use_peft to false)"
            )


def _same_model(path: str, model_name_or_path: str) -> bool:
    """Whether ``path`` names the policy's model (as given, or the files it resolves to)."""
    if path == model_name_or_path:
        return True
    try:
        return str(resolve_model(path)) == str(resolve_model(model_name_or_path))
    except ValueError as error:
        raise ConfigError(f"config key 'value_model_path': {error}") from None


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
        if self.ctx.enabled and config.use_peft:
            raise ConfigError(
                "config key 'use_peft': ppo's one-base-model mode (policy and critic adapters) runs in one "
                "process; under torchrun set use_peft to false (a separate critic, sharded as the policy)"
            )
        self.loss = PPOLoss(cliprange=options.cliprange, temperature=options.temperature)
        self.config = config  # the critic loads as the policy did (dtype, attention, kernels, checkpointing)
        self.critic: SeparateCritic | AdapterCritic | None = None

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> PPOObjective:
        options = PPOOptions.from_config(config, name)
        options.check(name, config)
        return cls(name, options, config, ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(PPOOptions.__dataclass_fields__) - set(PPOOptions.DERIVED)

    @property
    def rows_per_example(self) -> int:  # type: ignore[override]
        """Under ``use_peft`` the critic is an adapter of the policy's model: its values' forward runs
        through the same (offloaded) decoder stack before the step's one backward, two forwards' worth."""
        return 2 if self.config.use_peft else 1

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if parts.use_peft:  # before the rollout's setup: its dropout switch reaches the critic's adapter too
            self.critic = AdapterCritic(model, self.config.seed)
        prepared = super().setup(model, train, evaluation, parts)
        if isinstance(self.critic, AdapterCritic) and isinstance(self.reference, AdapterDisabledReference):
            self.reference = AdapterCriticReference(model, self.critic)
        if self.critic is None:
            path = self.options.value_model_path or self.options.model_name_or_path
            self.critic = SeparateCritic.load(
                path,
                self.config,
                self.ctx,
                model,
                self.options.disable_dropout,
                self.sequence_length(self.config, train),
            )
        return dataclasses.replace(prepared, callbacks=[*prepared.callbacks, DetachCritic(self.critic)])

    # --- the rollout's advantages ------------------------------------------------------------------
    def keeps_policy_logprobs(self, reused: bool) -> bool:
        return True  # the KL reward and the ratio's denominator

    def values(self, batch: dict) -> torch.Tensor:
        """The critic's value [B, T] fp32 of each completion token's state (the position before it)."""
        assert self.critic is not None, "setup() attaches the critic"
        width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        values = self.critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        return values[:, width - 1 : -1].squeeze(-1).float()

    def advantages(self, rewards: Rewards, batches: list[dict], group: int, reused: bool):
        """Per-token advantages, returns and the rollout's values into each batch; returns each
        completion's advantage at its first token (the completions log's) and TRL's ``objective/*``
        metrics.

        Under ``torchrun`` the whitening and the metrics span every rank's completions, so that they are
        those of one process with the whole generation batch (TRL whitened each process's own)."""
        device = self.ctx.device
        all_scores = torch.nan_to_num(rewards.total, nan=0.0)
        if self.options.missing_eos_penalty is not None:
            all_scores = all_scores - self.options.missing_eos_penalty * rewards.truncated.float()
        scores = all_scores[rewards.rows]
        sum_all = functools.partial(all_reduce_sum, ctx=self.ctx) if self.ctx.enabled else None
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
            token_rewards = _whiten_masked(token_rewards, masks, shift_mean=False, sum_all=sum_all)
        advantages, returns = [], []
        with torch.no_grad():
            for batch, reward, mask in zip(batches, token_rewards, masks, strict=True):
                batch["values"] = self.values({key: value.to(device) for key, value in batch.items()})
                gae = generalized_advantage_estimation(
                    reward, batch["values"], mask, self.options.gamma, self.options.lam
                )
                advantages.append(gae[0])
                returns.append(gae[1])
        advantages = _whiten_masked(advantages, masks, shift_mean=True, sum_all=sum_all)
        for batch, advantage, ret in zip(batches, advantages, returns, strict=True):
            batch["token_advantages"], batch["returns"] = advantage.cpu(), ret.cpu()
            batch["values"] = batch["values"].cpu()
            batch.pop("ref_per_token_logps", None)  # folded into the rewards
        entropy = sum(
            -torch.where(mask, batch["old_per_token_logps"].to(device), 0.0).sum()
            for batch, mask in zip(batches, masks, strict=True)
        )
        sums = torch.stack(
            [
                sum(part.kl.sum() for part in shaped),
                sum(part.non_score_reward.sum() for part in shaped),
                entropy,
            ]
        )
        kl, non_score, entropy = (all_reduce_sum(sums, self.ctx) / rewards.total.numel()).tolist()
        first = all_gather_rows(torch.cat([advantage[:, 0] for advantage in advantages]), self.ctx).cpu()
        return first, {
            "objective/kl": kl,
            "objective/entropy": entropy,
            "objective/non_score_reward": non_score,
            "objective/rlhf_reward": non_score + float(all_scores.mean()),
            "objective/scores": float(all_scores.mean()),
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
    tensors: list[torch.Tensor], masks: list[torch.Tensor], shift_mean: bool, sum_all=None
) -> list[torch.Tensor]:
    """TRL's ``masked_whiten`` over the masked-in entries of several [B, T] tensors together (the
    generation batch's micro-batches, of different widths; with ``sum_all``, every rank's); 0 off the
    masks."""
    flat = torch.cat([t[m] for t, m in zip(tensors, masks, strict=True)])
    statistics = whiten(flat, shift_mean, sum_all)
    out, start = [], 0
    for tensor, mask in zip(tensors, masks, strict=True):
        count = int(mask.sum())
        whitened = torch.zeros_like(tensor, dtype=torch.float32)
        whitened[mask] = statistics[start : start + count]
        out.append(whitened)
        start += count
    return out


def _token_values(critic: nn.Module, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """The sequence classifier ``critic``'s score [B, S, 1] of every token's last hidden state."""
    body = getattr(critic, critic.base_model_prefix)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return critic.score(hidden.last_hidden_state)


class SeparateCritic:
    """TRL's value model: a sequence classifier of its own, attached to the policy as ``VALUE_MODEL``.

    Its values skip the classifier's last-token pooling (``token_values``: body, then ``score`` on every
    token). Registered as an FSDP2 forward method, that call gathers the critic's root weights (embedding,
    final norm, ``score``) as its ``forward`` would: the root of a sharded model is gathered only around
    its forward methods."""

    def __init__(self, model: nn.Module, policy: nn.Module):
        self.model = model
        model.token_values = functools.partial(_token_values, model)
        register_fsdp_forward_method(model, "token_values")  # a no-op unless sharded
        policy.add_module(VALUE_MODEL, model)

    @classmethod
    def load(
        cls,
        path: str,
        config: TrainConfig,
        ctx: DistributedContext,
        policy: nn.Module,
        no_dropout: bool,
        row_tokens: int,
    ) -> SeparateCritic:
        """The critic from ``path``, loaded, patched and placed (sharded) as the policy was (its rows are
        the policy's: ``row_tokens`` long at most)."""
        model, _ = load_model_and_tokenizer(path, None, ctx.device, task="sequence_classification")
        critic_config = dataclasses.replace(config, model_name_or_path=path, use_peft=False)
        model = prepare_policy(
            model,
            critic_config,
            ctx,
            needs_fused_head=False,
            task="sequence_classification",
            row_tokens=row_tokens,
        )
        if no_dropout:
            disable_dropout(model)
        return cls(model, policy)

    def __call__(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        return self.model.token_values(input_ids, attention_mask, position_ids)

    def detach(self, policy: nn.Module) -> None:
        delattr(policy, VALUE_MODEL)


class AdapterCritic:
    """The critic of the one-base-model mode: adapter ``CRITIC_ADAPTER`` on the LoRA policy's base model
    (the policy adapter's settings, without its ``lora_modules_to_save``: those copies are the policy's)
    and a value head, a bias-free [D → 1] linear in fp32 drawn as TRL's value model's ``score``
    (N(0, ``initializer_range``), from ``seed``), attached to the policy as ``VALUE_HEAD``.

    peft trains only its active adapter: switching (``set_adapter``, and ``disable_adapter`` for the
    reference) turns the others' ``requires_grad`` off. Both adapters train here, in one optimizer, and a
    checkpoint keeps only what trains, so ``keep_trainable`` turns them back on after each switch."""

    def __init__(self, policy: nn.Module, seed: int):
        lora = copy.deepcopy(policy.peft_config[POLICY_ADAPTER])
        lora.modules_to_save = None
        policy.add_adapter(CRITIC_ADAPTER, lora)
        policy.set_requires_grad(CRITIC_ADAPTER, True)
        base = policy.get_base_model()
        self.policy, self.body = policy, getattr(base, base.base_model_prefix)
        hidden_size, std = base.config.hidden_size, base.config.initializer_range
        weight = torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(seed)) * std
        self.head = nn.Linear(hidden_size, 1, bias=False, device=weight.device)
        with torch.no_grad():
            self.head.weight.copy_(weight)
        policy.add_module(VALUE_HEAD, self.head.to(next(self.body.parameters()).device))
        self.trainable = [param for param in policy.parameters() if param.requires_grad]

    def keep_trainable(self) -> None:
        for param in self.trainable:
            param.requires_grad_(True)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The critic's adapter in the forward passes inside; the policy's again after."""
        self.policy.set_adapter(CRITIC_ADAPTER)
        self.keep_trainable()
        try:
            yield
        finally:
            self.policy.set_adapter(POLICY_ADAPTER)
            self.keep_trainable()

    def __call__(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        with self.active():
            hidden = self.body(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype))

    def detach(self, policy: nn.Module) -> None:
        policy.delete_adapter(CRITIC_ADAPTER)
        delattr(policy, VALUE_HEAD)


class AdapterCriticReference(AdapterDisabledReference):
    """The adapter-disabled reference of the one-base-model mode: peft re-enables only the active adapter
    as trainable after it, so the critic's adapter is made trainable again."""

    def __init__(self, policy: nn.Module, critic: AdapterCritic):
        super().__init__(policy)
        self.critic = critic

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        try:
            with self.model.disable_adapter():
                yield
        finally:
            self.critic.keep_trainable()


class DetachCritic(Callback):
    """When training ends (before the export), the critic leaves the policy: the exported model is the
    policy alone (its adapter alone under LoRA), as TRL's PPOTrainer saved only its policy."""

    def __init__(self, critic: SeparateCritic | AdapterCritic):
        self.critic = critic

    def on_train_end(self, engine) -> None:
        self.critic.detach(engine.model)


__all__ = ["PPOObjective", "PPOOptions"]
