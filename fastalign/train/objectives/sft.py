"""``fastalign train sft``: supervised fine-tuning, TRL's ``SFTTrainer``.

Rows are text, messages or prompt-completion (TRL's formats), tokenized with the chat template where
there is one, padded or packed (best-fit decreasing) into micro-batches. The loss is the model's own
next-token cross-entropy on the label tokens (``labels`` + ``num_items_in_batch``, as transformers
defines them), which ``patch_model`` computes with the fused linear cross-entropy: no logits are built.
A loss term is a target token, so the step's loss is the token mean over the whole accumulated batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastalign.data import tokenize_sft_dataset
from fastalign.models.structure import IGNORE_INDEX
from fastalign.train.config import TrainConfig, options_from
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import Objective, pick

#: SFTOptions fields that are ``tokenize_sft_row``'s arguments of the same name.
_TOKENIZE_KEYS = ("max_length", "truncation", "completion_only_loss", "assistant_only_loss")


@dataclass(frozen=True)
class SFTOptions:
    """The keys SFT reads (TRL's SFTConfig names)."""

    max_length: int
    truncation: bool
    packing: bool
    completion_only_loss: bool | None  # None: on for prompt-completion rows
    assistant_only_loss: bool

    @classmethod
    def from_config(cls, config: TrainConfig) -> SFTOptions:
        return options_from(config, cls)


class SFTObjective(Objective):
    """Token-mean cross-entropy over the accumulated batch, computed by the (patched) model itself."""

    default_dataset = "tiny-sft"
    needs_fused_head = False  # the model's own loss: fused once patched, plain otherwise

    def __init__(self, options: SFTOptions | None = None, ctx: DistributedContext | None = None):
        super().__init__(ctx)
        self.options = options or SFTOptions.from_config(TrainConfig())
        self.packing_length = self.options.max_length if self.options.packing else None

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> SFTObjective:
        return cls(SFTOptions.from_config(config), ctx)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(SFTOptions.__dataclass_fields__)

    def tokenize(self, rows: list[dict], tokenizer) -> list:
        return tokenize_sft_dataset(rows, tokenizer, **pick(self.options, *_TOKENIZE_KEYS))

    def loss_tokens(self, batch: dict) -> int:
        # The model shifts labels by one: the first label of each row is never a target.
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = model(**batch, num_items_in_batch=num_items_in_batch)
        return out.loss, {}
