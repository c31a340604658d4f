"""``GRPOLoss``: GRPO's policy loss straight from hidden states, with TRL's options and metric names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from fastalign.losses.completion import (
    CompletionLoss,
    Completions,
    check_completion_inputs,
    completion_value_checks,
)
from fastalign.ops import token_logprobs, validation
from fastalign.ops.backend import Backend
from fastalign.ops.grpo import (
    TokenLossConfig,
    TokenLossInputs,
    completion_clip_fractions,
    grpo_token_objective,
    high_entropy_mask,
    sequence_log_weights,
    unchecked_grpo_token_loss,
)
from fastalign.ops.linear_cross_entropy import token_objective

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


class GRPOLossOutput(NamedTuple):
    loss: Tensor
    metrics: dict[str, Tensor]  # TRL's names: kl, entropy, clip_ratio/{low,high,region}_mean (detached)
    per_token_logps: Tensor  # [B, T] detached: what the trainer keeps as old log-probs


class GRPOLoss(CompletionLoss):
    """The GRPO family's clipped policy loss from the policy's completion hidden states.

    Per-token log-probs come from the fused, chunked linear log-softmax (no [tokens, vocab] logits,
    temperature-scaled); the token math (importance ratio at token or sequence level, clip with
    ``epsilon``/``epsilon_high``, optional ``delta`` cap, k3 KL times ``beta``, and with
    ``use_bias_correction_kl`` (TRL's default) times the importance ratio too) is one kernel; the
    aggregation follows ``loss_type``:

    - grpo: mean over each completion's tokens, then over completions;
    - bnpo: mean over all completion tokens of this micro-batch;
    - dr_grpo: sum over tokens / (completions · ``max_completion_length``);
    - dapo, cispo: sum over tokens / ``num_items_in_batch`` (the completion-token count of the whole
      accumulated batch across ranks: exact under gradient accumulation and data parallelism; this
      micro-batch's count when not given). cispo: −sg(min(ratio, ``epsilon_high``))·A·log π.

    ``top_entropy_quantile`` ρ < 1 (TRL's entropy mask, "Beyond the 80/20 rule") keeps the policy term
    of the tokens whose entropy (of the temperature-scaled distribution, at the current policy) is in
    the top ρ of this micro-batch's completion tokens (``high_entropy_mask``: over every process's
    when ``entropy_gather`` gathers them, as TRL); the KL term, the normaliser and the metrics keep every
    token, as TRL's. The mask needs every entropy before any gradient: see ``_entropy_masked``.

    Option names follow TRL's ``GRPOConfig``; ``chunk_size`` (tokens per logits chunk) trades memory for
    speed as in ``linear_cross_entropy``.
    """

    def __init__(
        self,
        *,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        loss_type: LossType = "dapo",
        importance_sampling_level: Literal["token", "sequence"] = "token",
        temperature: float = 1.0,
        max_completion_length: int | None = None,
        use_bias_correction_kl: bool = True,
        top_entropy_quantile: float = 1.0,
        entropy_gather: Callable[[Tensor], Tensor] | None = None,
        chunk_size: int | None = None,
        backend: Backend = "auto",
    ):
        super().__init__(temperature=temperature, chunk_size=chunk_size, backend=backend)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {importance_sampling_level!r}"
            )
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass it")
        if max_completion_length is not None:
            validation.positive_int("max_completion_length", max_completion_length)
        beta, epsilon = validation.real("beta", beta), validation.real("epsilon", epsilon)
        if epsilon_high is not None:
            epsilon_high = validation.real("epsilon_high", epsilon_high)
        if delta is not None:
            delta = validation.real("delta", delta)
        top_entropy_quantile = validation.real("top_entropy_quantile", top_entropy_quantile)
        if not 0.0 <= top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
        if beta < 0 or epsilon < 0 or (epsilon_high is not None and epsilon_high < 0):
            raise ValueError(
                f"beta, epsilon and epsilon_high must be >= 0, got {beta}, {epsilon}, {epsilon_high}"
            )
        if delta is not None and delta <= 1.0 + (epsilon_high if epsilon_high is not None else epsilon):
            raise ValueError(f"delta must exceed 1 + epsilon_high, got {delta}")
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.top_entropy_quantile = top_entropy_quantile
        self.entropy_gather = entropy_gather
        self.config = TokenLossConfig(
            beta=float(beta),
            eps_low=float(epsilon),
            eps_high=float(epsilon if epsilon_high is None else epsilon_high),
            delta=None if delta is None else float(delta),
            sequence_level=importance_sampling_level == "sequence",
            cispo=loss_type == "cispo",
            bias_correction_kl=use_bias_correction_kl and beta > 0,
        )

    @property
    def per_token(self) -> bool:
        """Whether a loss term is a completion token (bnpo, dapo, cispo) or a completion (grpo, dr_grpo):
        what a trainer counts to weigh micro-batches, so that a step's loss is its mean over those."""
        return self.loss_type in ("bnpo", "dapo", "cispo")

    @property
    def uses_item_count(self) -> bool:
        """Whether this loss type normalises by ``num_items_in_batch`` (the step's completion-token count
        on all ranks: dapo, cispo); the others normalise per micro-batch and refuse one."""
        return self.loss_type in ("dapo", "cispo")

    def _keep(self, entropy: Tensor, mask: Tensor) -> Tensor | None:
        """The high-entropy mask of the policy term; None when ``top_entropy_quantile`` is 1 (all tokens)."""
        if self.top_entropy_quantile == 1.0:
            return None
        return high_entropy_mask(entropy, mask, self.top_entropy_quantile, self.entropy_gather)

    def _sequence_weights(self, mask: Tensor, num_items_in_batch) -> Tensor:
        """norm_b of every completion: loss = Σ_b norm_b Σ_t mask·loss_t."""
        batch = mask.shape[0]
        if self.loss_type == "grpo":
            return 1.0 / (batch * mask.sum(-1).clamp(min=1.0))
        if self.loss_type == "bnpo":
            total = mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            total = torch.tensor(float(batch * self.max_completion_length), device=mask.device)
        else:  # dapo, cispo (num_items_in_batch: a positive count, checked in forward)
            total = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
            total = total.to(mask.device, torch.float32).clamp(min=1.0)
        return (1.0 / total).expand(batch)

    def completion_loss(
        self,
        completions: Completions,
        *,
        old_per_token_logps: Tensor | None = None,
        ref_per_token_logps: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
    ) -> GRPOLossOutput:
        """``loss(hidden, weight, completion_ids, completion_mask, advantages, bias=None, ...)``: the
        loss of completions [B, T] from their hidden states [B, T, D] (the state predicting each
        completion token) and the LM head ``weight`` [V, D]; ``advantages`` [B].

        ``completion_mask`` is a 0/1 mask (bool or integer); masked tokens are ignored targets of the
        fused log-softmax, so whatever their hidden states hold (NaN at padding) reaches nothing, and
        their ``per_token_logps`` are 0. One host sync checks the values of the mask, the advantages
        and a tensor ``num_items_in_batch``."""
        check_completion_inputs(
            completions,
            per_token={
                "old_per_token_logps": old_per_token_logps,
                "ref_per_token_logps": ref_per_token_logps,
            },
        )
        hidden, weight, _, completion_mask, advantages, bias, softcap = completions
        if self.config.beta > 0 and ref_per_token_logps is None:
            raise ValueError("beta > 0 needs ref_per_token_logps")
        checks = completion_value_checks(completion_mask, advantages)
        if num_items_in_batch is not None and not self.uses_item_count:
            raise ValueError(
                f"num_items_in_batch is used by loss_type 'dapo' and 'cispo' only; {self.loss_type!r} would "
                "ignore it"
            )
        if num_items_in_batch is not None:
            num_items_in_batch = validation.item_count("num_items_in_batch", num_items_in_batch)
            if isinstance(num_items_in_batch, torch.Tensor):
                checks.positive("num_items_in_batch", num_items_in_batch)
        checks.raise_first()

        mask = completion_mask.to(torch.float32)
        targets = completions.targets
        seq_weight = self._sequence_weights(mask, num_items_in_batch)
        ref = ref_per_token_logps if self.config.beta else None
        if self.config.sequence_level:  # every log-prob of a completion is needed before its ratio
            logps, entropy = token_logprobs(hidden, weight, targets, bias, **self.fused_options(softcap))
            loss, sums = unchecked_grpo_token_loss(
                logps,
                mask,
                advantages,
                seq_weight,
                self.config,
                old_logp=old_per_token_logps,
                ref_logp=ref,
                keep=self._keep(entropy, mask),
                backend=self.backend,
            )
            log_weights = sequence_log_weights(logps.detach(), mask, old_per_token_logps)
            clip = completion_clip_fractions(logps, mask, advantages, self.config, old_per_token_logps)
            metrics = self._metrics(sums, mask, entropy.detach(), clip, advantages, log_weights)
            return GRPOLossOutput(loss, metrics, logps.detach())
        if self.top_entropy_quantile < 1.0:
            return self._entropy_masked(
                completions._replace(completion_mask=mask), targets, seq_weight, old_per_token_logps, ref
            )
        # Token level: each token's loss needs only its own log-prob, so the gradient is formed chunk
        # by chunk in the forward pass and the logits are built once.
        inputs = TokenLossInputs.build(mask, advantages, seq_weight, old_per_token_logps, ref)
        objective = grpo_token_objective(inputs, self.config, self.backend)
        result = token_objective(hidden, weight, targets, objective, bias, **self.fused_options(softcap))
        sums = torch.cat([result.loss.detach().reshape(1), result.aux])
        clip = completion_clip_fractions(result.logprobs, mask, advantages, self.config, old_per_token_logps)
        return GRPOLossOutput(result.loss, self._metrics(sums, mask, result.entropy, clip), result.logprobs)

    def _entropy_masked(self, completions: Completions, targets, seq_weight, old, ref) -> GRPOLossOutput:
        """Token level with ``top_entropy_quantile`` < 1. The threshold needs every token's entropy before
        any token's gradient, and the head's gradient sums over tokens, so (short of keeping [tokens,
        vocab] probabilities) the logits are built twice: a forward-only pass of the fused head gives
        every log-prob and entropy (2·N·V·D), then the fused gradient pass (6·V·D a token) runs on the
        tokens whose gradient is not 0 alone: the kept ones, or with a KL term (whose gradient every
        token has) all completion tokens. At ρ = 0.2 without KL that is 3.2·N·V·D, under the 6 of the
        unmasked loss; with KL, 8. Loss and gradient are those of the unmasked formula times the mask
        (a dropped token's policy term and gradient are 0); the metrics come from the first pass.
        ``completions``' mask is the float one."""
        hidden, weight, _, mask, advantages, bias, softcap = completions
        with torch.no_grad():
            logps, entropy = token_logprobs(hidden, weight, targets, bias, **self.fused_options(softcap))
            keep = self._keep(entropy, mask)
            # every token's KL and clip flags (the second pass sees the kept tokens alone without KL)
            _, sums = unchecked_grpo_token_loss(
                logps,
                mask,
                advantages,
                seq_weight,
                self.config,
                old_logp=old,
                ref_logp=ref,
                keep=keep,
                backend=self.backend,
            )
        rows = keep if not self.config.beta else mask != 0
        if not rows.any():  # no token has a gradient: a loss of 0, still a function of the inputs
            leaves = [tensor for tensor in (hidden, weight, bias) if tensor is not None]
            loss = sum(tensor.narrow(-1, 0, 0).float().sum() for tensor in leaves)  # views, no copy
        else:
            inputs = TokenLossInputs.build(mask, advantages, seq_weight, old, ref, keep)
            objective = grpo_token_objective(inputs.rows(rows.reshape(-1)), self.config, self.backend)
            loss = token_objective(
                hidden[rows], weight, targets[rows], objective, bias, **self.fused_options(softcap, False)
            ).loss
        clip = completion_clip_fractions(logps, mask, advantages, self.config, old)
        return GRPOLossOutput(loss, self._metrics(sums, mask, entropy, clip), logps)

    def _metrics(self, sums, mask, entropy, clip, advantages=None, log_weights=None) -> dict:
        """Masked means over this micro-batch's completion tokens, as TRL logs them; at sequence level
        the clip fractions are the mean over completions of each completion's flag. ``clip``: each
        completion's low- and high-clipped shares (``completion_clip_fractions``), whose smallest and
        largest (NaN-skipping: a completion without tokens has none; 0 when none has any) TRL logs as
        ``clip_ratio/low_min`` and ``clip_ratio/high_max``; over this micro-batch (a trainer with
        several ranks takes the extremes over all of them: ``fastalign.train.objectives.grpo``)."""
        tokens = mask.sum().clamp(min=1.0)
        _, kl, low, high, region = sums / tokens
        if log_weights is not None:
            low, high, region = self._sequence_clip_fractions(advantages.float(), log_weights.exp())
        metrics = {"entropy": (entropy * mask).sum() / tokens}
        if self.config.beta:
            metrics["kl"] = kl
        if self.config.cispo:
            metrics["cispo_clip_ratio"] = high
        else:
            metrics |= {
                "clip_ratio/low_mean": low,
                "clip_ratio/high_mean": high,
                "clip_ratio/region_mean": region,
                "clip_ratio/low_min": _nan_extreme(clip[0], torch.min),
                "clip_ratio/high_max": _nan_extreme(clip[1], torch.max),
            }
        return metrics

    def _sequence_clip_fractions(self, advantages: Tensor, ratio: Tensor):
        config = self.config
        if config.cispo:
            high = (ratio > config.eps_high) & (advantages > 0)
            return torch.zeros(()), high.float().mean(), high.float().mean()
        if config.delta is not None:
            ratio = ratio.clamp(max=config.delta)
        low = (ratio < 1 - config.eps_low) & (advantages < 0)
        high = (ratio > 1 + config.eps_high) & (advantages > 0)
        return low.float().mean(), high.float().mean(), (low | high).float().mean()


def _nan_extreme(values: Tensor, extreme: Callable[[Tensor], Tensor]) -> Tensor:
    """``extreme`` (torch.min or torch.max) of the values that are not NaN (TRL's ``nanmin``/``nanmax``);
    0 when all are, where TRL's is NaN: a micro-batch without a completion token (all truncated and
    masked, say) leaves every metric finite, as the others, and the step's sum of them too."""
    kept = values[~values.isnan()]
    return extreme(kept) if kept.numel() else values.new_zeros(())
