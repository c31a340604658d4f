"""``fastalign train kto``: Kahneman-Tversky optimisation on unpaired completions, TRL's ``KTOTrainer``.

Rows are prompt / completion / label (desirable or not). Each example also carries a mismatched
completion (another row's of its block of ``per_device_train_batch_size`` rows, as TRL pairs them) whose
policy − reference log-ratio estimates the KL divergence, KTO's reference point; as in TRL, the rows
train in the data's order (``train_sampling_strategy`` sequential, the only one the KL pairs allow), so
a micro-batch's mismatched completions are its own completions paired with other prompts.
``KTOLoss`` runs inside the patched model's forward (``head_fn``).

The KL estimate (mean log-ratio of the mismatched completions, clamped at 0) and the counts of
desirable and undesirable completions are taken over the whole step on all ranks in ``prepare_step``:
the loss does not depend on how the step is split, and every micro-batch logs
``rewards/chosen``/``rewards/rejected`` (``logps/*``, and ``logits/*``: the mean logit over the class's
completion tokens) as its part of the step's class means. (In evaluation, each
batch's own.) A loss term is a completion.

``loss_type`` apo_zero_unpaired (TRL's KTOConfig) has no KL reference point: the mismatched completions
are then never scored (no policy or reference pass over them), and ``kl`` logs 0 as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.data.preference import KTOCollator, tokenize_kto_dataset, with_mismatched_completions
from fastalign.losses import KTOLoss
from fastalign.losses.preference import KTO_LOSS_TYPES
from fastalign.models.structure import disable_dropout
from fastalign.patching.causal_lm import shift_labels
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.objectives.base import LENGTH_KEYS, Objective, Prepared, RunParts, pick
from fastalign.train.objectives.router_aux import RouterAuxLoss
from fastalign.train.reference import (
    Reference,
    ReferenceOptions,
    reference_state,
    sequence_logprobs_of,
    setup_reference,
)


@dataclass(frozen=True)
class KTOOptions:
    """The keys KTO reads (TRL's KTOConfig names; its ``loss_type`` is one name, the config's list holds
    one)."""

    loss_type: list[str]
    beta: float
    desirable_weight: float
    undesirable_weight: float
    max_length: int
    max_prompt_length: int | None
    truncation: bool
    disable_dropout: bool
    chat_template_kwargs: dict | None  # template variables of conversational rows
    router_aux_loss_coef: float | None  # a MoE policy's load-balancing loss weight (None: the model's)

    @classmethod
    def from_config(cls, config: TrainConfig) -> KTOOptions:
        options = options_from(config, cls, beta=0.1, loss_type=["kto"], disable_dropout=True)
        if len(options.loss_type) != 1 or options.loss_type[0] not in KTO_LOSS_TYPES:
            raise ConfigError(
                f"config key 'loss_type' for kto must be one of {', '.join(KTO_LOSS_TYPES)} (one value), "
                f"got {options.loss_type!r}"
            )
        if options.uses_kl:
            _check_kl_pairs(config)
        return options

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has KTO's KL reference point (the mismatched completions are scored)."""
        return self.loss_type == ["kto"]


def _check_kl_pairs(config: TrainConfig) -> None:
    """KTO's KL pairs are each micro-batch's completions with other prompts (TRL's KTOTrainer refuses
    the same two settings): they need the data's order and more than one row a micro-batch."""
    strategy = config.train_sampling_strategy or KTOObjective.default_sampling_strategy
    if strategy != "sequential":
        raise ConfigError(
            f"config key 'train_sampling_strategy' ({strategy!r}): kto's KL estimate pairs each completion "
            "with another prompt of its micro-batch, in the data's order, which needs sequential (remove "
            "the key), or loss_type apo_zero_unpaired, which has no KL term"
        )
    if config.per_device_train_batch_size < 2:
        raise ConfigError(
            f"config key 'per_device_train_batch_size' ({config.per_device_train_batch_size}): kto's KL "
            "estimate pairs each completion with another prompt of its micro-batch, so it needs at least 2 "
            "(or loss_type apo_zero_unpaired, which has no KL term)"
        )


