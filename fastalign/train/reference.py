"""The reference policy of DPO-family, KTO and GRPO training, three ways, and TR-DPO's reference sync.

``ReferenceOptions`` are the config keys that choose among them (TRL's names), checked together once;
``setup_reference`` is what an objective with a reference calls in its ``setup``.

- ``FrozenReference``: a separate frozen model (sharded like the policy under FSDP2).
- ``AdapterDisabledReference``: the policy itself with its LoRA adapters switched off — the base
  model *is* the reference, so LoRA training keeps no second copy in memory.
- Precomputed (``precompute_reference``): the reference's sequence log-probs (as the objective scores
  them: LD-DPO's weighted sums for DPO) computed once over the data set before training and carried by
  the examples, so no reference is held during training.

Every log-prob goes through the patched model's fused head (``logprob_targets``): no logits are built.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fastalign.patching.causal_lm import shift_labels
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback, Engine, autocast

if TYPE_CHECKING:  # the objectives import this module
    from fastalign.train.objectives.base import RunParts


def token_logprobs_of(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, S] log p(targets[:, t]) at each position t from a patched model (0 where the target is -100)."""
    # by keyword: a peft model's third positional argument is inputs_embeds
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    return model(**inputs, logprob_targets=targets, temperature=temperature).token_logprobs


def sequence_logprobs_of(model: nn.Module, input_ids, attention_mask, labels) -> torch.Tensor:
    """[B] Σ log p of each row's label tokens (``labels`` unshifted, -100 where not a target)."""
    return token_logprobs_of(model, input_ids, attention_mask, shift_labels(labels)).sum(-1)


class Reference:
    """The reference policy's log-probs, without gradient."""

    def __init__(self, model: nn.Module):
        self.model = model

    def _context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @torch.no_grad()
    def token_logprobs(
        self, input_ids, attention_mask, targets, temperature: float = 1.0, position_ids=None
    ) -> torch.Tensor:
        with self._context():
            return token_logprobs_of(
                self.model, input_ids, attention_mask, targets, temperature, position_ids
            )

    @torch.no_grad()
    def sequence_logprobs(self, input_ids, attention_mask, labels) -> torch.Tensor:
        with self._context():
            return sequence_logprobs_of(self.model, input_ids, attention_mask, labels)


class FrozenReference(Reference):
    """A separate copy of the initial policy (or ``ref_model_name_or_path``), frozen, in eval mode."""

    def __init__(self, model: nn.Module):
        super().__init__(model.eval().requires_grad_(False))


class AdapterDisabledReference(Reference):
    """The LoRA policy with its adapters disabled: the frozen base model, no second copy."""

    def __init__(self, policy: nn.Module):
        if not hasattr(policy, "disable_adapter"):
            raise ValueError("the adapter-disabled reference needs a peft (LoRA) policy: set use_peft")
        super().__init__(policy)

    def _context(self) -> contextlib.AbstractContextManager:
        return self.model.disable_adapter()


