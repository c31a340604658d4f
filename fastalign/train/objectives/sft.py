"""``fastalign train sft``: supervised fine-tuning, TRL's ``SFTTrainer``.

Rows are text, messages or prompt-completion (TRL's formats), tokenized with the chat template where
there is one, padded or packed into micro-batches by ``packing_strategy`` (``fastalign.data.packing``):
bfd and bfd_split pack whole examples (pieces, for bfd_split) that keep their own positions; wrapped
cuts the examples' concatenation into ``max_length`` blocks, which batch as ordinary padded rows. The
loss is the model's own next-token cross-entropy on the label tokens (``labels`` +
``num_items_in_batch``, as transformers defines them), which the patched head computes with the fused
linear cross-entropy: no logits are built (``loss_type: dft`` weights each token's by its detached
probability, as TRL's DFT). A loss term is a target token, so the step's loss is the token mean over
the whole accumulated batch; ``entropy`` and ``mean_token_accuracy`` are token means too, as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.data import split_long_examples, tokenize_sft_dataset, wrap_examples
from fastalign.models.structure import IGNORE_INDEX
from fastalign.train.config import ConfigError, TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import Objective, Prepared, RunParts, pick
from fastalign.train.objectives.router_aux import RouterAuxLoss

#: SFTOptions fields that are ``tokenize_sft_dataset``'s arguments of the same name.
_TOKENIZE_KEYS = (
    "truncation",
    "truncation_mode",
    "completion_only_loss",
    "assistant_only_loss",
    "dataset_text_field",
    "chat_template_kwargs",
)
#: TRL's SFT losses: nll, the token-mean cross-entropy; dft, Dynamic Fine-Tuning (arXiv 2508.05629), each
#: token's cross-entropy weighted by its probability (detached), -p·log p.
SFT_LOSS_TYPES = ("nll", "dft")
#: Packing strategies that split examples longer than max_length rather than refuse or truncate them.
_SPLITTING = {"bfd_split": split_long_examples, "wrapped": wrap_examples}


@dataclass(frozen=True)
class SFTOptions:
    """The keys SFT reads (TRL's SFTConfig names)."""

    max_length: int
    truncation: bool
    truncation_mode: str
    packing: bool
    packing_strategy: str
    completion_only_loss: bool | None  # None: on for prompt-completion rows
    assistant_only_loss: bool
    dataset_text_field: str
    chat_template_kwargs: dict | None
    loss_type: list[str]  # one of SFT_LOSS_TYPES (TRL's SFTConfig takes one name; the config holds a list)
    router_aux_loss_coef: float | None  # a MoE policy's load-balancing loss weight (None: the model's)

    @classmethod
    def from_config(cls, config: TrainConfig) -> SFTOptions:
        options = options_from(config, cls, loss_type=["nll"])
        if len(options.loss_type) != 1 or options.loss_type[0] not in SFT_LOSS_TYPES:
            raise ConfigError(
                f"config key 'loss_type' for sft must be one of {', '.join(SFT_LOSS_TYPES)} (one value), "
                f"got {options.loss_type!r}"
            )
        if options.packing_strategy != "bfd" and not options.packing:
            raise ConfigError(
                f"config key 'packing_strategy' ({options.packing_strategy!r}) chooses how packing packs: "
                "it needs packing: true"
            )
        if options.packing and options.packing_strategy in _SPLITTING and options.truncation:
            raise ConfigError(
                f"config key 'truncation' has no effect with packing_strategy {options.packing_strategy!r}, "
                "which splits long examples instead of cutting them: remove it"
            )
        return options


class SFTObjective(Objective):
    """Token-mean cross-entropy (or DFT's probability-weighted one) over the accumulated batch, computed
    by the patched model's fused head, which also hands back each target's entropy and whether it is
    the argmax: TRL's ``entropy`` and ``mean_token_accuracy`` metrics, without logits."""

    default_dataset = "tiny-sft"
    default_learning_rate = 2e-5

    def __init__(self, options: SFTOptions | None = None, ctx: DistributedContext | None = None):
        super().__init__(ctx)
        self.options = options or SFTOptions.from_config(TrainConfig())
        packs_bins = self.options.packing and self.options.packing_strategy != "wrapped"
        self.packing_length = self.options.max_length if packs_bins else None
        self.router_aux = RouterAuxLoss(self.options.router_aux_loss_coef)

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> SFTObjective:
        return cls(SFTOptions.from_config(config), ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(SFTOptions.__dataclass_fields__)

    def tokenize(self, rows: list[dict], tokenizer) -> list:
        """Examples, or with a splitting ``packing_strategy`` their pieces or blocks (TRL packs the
        evaluation set too, by default): rows are then never refused for their length."""
        options = self.options
        split = _SPLITTING.get(options.packing_strategy) if options.packing else None
        examples = tokenize_sft_dataset(
            rows,
            tokenizer,
            max_length=None if split else options.max_length,
            **pick(options, *_TOKENIZE_KEYS),
        )
        return split(examples, options.max_length) if split else examples

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        self.router_aux.setup(model)
        return super().setup(model, train, evaluation, parts)

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        self.router_aux.start_step(len(micro_batches), self.ctx.world_size)
        return micro_batches, {}

    def loss_tokens(self, batch: dict) -> int:
        # The model shifts labels by one: the first label of each row is never a target.
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dft = self.options.loss_type == ["dft"]
        # with the router's aux loss, per token: the model's "mean" would add it unscaled by the step's share
        per_token = dft or self.router_aux.enabled
        out = model(
            **batch,
            num_items_in_batch=num_items_in_batch,
            loss_reduction="none" if per_token else "mean",
            return_token_stats=True,
            return_logits=False,  # also when evaluating: the loss and its metrics come from the fused head
            **self.router_aux.forward_kwargs(),
        )
        if getattr(out, "token_stats", None) is None:
            raise TypeError(
                "sft computes its loss and metrics with fastalign's fused head: patch the model first "
                "(fastalign.patch_model; fastalign train does)"
            )
        count = num_items_in_batch.to(out.token_stats.entropy.device).float()
        # DFT: the gradient of -p·log p with p held constant is p times cross-entropy's (0 where ignored)
        weights = torch.exp(-out.loss).detach() if dft else 1.0
        loss = (out.loss * weights).sum() / count if per_token else out.loss
        metrics = {
            "entropy": out.token_stats.entropy.sum() / count,
            "mean_token_accuracy": out.token_stats.accuracy.sum() / count,
        }
        return self.router_aux.add(model, loss, out, metrics)
