"""Supervised fine-tuning: next-token cross-entropy on the label tokens, fused in the patched model."""

from __future__ import annotations

import torch

from fastalign.data.collate import IGNORE_INDEX


class SFTObjective:
    """Token-mean cross-entropy over the accumulated batch. The model computes it inside its forward
    (``labels`` + ``num_items_in_batch``, as transformers defines them); once patched, through the
    fused linear cross-entropy, so no logits are built."""

    def loss_tokens(self, batch: dict) -> int:
        # The model shifts labels by one: the first label of each row is never a target.
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = model(**batch, num_items_in_batch=num_items_in_batch)
        return out.loss, {}
