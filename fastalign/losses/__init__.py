"""Losses users and trainers hold: they take hidden states and the LM-head weight, never logits."""

from fastalign.losses.grpo import GRPOLoss, GRPOLossOutput

__all__ = ["GRPOLoss", "GRPOLossOutput"]
