"""The contract between the engine and an objective."""

from __future__ import annotations

from typing import Protocol

import torch


class Objective(Protocol):
    """One training objective. The engine sums ``loss_tokens`` over every micro-batch of a step on
    every rank, and passes that total to ``compute_loss``, whose losses therefore add up (over
    micro-batches and ranks) to the mean over the whole accumulated batch: gradient accumulation and
    data parallelism are exact, whatever the lengths."""

    def loss_tokens(self, batch: dict) -> int:
        """The number of loss terms (tokens, sequences, ...) in ``batch``."""
        ...

    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the step's loss (its sum over ``num_items_in_batch``), and
        metrics to log (sums over the micro-batch, normalised the same way)."""
        ...
