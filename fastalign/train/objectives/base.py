"""The contract between the engine and an objective."""

from __future__ import annotations

from typing import Protocol

import torch


class Objective(Protocol):
    """One training objective. The engine sums ``loss_tokens`` over every micro-batch of a step on
    every rank, and passes that total to ``compute_loss``, whose losses therefore add up (over
    micro-batches and ranks) to the mean over the whole accumulated batch: gradient accumulation and
    data parallelism are exact, whatever the lengths.

    An objective may also define ``prepare_step(model, micro_batches, step) -> (micro_batches,
    metrics)``: the engine calls it first in every step, with the data's micro-batches, to build the
    training batches (GRPO generates completions and scores them there). Its metrics are already
    global (every rank returns the same values)."""

    def loss_tokens(self, batch: dict) -> int:
        """The number of loss terms (tokens, sequences, ...) in ``batch``."""
        ...

    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """This micro-batch's share of the step's loss (its sum over ``num_items_in_batch``), and
        metrics to log, normalised the same way (a mean over the micro-batch's loss terms, times their
        count over ``num_items_in_batch``), so that their sum over the step is the step's mean."""
        ...