#: The reference's log-probs of a collated batch of examples (on the device), each [examples in the
#: batch], by the name of the example field that keeps them: what ``precompute_reference`` attaches. An
#: objective scores with the same code as its live reference, so the values are the ones it would compute
#: during training (LD-DPO's ``ld_alpha`` weighting included).
ReferenceScores = Callable[[Reference, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def precompute_reference(
    examples: Sequence,
    reference: Reference,
    collate: Callable[[Sequence], dict[str, torch.Tensor]],
    score: ReferenceScores,
    attach: Callable[[object, dict[str, float]], object],
    batch_size: int,
    ctx: DistributedContext,
) -> list:
    """``examples`` with the reference's log-probs attached (``attach(example, {name: logp})``), scored
    by ``score`` on batches of ``collate``.

    Batches are dealt to the ranks in turn, and every rank runs the same number of forwards (FSDP2
    gathers collectively: a rank with fewer batches repeats one and drops its result); the values are
    then shared, so every rank holds all of them."""
    starts = list(range(0, len(examples), batch_size))
    mine = starts[ctx.rank :: ctx.world_size]
    values: dict[int, dict[str, float]] = {}
    for number in range(-(-len(starts) // ctx.world_size)):
        start = mine[min(number, len(mine) - 1)] if mine else starts[0]
        chunk = examples[start : start + batch_size]
        batch = {key: tensor.to(ctx.device) for key, tensor in collate(chunk).items()}
        found = {name: logps.float().cpu() for name, logps in score(reference, batch).items()}
        if number < len(mine):
            for offset in range(len(chunk)):
                values[start + offset] = {name: float(logps[offset]) for name, logps in found.items()}
    if ctx.enabled:
        gathered: list[dict[int, dict[str, float]]] = [{} for _ in range(ctx.world_size)]
        dist.all_gather_object(gathered, values)
        values = {index: value for part in gathered for index, value in part.items()}
    return [attach(example, values[index]) for index, example in enumerate(examples)]


class SyncReference(Callback):
    """TR-DPO: every ``steps`` optimizer steps the reference becomes α·policy + (1 − α)·reference.

    Both models have the same architecture and sharding, so each rank mixes its own shards."""

    def __init__(self, policy: nn.Module, reference: nn.Module, alpha: float, steps: int):
        names = [name for name, _ in policy.named_parameters()]
        if names != [name for name, _ in reference.named_parameters()]:
            raise ValueError(
                "sync_ref_model needs a reference with the policy's parameters (full fine-tuning, the same "
                "architecture); with use_peft the reference is the adapter-disabled policy and cannot sync"
            )
        self.pairs = list(zip(policy.parameters(), reference.parameters(), strict=True))
        self.alpha, self.steps = alpha, steps

    @torch.no_grad()
    def on_step_end(self, engine: Engine, metrics: dict) -> None:
        if engine.state.step % self.steps == 0:
            for param, ref_param in self.pairs:
                ref_param.lerp_(param.to(ref_param.dtype), self.alpha)


@dataclass(frozen=True)
class ReferenceOptions:
    """Which reference a run uses (TRL's DPOConfig names): LoRA without ``ref_model_name_or_path`` uses
    the adapter-disabled policy, otherwise a frozen model (the policy's initial weights unless
    ``ref_model_name_or_path``); ``precompute_ref_log_probs`` computes its log-probs once and drops it;
    ``sync_ref_model`` mixes the policy into it every ``ref_model_sync_steps`` steps (TR-DPO)."""

    ref_model_name_or_path: str | None
    precompute_ref_log_probs: bool
    sync_ref_model: bool
    ref_model_mixup_alpha: float
    ref_model_sync_steps: int
    use_peft: bool  # the runner's key, read here for the checks below

    @classmethod
    def from_config(cls, config: TrainConfig) -> ReferenceOptions:
        return options_from(config, cls)

    @classmethod
    def config_keys(cls) -> set[str]:
        """The keys that are the reference's own (``use_peft`` is everyone's)."""
        return set(cls.__dataclass_fields__) - {"use_peft"}

    def __post_init__(self) -> None:
        if self.precompute_ref_log_probs and self.sync_ref_model:
            raise ConfigError(
                "config keys 'precompute_ref_log_probs' and 'sync_ref_model' exclude each other"
            )
        if self.sync_ref_model and self.use_peft:
            raise ConfigError(
                "config key 'sync_ref_model' mixes the policy's weights into the reference: it needs full "
                "fine-tuning (use_peft: false), where both models have the same parameters"
            )


def reference_model(model: nn.Module, ref_model_name_or_path: str | None, parts: RunParts) -> Reference:
    """The reference policy for ``model``: the adapter-disabled policy under LoRA without
    ``ref_model_name_or_path``, else a frozen model (the policy's initial weights unless named)."""
    if parts.use_peft and ref_model_name_or_path is None:
        return AdapterDisabledReference(model)
    return FrozenReference(parts.load_frozen_model(ref_model_name_or_path))


def setup_reference(
    model: nn.Module,
    options: ReferenceOptions,
    parts: RunParts,
    examples: tuple[list, list],
    collate: Callable[[Sequence], dict[str, torch.Tensor]],
    score: ReferenceScores,
) -> tuple[Reference | None, tuple[list, list], list[Callback]]:
    """The reference for training (None once precomputed by ``score`` into the train and evaluation
    examples, which are returned with their log-probs attached) and the callbacks it needs (TR-DPO's
    sync)."""
    reference = reference_model(model, options.ref_model_name_or_path, parts)
    if options.precompute_ref_log_probs:
        with autocast(parts.ctx.device, parts.autocast_dtype):  # as under the engine
            examples = tuple(
                precompute_reference(
                    part, reference, collate, score, _attach, parts.eval_batch_size, parts.ctx
                )
                for part in examples
            )
        return None, examples, []
    if options.sync_ref_model:
        sync = SyncReference(
            model, reference.model, options.ref_model_mixup_alpha, options.ref_model_sync_steps
        )
        return reference, examples, [sync]
    return reference, examples, []


def reference_state(reference: Reference | None, options: ReferenceOptions) -> dict[str, torch.Tensor]:
    """What a checkpoint must keep of the reference: nothing for a fixed one; a synced one's weights
    (TR-DPO: they follow the policy), as its state-dict tensors (sharded like the policy under FSDP2),
    which a resume loads in place."""
    if reference is None or not options.sync_ref_model:
        return {}
    return {f"reference.{name}": value for name, value in reference.model.state_dict().items()}


def _attach(example, values: dict[str, float]):
    return dataclasses.replace(example, **values)
