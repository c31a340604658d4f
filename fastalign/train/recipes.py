"""What each objective adds to the runner (``fastalign.train.run``): how dataset rows become examples and
micro-batches, and the objective, with its reference, that trains on them.

``Recipe`` is SFT; the preference objectives (dpo, orpo, simpo, cpo), kto and grpo/rloo override only
what differs. Each checks its part of the config when made, so a bad config fails before any model
work, with a one-line ``ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence

import torch

from fastalign.data import tokenize_sft_dataset
from fastalign.data.preference import (
    KTOCollator,
    PreferenceCollator,
    PromptCollator,
    tokenize_kto_dataset,
    tokenize_preference_dataset,
    tokenize_prompt_dataset,
)
from fastalign.losses import GRPOLoss, KTOLoss, PreferenceLoss
from fastalign.losses.grpo import LOSS_TYPES as GRPO_LOSS_TYPES
from fastalign.train.batches import MicroBatches
from fastalign.train.config import OBJECTIVES, ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback, autocast
from fastalign.train.objectives import SFTObjective
from fastalign.train.objectives.grpo import GenerationBatches, GRPOObjective, GRPOSettings
from fastalign.train.objectives.preference import KTOObjective, PreferenceObjective
from fastalign.train.policy import autocast_dtype, load_frozen_model
from fastalign.train.reference import (
    AdapterDisabledReference,
    FrozenReference,
    Reference,
    SequenceInputs,
    SyncReference,
    precompute_reference,
)
from fastalign.train.rewards import resolve_reward_funcs
from fastalign.train.rollout import SamplingOptions, Scoring

#: TRL's default ``beta`` of each objective (``beta: null`` in the config).
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "cpo": 0.1, "kto": 0.1, "grpo": 0.0, "rloo": 0.0}

Built = tuple[object, list, list, list[Callback]]  # objective, train examples, eval examples, callbacks


class Recipe:
    """SFT: text / messages / prompt-completion rows, padded or packed, next-token cross-entropy."""

    default_dataset = "tiny-sft"  # the built-in data set when the config names none
    needs_fused_head = False  # SFT's loss is the model's own (fused once patched)
    collate: Callable[[Sequence], dict] | None = None  # None: SFT's padding or packing collators

    def __init__(self, name: str, config: TrainConfig, tokenizer, ctx: DistributedContext):
        self.name, self.config, self.tokenizer, self.ctx = name, config, tokenizer, ctx
        self.beta = config.beta if config.beta is not None else DEFAULT_BETA.get(name, 0.0)
        if config.packing and name != "sft":
            raise ConfigError(f"config key 'packing' is for sft; {name} trains on whole sequences")

    def tokenize(self, rows: list[dict]) -> list:
        config = self.config
        return tokenize_sft_dataset(
            rows, self.tokenizer, max_length=config.max_length, truncation=config.truncation,
            completion_only_loss=config.completion_only_loss, assistant_only_loss=config.assistant_only_loss,
        )  # fmt: skip

    def batches(self, examples: list):
        config = self.config
        return MicroBatches(
            examples, batch_size=config.per_device_train_batch_size,
            accumulation=config.gradient_accumulation_steps, pad_token_id=self.tokenizer.pad_token_id,
            seed=config.seed, packing_length=config.max_length if config.packing else None,
            rank=self.ctx.rank, world_size=self.ctx.world_size, collate=self.collate,
        )  # fmt: skip

    def build_objective(self, model, train: list, evaluation: list) -> Built:
        return SFTObjective(), train, evaluation, []

    def _lengths(self) -> dict:
        config = self.config
        return dict(
            max_length=config.max_length, max_prompt_length=config.max_prompt_length,
            truncation=config.truncation,
        )  # fmt: skip

    # --- the reference policy, for the objectives that have one ---------------------------------
    def _reference(self, model) -> tuple[Reference, torch.nn.Module | None]:
        """LoRA without ``ref_model_name_or_path``: the adapter-disabled policy. Otherwise a frozen
        model (the policy's initial weights unless ``ref_model_name_or_path``)."""
        config = self.config
        if config.use_peft and config.ref_model_name_or_path is None:
            return AdapterDisabledReference(model), None
        frozen = load_frozen_model(
            config.ref_model_name_or_path or config.model_name_or_path, config, self.ctx
        )
        return FrozenReference(frozen), frozen

    def _check_reference_options(self) -> None:
        """Reference options that cannot work together, before any model is loaded."""
        config = self.config
        if config.precompute_ref_log_probs and config.sync_ref_model:
            raise ConfigError(
                "config keys 'precompute_ref_log_probs' and 'sync_ref_model' exclude each other"
            )
        if config.sync_ref_model and config.use_peft:
            raise ConfigError(
                "config key 'sync_ref_model' mixes the policy's weights into the reference: it needs full "
                "fine-tuning (use_peft: false), where both models have the same parameters"
            )
        if config.sync_ref_model and config.resume_from_checkpoint:
            raise ConfigError(
                "config key 'resume_from_checkpoint' with sync_ref_model: the synced reference is not saved "
                "in checkpoints yet, so a resumed TR-DPO run would not continue exactly"
            )

    def _with_reference(
        self, model, examples: tuple[list, list], sequences: Callable[[Sequence], SequenceInputs]
    ) -> tuple[Reference | None, tuple[list, list], list[Callback]]:
        """The reference for training (None once precomputed into the examples) and TR-DPO's sync."""
        config = self.config
        reference, frozen = self._reference(model)
        if config.precompute_ref_log_probs:
            size = config.per_device_eval_batch_size
            with autocast(self.ctx.device, autocast_dtype(config, self.ctx)):  # as under the engine
                examples = tuple(
                    precompute_reference(part, reference, sequences, _attach, size, self.ctx)
                    for part in examples
                )
            return None, examples, []
        callbacks: list[Callback] = []
        if config.sync_ref_model:
            callbacks.append(
                SyncReference(model, frozen, config.ref_model_mixup_alpha, config.ref_model_sync_steps)
            )
        return reference, examples, callbacks


def _attach(example, values: dict[str, float]):
    return dataclasses.replace(example, **values)


class PreferenceRecipe(Recipe):
    """DPO family, SimPO, CPO, ORPO on prompt / chosen / rejected rows (one forward for both)."""

    default_dataset = "tiny-preference"
    needs_fused_head = True

    def __init__(self, name: str, config: TrainConfig, tokenizer, ctx: DistributedContext):
        super().__init__(name, config, tokenizer, ctx)
        self._check_reference_options()
        self.collate = PreferenceCollator(tokenizer.pad_token_id)
        try:
            self.loss = PreferenceLoss(
                objective=name, loss_type=config.loss_type or "sigmoid", loss_weights=config.loss_weights,
                beta=self.beta, label_smoothing=config.label_smoothing, gamma=config.simpo_gamma,
                cpo_alpha=config.cpo_alpha,
            )  # fmt: skip
        except ValueError as error:
            raise ConfigError(f"config for {name}: {error}") from None

    def tokenize(self, rows: list[dict]) -> list:
        return tokenize_preference_dataset(rows, self.tokenizer, **self._lengths())

    def build_objective(self, model, train: list, evaluation: list) -> Built:
        if self.loss.reference_free:
            return PreferenceObjective(self.loss, self.ctx), train, evaluation, []
        reference, (train, evaluation), callbacks = self._with_reference(
            model, (train, evaluation), self._sequences
        )
        return PreferenceObjective(self.loss, self.ctx, reference), train, evaluation, callbacks

    def _sequences(self, chunk: Sequence) -> SequenceInputs:
        batch, pairs = self.collate(chunk), len(chunk)
        rows = (batch["input_ids"], batch["attention_mask"], batch["labels"])
        return {
            "ref_chosen_logp": tuple(t[:pairs] for t in rows),
            "ref_rejected_logp": tuple(t[pairs:] for t in rows),
        }


class KTORecipe(Recipe):
    """KTO on unpaired prompt / completion / label rows."""

    default_dataset = "tiny-kto"
    needs_fused_head = True

    def __init__(self, name: str, config: TrainConfig, tokenizer, ctx: DistributedContext):
        super().__init__(name, config, tokenizer, ctx)
        self._check_reference_options()
        self.collate = KTOCollator(tokenizer.pad_token_id)
        self.loss = KTOLoss(
            beta=self.beta, desirable_weight=config.desirable_weight,
            undesirable_weight=config.undesirable_weight,
        )  # fmt: skip

    def tokenize(self, rows: list[dict]) -> list:
        return tokenize_kto_dataset(rows, self.tokenizer, **self._lengths())

    def build_objective(self, model, train: list, evaluation: list) -> Built:
        reference, (train, evaluation), callbacks = self._with_reference(
            model, (train, evaluation), self._sequences
        )
        return KTOObjective(self.loss, reference, self.ctx), train, evaluation, callbacks

    def _sequences(self, chunk: Sequence) -> SequenceInputs:
        batch = self.collate(chunk)
        return {
            "ref_logp": (batch["input_ids"], batch["attention_mask"], batch["labels"]),
            "ref_kl_logp": (batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_labels"]),
        }


class GRPORecipe(Recipe):
    """GRPO (and RLOO's leave-one-out baseline) on prompt rows: sample, score, train."""

    default_dataset = "tiny-prompts"
    needs_fused_head = True

    def __init__(self, name: str, config: TrainConfig, tokenizer, ctx: DistributedContext):
        super().__init__(name, config, tokenizer, ctx)
        self.collate = PromptCollator(tokenizer.pad_token_id)
        _check_grpo(name, config)
        try:
            self.reward_funcs = resolve_reward_funcs(config.reward_funcs)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if config.reward_weights is not None and len(config.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"config key 'reward_weights' has {len(config.reward_weights)} values for "
                f"{len(self.reward_funcs)} reward_funcs"
            )
        loss_type = (config.loss_type or ["dapo"])[0]
        self.loss = GRPOLoss(
            beta=self.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high, delta=config.delta,
            loss_type=loss_type, importance_sampling_level=config.importance_sampling_level,
            temperature=config.temperature, max_completion_length=config.max_completion_length,
        )  # fmt: skip

    def tokenize(self, rows: list[dict]) -> list:
        return tokenize_prompt_dataset(
            rows, self.tokenizer, max_prompt_length=self.config.max_prompt_length,
            truncation=self.config.truncation,
        )  # fmt: skip

    def _steps_per_generation(self) -> int:
        return self.config.steps_per_generation or self.config.gradient_accumulation_steps

    def batches(self, examples: list) -> GenerationBatches:
        config = self.config
        prompts = MicroBatches(
            examples, batch_size=config.per_device_train_batch_size // config.num_generations,
            accumulation=self._steps_per_generation(), pad_token_id=self.tokenizer.pad_token_id,
            seed=config.seed, rank=self.ctx.rank, world_size=self.ctx.world_size, collate=self.collate,
        )  # fmt: skip
        return GenerationBatches(prompts, config.gradient_accumulation_steps, config.num_iterations)

    def build_objective(self, model, train: list, evaluation: list) -> Built:
        config = self.config
        reference = self._reference(model)[0] if self.beta > 0 else None
        settings = GRPOSettings(
            sampling=SamplingOptions(
                config.num_generations, config.max_completion_length, config.temperature, config.top_p
            ),
            scoring=Scoring(
                self.reward_funcs, config.reward_weights, config.num_generations, config.scale_rewards,
                "rloo" if self.name == "rloo" else config.advantage_estimator,
            ),
            mask_truncated_completions=config.mask_truncated_completions,
            keep_old_logprobs=(
                config.num_iterations > 1 or self._steps_per_generation() > config.gradient_accumulation_steps
            ),
            conversational=isinstance(train[0].prompt, list),
        )  # fmt: skip
        return GRPOObjective(self.loss, settings, self.tokenizer, self.ctx, reference), train, evaluation, []


def _check_grpo(name: str, config: TrainConfig) -> None:
    if not config.reward_funcs:
        raise ConfigError(f"config key 'reward_funcs' must name at least one reward function for {name}")
    if config.per_device_train_batch_size % config.num_generations:
        raise ConfigError(
            f"config key 'per_device_train_batch_size' ({config.per_device_train_batch_size}) counts "
            f"completions and must be a multiple of num_generations ({config.num_generations})"
        )
    if config.loss_type is not None and (
        len(config.loss_type) != 1 or config.loss_type[0] not in GRPO_LOSS_TYPES
    ):
        raise ConfigError(f"config key 'loss_type' for {name} must be one of {', '.join(GRPO_LOSS_TYPES)}")
    if config.eval_dataset_name or config.eval_split_ratio:
        raise ConfigError(f"evaluation (eval_dataset_name, eval_split_ratio) is not available for {name}")
    steps = config.steps_per_generation
    if steps is not None and steps % config.gradient_accumulation_steps:
        raise ConfigError(
            f"config key 'steps_per_generation' ({steps}) must be a multiple of gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}): a generation serves whole optimizer steps"
        )
    if config.precompute_ref_log_probs:
        raise ConfigError(f"config key 'precompute_ref_log_probs' is for preference training, not {name}")
    if config.use_vllm:
        found = importlib.util.find_spec("vllm") is not None
        raise ConfigError(
            "config key 'use_vllm': "
            + ("vLLM generation is not wired in yet" if found else "the vllm package is not installed")
            + "; set it to false to generate with model.generate"
        )


_RECIPES = {"sft": Recipe, "kto": KTORecipe, "grpo": GRPORecipe, "rloo": GRPORecipe}


def make_recipe(name: str, config: TrainConfig, tokenizer, ctx: DistributedContext) -> Recipe:
    """The recipe of objective ``name`` (one of ``OBJECTIVES``); the config is checked here."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    return _RECIPES.get(name, PreferenceRecipe)(name, config, tokenizer, ctx)
