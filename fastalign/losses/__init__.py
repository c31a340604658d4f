"""Losses users and trainers hold: they take hidden states and the LM-head weight, never logits."""

from fastalign.losses.grpo import GRPOLoss, GRPOLossOutput
from fastalign.losses.preference import KTOLoss, PreferenceLoss, PreferenceLossOutput
from fastalign.losses.rloo import RLOOLoss, RLOOLossOutput

__all__ = [
    "GRPOLoss",
    "GRPOLossOutput",
    "KTOLoss",
    "PreferenceLoss",
    "PreferenceLossOutput",
    "RLOOLoss",
    "RLOOLossOutput",
]
