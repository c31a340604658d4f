"""Training objectives: what one micro-batch's loss is. The engine owns the loop; an objective owns
the math (SFT here; DPO and GRPO plug in the same way)."""

from fastalign.train.objectives.base import Objective
from fastalign.train.objectives.sft import SFTObjective

__all__ = ["Objective", "SFTObjective"]