class KTOObjective(Objective):
    """``KTOLoss`` on micro-batches of completions labelled desirable or not, with their mismatched
    (KL) completions."""

    default_dataset = "tiny-kto"
    default_sampling_strategy = "sequential"  # TRL's KTOConfig: the KL pairs are made in the data's order

    def __init__(
        self,
        options: KTOOptions,
        reference_options: ReferenceOptions,
        ctx: DistributedContext | None = None,
        block: int = 8,
    ):
        """``block``: ``per_device_train_batch_size``, the rows within which the KL pairs are made."""
        super().__init__(ctx)
        self.options, self.reference_options, self.block = options, reference_options, block
        self.loss = KTOLoss(
            loss_type=options.loss_type[0],
            beta=options.beta,
            desirable_weight=options.desirable_weight,
            undesirable_weight=options.undesirable_weight,
        )
        self.reference: Reference | None = None
        self._class_counts = torch.ones(2)  # desirable, undesirable completions of the current step
        self._kl = torch.zeros(1)
        self.router_aux = RouterAuxLoss(options.router_aux_loss_coef)

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> KTOObjective:
        options = KTOOptions.from_config(config)
        return cls(options, ReferenceOptions.from_config(config), ctx, config.per_device_train_batch_size)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset({*KTOOptions.__dataclass_fields__, *ReferenceOptions.config_keys()})

    # --- data --------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict], tokenizer) -> list:
        return tokenize_kto_dataset(
            rows, tokenizer, **pick(self.options, *LENGTH_KEYS, "chat_template_kwargs")
        )

    def collate(self, tokenizer) -> KTOCollator:
        return KTOCollator(tokenizer.pad_token_id)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if self.options.disable_dropout:
            disable_dropout(model)
        self.router_aux.setup(model)
        if self.options.uses_kl:  # TRL pairs the evaluation rows in blocks of the training batch size too
            train, evaluation = (
                with_mismatched_completions(examples, self.block, self.options.max_length)
                for examples in (train, evaluation)
            )

        def score(reference: Reference, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            found = {"ref_logp": reference.sequence_logprobs(*_rows(batch))}
            if self.options.uses_kl:
                found["ref_kl_logp"] = reference.sequence_logprobs(*_rows(batch, "kl_"))
            return found

        self.reference, (train, evaluation), callbacks = setup_reference(
            model, self.reference_options, parts, (train, evaluation), self.collate(parts.tokenizer), score
        )
        return Prepared(train, evaluation, callbacks)

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        sums = torch.zeros(4, dtype=torch.float64)  # desirable, undesirable, KL log-ratio sum, completions
        for batch in micro_batches:
            desirable = int(batch["kto_labels"].sum())
            rows = len(batch["kto_labels"])
            kl_sum = 0.0
            if self.options.uses_kl:
                kl_ratio = self._kl_log_ratios(model, {k: v.to(self.ctx.device) for k, v in batch.items()})
                kl_sum = float(kl_ratio.sum())
            sums += torch.tensor([desirable, rows - desirable, kl_sum, rows])
        sums = all_reduce_sum(sums, self.ctx).cpu()
        self._class_counts = sums[:2]
        self._kl = (sums[2] / sums[3].clamp_min(1)).clamp(min=0).float().reshape(1)
        self.router_aux.start_step(len(micro_batches), self.ctx.world_size)
        return micro_batches, {}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        ref_logps = self._reference_logps(batch, "")
        # KTOLoss takes the mean of (kl − ref_kl): the step's estimate as one term, or this batch's
        kl_terms = {}
        if self.options.uses_kl:
            kl = self._kl.to(ref_logps.device) if model.training else self._kl_log_ratios(model, batch)
            kl_terms = {"kl_logps": kl, "ref_kl_logps": torch.zeros_like(kl)}
        labels = batch["kto_labels"].bool()

        def head(hidden, weight, bias, softcap=None):
            return self.loss(
                hidden,
                weight,
                shift_labels(batch["labels"]),
                labels,
                ref_logps=ref_logps,
                bias=bias,
                softcap=softcap,
                **kl_terms,
            )

        result = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            head_fn=head,
            **self.router_aux.forward_kwargs(),
        )
        loss, metrics = result.head_output
        share = self.loss_tokens(batch) / num_items_in_batch
        step_metrics = {key: metrics[key] * share for key in ("kl", "entropy")}
        for index, name in enumerate(("chosen", "rejected")):
            # a class mean over this batch, weighted by its count over the step's count of that class
            # (in evaluation, by this batch's share: the engine weighs batches by their size)
            count = int((labels if index == 0 else ~labels).sum())
            weight = count / max(float(self._class_counts[index]), 1.0) if model.training else share
            for key in (f"rewards/{name}", f"logps/{name}", f"logits/{name}"):
                step_metrics[key] = metrics[key] * weight if key in metrics else torch.zeros(())
        step_metrics["rewards/margins"] = step_metrics["rewards/chosen"] - step_metrics["rewards/rejected"]
        return self.router_aux.add(model, loss * share, result, step_metrics)

    @torch.no_grad()
    def _kl_log_ratios(self, model, batch: dict) -> torch.Tensor:
        """Policy − reference log-probs of the batch's mismatched (KL) completions."""
        return sequence_logprobs_of(model, *_rows(batch, "kl_")) - self._reference_logps(batch, "kl_")

    def _reference_logps(self, batch: dict, prefix: str) -> torch.Tensor:
        """Reference log-probs of the completions (or, with prefix "kl_", the mismatched ones)."""
        if f"ref_{prefix}logps" in batch:
            return batch[f"ref_{prefix}logps"]
        if self.reference is None:
            raise ValueError("KTO needs a reference: none was set up and none was precomputed")
        return self.reference.sequence_logprobs(*_rows(batch, prefix))

    # --- what a checkpoint keeps -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The synced reference's weights (``sync_ref_model``, sharded like the policy)."""
        return reference_state(self.reference, self.reference_options)


def _rows(batch: dict, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"], batch[f"{prefix}labels"]
