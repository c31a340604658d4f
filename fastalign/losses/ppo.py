"""PPO's math (TRL's former ``PPOTrainer``, trl 0.11-0.19, after OpenAI's summarize-from-feedback):
the per-token rewards with the KL to the reference folded in, whitening, the clipped policy loss straight
from hidden states (``PPOLoss``: no logits) and the clipped value loss. The advantages in between are
``fastalign.ops.generalized_advantage_estimation``.

Masks are bool [B, T], True on a completion's tokens; every mean is over them (TRL's ``masked_mean``).
"""

from __future__ import annotations

from collections.abc import Callable
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

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """The mean of ``values`` where ``mask`` is True (NaN elsewhere never reaches it)."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def whiten(
    values: Tensor, shift_mean: bool = True, sum_all: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """TRL's ``masked_whiten`` of the entries of ``values`` (the masked-in ones, gathered flat):
    (x − mean)·rsqrt(var + 1e-8) with the unbiased variance (1 entry: its biased variance, 0, where TRL
    would divide by zero); ``shift_mean=False`` adds the mean back (only the scale changes).

    ``sum_all``: the sum of a tensor over every process that holds a part of the batch (each process
    passes its own entries), so that the mean and variance are the whole batch's, as in one process;
    None: ``values`` are the whole batch."""
    values = values.float()
    sum_all = sum_all or (lambda tensor: tensor)
    count, total = sum_all(torch.stack([values.new_tensor(values.numel()), values.sum()]))
    mean = total / count.clamp(min=1)
    variance = sum_all((values - mean).square().sum()) / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate of the sampling policy to the reference (Schulman's estimators): k1 =
    log π − log π_ref (unbiased, can be negative), k3 = (r − 1) − log r with r = π_ref / π (≥ 0)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = ref_logprobs.float() - logprobs.float()
    return -log_ratio if estimator == "k1" else torch.expm1(log_ratio) - log_ratio


class ShapedRewards(NamedTuple):
    rewards: Tensor  # [B, T] fp32: −kl_coef·kl per token, the score added at the last token; 0 off the mask
    kl: Tensor  # [B, T] fp32 per-token KL estimate, 0 off the mask
    non_score_reward: Tensor  # [B, T] fp32: −kl_coef·kl


def shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    kl_coef: float,
    estimator: str,
) -> ShapedRewards:
    """The per-token rewards PPO's advantages are computed from: the KL penalty on every completion token
    and the completion's ``score`` [B] on its last one (a completion without tokens gets none). No
    reference (``kl_coef`` 0): no penalty."""
    zero = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    kl = (
        zero
        if ref_logprobs is None
        else torch.where(mask, kl_penalty(logprobs, ref_logprobs, estimator), 0.0)
    )
    non_score = -kl_coef * kl
    last = (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask  # the last True of each row
    rewards = non_score + torch.where(last, scores.float()[:, None], 0.0)
    return ShapedRewards(rewards, kl, non_score)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss and its clip fraction: ½·mean(max((V − R)², (clip(V, V_old ± ε) − R)²))
    over the mask, and the share of tokens where the clipped term is the larger."""
    values = values.float()
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss, clipped_loss = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).float(), mask)


class PPOLossOutput(NamedTuple):
    loss: Tensor
    metrics: dict[str, Tensor]  # TRL's PPO names (detached)


class PPOLoss(CompletionLoss):
    """PPO's clipped policy loss from the policy's completion hidden states.

    Token log-probs come from the fused, chunked linear log-softmax at ``temperature`` (no [tokens,
    vocab] logits); with ratio r = exp(log π − log π_old) and per-token advantages A,
    loss = mean over the mask of max(−A·r, −A·clip(r, 1 − ``cliprange``, 1 + ``cliprange``)). Metrics
    (TRL's names, means over the mask): ``loss/policy_avg``, ``policy/approxkl_avg`` (½·(log r)²),
    ``policy/clipfrac_avg``, ``policy/entropy_avg``, ``val/ratio`` and ``val/ratio_var`` (the variance
    of the tokens' r)."""

    def __init__(
        self,
        *,
        cliprange: float = 0.2,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        backend: Backend = "auto",
    ):
        super().__init__(temperature=temperature, chunk_size=chunk_size, backend=backend)
        self.cliprange = validation.real("cliprange", cliprange)
        if self.cliprange < 0:
            raise ValueError(f"cliprange must be >= 0, got {self.cliprange}")

    def completion_loss(self, completions: Completions, *, old_logps: Tensor) -> PPOLossOutput:
        """``loss(hidden, weight, completion_ids, completion_mask, advantages, old_logps=..., bias=None)``:
        the loss of completions [B, T] from their hidden states [B, T, D] (the state predicting each token)
        and the LM head ``weight`` [V, D]; ``advantages`` and ``old_logps`` (the sampling policy's token
        log-probs) are [B, T]. One host sync checks the mask's and the advantages' values."""
        check_completion_inputs(completions, per_token={"old_logps": old_logps}, token_advantages=True)
        completion_value_checks(completions.completion_mask, completions.advantages).raise_first()

        mask = completions.completion_mask.bool()
        logps, entropy = self.token_logprobs(completions)
        advantages = torch.where(mask, completions.advantages.float(), 0.0)
        log_ratio = torch.where(mask, logps - old_logps.float(), 0.0)
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1.0 - self.cliprange, 1.0 + self.cliprange)
        loss = masked_mean(torch.max(unclipped, clipped), mask)
        with torch.no_grad():
            ratio_mean = masked_mean(ratio, mask)
            metrics = {
                "loss/policy_avg": loss.detach(),
                "policy/approxkl_avg": masked_mean(0.5 * log_ratio.square(), mask),
                "policy/clipfrac_avg": masked_mean((clipped > unclipped).float(), mask),
                "policy/entropy_avg": masked_mean(entropy.float(), mask),
                "val/ratio": ratio_mean,
                "val/ratio_var": masked_mean((ratio - ratio_mean).square(), mask),
            }
        return PPOLossOutput(loss, metrics)
