"""``fastalign train dpo|simpo|cpo|orpo``: learning from preference pairs, TRL's ``DPOTrainer`` and
``CPOTrainer``/``ORPOTrainer``.

Rows are prompt / chosen / rejected (TRL's preference format, conversational or not). A micro-batch of
P pairs is one forward of 2P rows: chosen rows first, rejected after. ``PreferenceLoss`` runs inside the
patched model's forward (``head_fn``): it takes the hidden states and never builds logits.

- dpo: the DPO family (``loss_type``, several with ``loss_weights``) against a reference policy, which is
  a frozen copy, the LoRA policy with its adapters off, or log-probs precomputed before training
  (``fastalign.train.reference``; with ``ld_alpha``, its weighted sums); ``sync_ref_model`` is TR-DPO,
  ``ld_alpha`` LD-DPO, ``f_divergence_type`` f-DPO, ``use_weighting`` WPO (``PreferenceLoss`` states
  each).
- simpo, cpo, orpo: reference-free. SimPO is TRL's CPO with loss type simpo (margin ``simpo_gamma``,
  chosen NLL weight ``cpo_alpha``, 1 by default as in TRL; 0 for the paper's loss); CPO's chosen NLL
  weight is ``cpo_alpha``; ORPO's odds ratio.

A loss term is a pair: each micro-batch's mean is weighted by its share of the step's pairs, so the
step's loss is the mean over all its pairs however they are split. The chosen NLL (CPO, ORPO, DPO's
'sft' loss type) is a token mean over the whole step: ``prepare_step`` counts the step's chosen tokens on
all ranks. (In evaluation, each batch's own.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.data.preference import PreferenceCollator, tokenize_preference_dataset
from fastalign.losses import PreferenceLoss
from fastalign.models.structure import IGNORE_INDEX, disable_dropout
from fastalign.patching.causal_lm import shift_labels
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.objectives.base import LENGTH_KEYS, Objective, Prepared, RunParts, pick
from fastalign.train.objectives.router_aux import RouterAuxLoss
from fastalign.train.reference import (
    Reference,
    ReferenceOptions,
    reference_state,
    setup_reference,
)

#: TRL's default ``beta`` of each (``beta: null`` in the config).
DEFAULT_BETA = {"dpo": 0.1, "simpo": 0.1, "cpo": 0.1, "orpo": 0.1}
#: DPO's own options (LD-DPO, f-DPO, WPO): simpo, cpo and orpo do not read them, so a set one is refused.
_DPO_ONLY = ("ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "use_weighting")
#: DPOOptions fields that are PreferenceLoss's arguments of the same name.
_LOSS_OPTIONS = (
    "beta", "loss_type", "loss_weights", "label_smoothing", "cpo_alpha", "alpha", "discopop_tau", *_DPO_ONLY
)  # fmt: skip
#: The keys each reads besides the lengths (``PreferenceLoss`` checks their values).
_LOSS_KEYS = {
    "dpo": (
        "beta",
        "loss_type",
        "loss_weights",
        "label_smoothing",
        "discopop_tau",
        *_DPO_ONLY,
        "router_aux_loss_coef",
    ),
    "simpo": ("beta", "simpo_gamma", "label_smoothing", "cpo_alpha", "alpha"),
    "cpo": ("beta", "loss_type", "label_smoothing", "cpo_alpha", "alpha"),
    "orpo": ("beta",),
}


@dataclass(frozen=True)
class DPOOptions:
    """The keys the DPO family reads (TRL's DPOConfig / CPOConfig / ORPOConfig names)."""

    beta: float
    loss_type: list[str]
    loss_weights: list[float] | None
    label_smoothing: float
    simpo_gamma: float
    cpo_alpha: float
    alpha: float  # cpo, simpo: AlphaPO
    discopop_tau: float  # dpo
    ld_alpha: float | None
    f_divergence_type: str
    f_alpha_divergence_coef: float
    use_weighting: bool
    max_length: int
    max_prompt_length: int | None
    truncation: bool
    truncation_mode: str  # dpo only (TRL's CPOConfig and ORPOConfig have none): keep_start for the others
    disable_dropout: bool
    chat_template_kwargs: dict | None  # template variables of conversational rows
    router_aux_loss_coef: float | None  # dpo only: a MoE policy's load-balancing loss weight

    @classmethod
    def from_config(cls, config: TrainConfig, name: str) -> DPOOptions:
        defaults = dict(beta=DEFAULT_BETA[name], loss_type=["sigmoid"], disable_dropout=True)
        options = options_from(config, cls, **defaults)
        if name == "cpo" and options.loss_type in (["simpo"], ["alphapo"]):
            given = options.loss_type[0]
            raise ConfigError(
                f"config key 'loss_type' ({given!r}): TRL's CPO loss type {given} "
                "is `fastalign train simpo`"
                + (
                    " with cpo_alpha: 0 and alpha (AlphaPO's shape)"
                    if options.loss_type == ["alphapo"]
                    else ""
                )
            )
        return options


class DPOObjective(Objective):
    """``PreferenceLoss`` on micro-batches of P pairs: rows 0..P-1 chosen, P..2P-1 rejected."""

    rows_per_example = 2  # the chosen and the rejected completion of a pair, one forward

    default_dataset = "tiny-preference"

    def __init__(
        self,
        name: str,
        options: DPOOptions,
        reference_options: ReferenceOptions,
        ctx: DistributedContext | None = None,
    ):
        super().__init__(ctx)
        self.name, self.options, self.reference_options = name, options, reference_options
        try:
            self.loss = PreferenceLoss(
                objective=name, gamma=options.simpo_gamma, **pick(options, *_LOSS_OPTIONS)
            )
        except ValueError as error:
            raise ConfigError(f"config for {name}: {error}") from None
        self.reference: Reference | None = None
        self._step_chosen_tokens = torch.ones(())
        # TRL's DPOConfig has the key; its CPO and ORPO trainers follow the model config
        self.router_aux = RouterAuxLoss(options.router_aux_loss_coef, config_key=name == "dpo")

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> DPOObjective:
        return cls(name, DPOOptions.from_config(config, name), ReferenceOptions.from_config(config), ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        # TRL's DPOConfig has a reference and truncation_mode; its CPOConfig and ORPOConfig neither
        own = {*ReferenceOptions.config_keys(), "truncation_mode"} if name == "dpo" else set()
        return frozenset({*_LOSS_KEYS[name], *LENGTH_KEYS, *own, "disable_dropout", "chat_template_kwargs"})

    # --- data --------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict], tokenizer) -> list:
        # TRL's CPO and ORPO trainers (simpo is CPO's) write BOS and EOS themselves; its DPO trainer does not
        keys = (*LENGTH_KEYS, "truncation_mode", "chat_template_kwargs")
        return tokenize_preference_dataset(
            rows, tokenizer, cpo_special_tokens=self.name != "dpo", **pick(self.options, *keys)
        )

    def collate(self, tokenizer) -> PreferenceCollator:
        return PreferenceCollator(tokenizer.pad_token_id)

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        if self.options.disable_dropout:
            disable_dropout(model)
        self.router_aux.setup(model)
        if self.loss.reference_free:
            return Prepared(train, evaluation)

        def score(reference: Reference, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            chosen, rejected = self._reference_logps(reference, batch).chunk(2)
            return {"ref_chosen_logp": chosen, "ref_rejected_logp": rejected}

        self.reference, (train, evaluation), callbacks = setup_reference(
            model, self.reference_options, parts, (train, evaluation), self.collate(parts.tokenizer), score
        )
        return Prepared(train, evaluation, callbacks)

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        local = sum(_chosen_tokens(batch) for batch in micro_batches)
        self._step_chosen_tokens = all_reduce_sum(local, self.ctx).cpu().clamp_min(1)
        self.router_aux.start_step(len(micro_batches), self.ctx.world_size)
        return micro_batches, {}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        pairs = self.loss_tokens(batch)
        targets = shift_labels(batch["labels"])
        references = {} if self.loss.reference_free else self._references(batch, pairs)
        # the loss is scaled by this batch's share below: pre-divide so the NLL ends as the step's mean
        nll_tokens = self._step_chosen_tokens * pairs / num_items_in_batch.cpu() if model.training else None

        def head(hidden, weight, bias, softcap=None):
            return self.loss(
                hidden, weight, targets, bias=bias, nll_tokens=nll_tokens, softcap=softcap, **references
            )

        result = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            head_fn=head,
            **self.router_aux.forward_kwargs(),
        )
        loss, metrics = result.head_output
        share = pairs / num_items_in_batch
        metrics = {key: value * share for key, value in metrics.items()}
        return self.router_aux.add(model, loss * share, result, metrics)

    def _references(self, batch: dict, pairs: int) -> dict[str, torch.Tensor]:
        """Precomputed in the batch, or from the reference model (chosen rows, then rejected)."""
        if "ref_chosen_logps" in batch:
            return {name: batch[name] for name in ("ref_chosen_logps", "ref_rejected_logps")}
        if self.reference is None:
            raise ValueError("this loss needs a reference: none was set up and none was precomputed")
        logps = self._reference_logps(self.reference, batch)
        return {"ref_chosen_logps": logps[:pairs], "ref_rejected_logps": logps[pairs:]}

    def _reference_logps(self, reference: Reference, batch: dict) -> torch.Tensor:
        """[2P] the reference's sequence log-probs of the batch's rows, with LD-DPO's ``ld_alpha`` token
        weights as the policy's get (they depend on the pair only, so precomputing them is exact)."""
        targets = shift_labels(batch["labels"])
        tokens = reference.token_logprobs(batch["input_ids"], batch["attention_mask"], targets)
        weights = self.loss.token_weights(targets)
        return (tokens if weights is None else tokens * weights).sum(-1)

    # --- what a checkpoint keeps -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """TR-DPO's synced reference weights (sharded like the policy); nothing otherwise."""
        return reference_state(self.reference, self.reference_options)


def _chosen_tokens(batch: dict) -> int:
    """Target tokens of the chosen rows (the first half; labels are unshifted, so the first is none)."""
    return int((batch["labels"][: batch["labels"].shape[0] // 2, 1:] != IGNORE_INDEX).sum())
