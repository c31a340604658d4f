"""``RLOOLoss``: TRL's ``RLOOTrainer`` policy loss straight from hidden states, with its metric names."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fastalign.losses.completion import (
    CompletionLoss,
    Completions,
    check_completion_inputs,
    completion_value_checks,
)
from fastalign.ops import validation
from fastalign.ops.backend import Backend


class RLOOLossOutput(NamedTuple):
    loss: Tensor
    metrics: dict[str, Tensor]  # TRL's names: entropy, clip_ratio/{low,high,region}_mean (detached)
    logps: Tensor  # [B] detached sequence log-probs: what the trainer keeps as old log-probs


class RLOOLoss(CompletionLoss):
    """RLOO's clipped policy loss at the sequence level, from the policy's completion hidden states.

    A completion's log-prob is the sum of its tokens' (fused, chunked linear log-softmax at
    ``temperature``: no [tokens, vocab] logits); its importance ratio r = exp(log π − log π_old) is
    clipped as PPO's, −min(r·A, clamp(r, 1 − ``epsilon``, 1 + ``epsilon_high``)·A), and the loss is
    the mean over the micro-batch's completions. The KL to a reference is not here: RLOO folds it into
    the rewards before the advantages. Without ``old_logps`` the ratio is 1 (its value; the gradient is
    the policy gradient A·∇log π), as when a generation serves one optimizer step.
    """

    def __init__(
        self,
        *,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        backend: Backend = "auto",
    ):
        super().__init__(temperature=temperature, chunk_size=chunk_size, backend=backend)
        epsilon = validation.real("epsilon", epsilon)
        if epsilon_high is not None:
            epsilon_high = validation.real("epsilon_high", epsilon_high)
        if epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
            raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon}, {epsilon_high}")
        self.eps_low = float(epsilon)
        self.eps_high = float(epsilon if epsilon_high is None else epsilon_high)

    def completion_loss(self, completions: Completions, *, old_logps: Tensor | None = None) -> RLOOLossOutput:
        """``advantages`` and ``old_logps`` (the sampling policy's sequence log-probs) are [B]. Masked
        tokens are ignored targets, whatever their hidden states hold; one host sync checks the mask's
        and the advantages' values."""
        check_completion_inputs(completions, per_token={}, old_logps=old_logps)
        advantages = completions.advantages
        if old_logps is not None and old_logps.shape != advantages.shape:
            raise ValueError(
                f"old_logps must have shape [B] = {tuple(advantages.shape)}, got {tuple(old_logps.shape)}"
            )
        completion_value_checks(completions.completion_mask, advantages).raise_first()

        mask = completions.completion_mask.to(torch.float32)
        token_logps, entropy = self.token_logprobs(completions)
        logps = token_logps.sum(-1)  # ignored targets' log-probs are 0
        old = logps.detach() if old_logps is None else old_logps.float()
        advantages = advantages.float()
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - self.eps_low, 1 + self.eps_high)
        loss = -torch.min(ratio * advantages, clipped * advantages).mean()
        ratio = ratio.detach()
        low = (ratio < 1 - self.eps_low) & (advantages < 0)
        high = (ratio > 1 + self.eps_high) & (advantages > 0)
        metrics = {
            "entropy": (entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0),
            "clip_ratio/low_mean": low.float().mean(),
            "clip_ratio/high_mean": high.float().mean(),
            "clip_ratio/region_mean": (low | high).float().mean(),
        }
        return RLOOLossOutput(loss, metrics, logps.detach())
