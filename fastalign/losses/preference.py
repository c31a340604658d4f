"""``PreferenceLoss`` (DPO family, SimPO, CPO, ORPO) and ``KTOLoss`` from hidden states, never logits.

The policy's sequence log-probs come from the fused, chunked linear log-softmax with the loss's
gradient formed in the forward, in chunks of whole pairs (DPO family) or completions (KTO)
(``linear_pair_objective``, ``linear_sequence_objective``), or from per-token log-probs
(``token_logprobs``) where a unit is too long for that; reference passes run under ``no_grad`` (or use
precomputed reference log-probs); the per-pair loss is one small kernel
(``fastalign/kernels/preference.py``). Option and metric names follow TRL's DPOConfig,
CPOConfig, ORPOConfig and KTOConfig.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from fastalign.models.structure import IGNORE_INDEX
from fastalign.ops import token_logprobs, validation
from fastalign.ops.backend import BACKENDS, Backend
from fastalign.ops.linear_pair_objective import PairSums, linear_pair_objective
from fastalign.ops.linear_sequence_objective import fits_whole_units, linear_sequence_objective
from fastalign.ops.preference import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    SMOOTHED_DPO_LOSS_TYPES,
    UNWEIGHTED_DPO_LOSS_TYPES,
    dpo_pair_inputs,
    length_desensitised_weights,
    pair_loss,
    token_log_sum_sq_probs,
)

OBJECTIVES: tuple[str, ...] = ("dpo", "simpo", "cpo", "orpo")
CPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo")
#: The loss types whose formula uses ``label_smoothing``, per objective (TRL 1.16's DPO and CPO trainers;
#: SimPO is CPO's loss type; ORPO has no label smoothing).
SMOOTHED: dict[str, tuple[str, ...]] = {
    "dpo": SMOOTHED_DPO_LOSS_TYPES,
    "cpo": ("sigmoid",),
    "simpo": ("sigmoid",),
    "orpo": (),
}
#: KTO's loss types (TRL 1.16's KTOConfig): 'apo_zero_unpaired' is APO-zero on unpaired completions, with
#: no KL reference point.
KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")


class PreferenceLossOutput(NamedTuple):
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]  # detached, TRL's names


def _masked_targets(targets: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """``targets`` with -100 where ``loss_mask`` is 0. A 0/1 mask only (bool or integer): a fractional
    weight would silently count as 1. A non-bool mask's values cost one host sync, next to the one the
    fused log-softmax makes anyway (target range)."""
    validation.require_tensor("targets", targets)
    if loss_mask is None:
        return targets
    validation.require_tensor("loss_mask", loss_mask)
    if loss_mask.shape != targets.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} must equal targets shape {tuple(targets.shape)}"
        )
    checks = validation.DeferredChecks()
    checks.binary_mask("loss_mask", loss_mask)
    checks.raise_first()
    return torch.where(loss_mask.bool(), targets, IGNORE_INDEX)


def _check_options(chunk_size, backend) -> None:
    if chunk_size is not None:
        validation.positive_int("chunk_size", chunk_size, "a positive number of tokens")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


class _Sequences(NamedTuple):
    """Per-sequence sums and per-token values of N sequences' loss tokens."""

    logps: torch.Tensor  # [N] Σ log p (weighted by ``token_weights`` when given)
    lengths: torch.Tensor  # [N] loss-token counts
    tokens: torch.Tensor  # [N, T] log p, 0 where ignored
    entropy: torch.Tensor | None  # [N, T] detached entropy of each position's distribution, if asked
    logit_sums: torch.Tensor | None  # [N] Σ over loss tokens of the mean logit, detached, if asked
    top1: torch.Tensor | None  # [N] loss tokens whose target is the argmax, if asked


def _check_dpo_options(
    objective: str,
    loss_types: list[str],
    ld_alpha: float | None,
    f_divergence_type: str,
    f_alpha_divergence_coef: float,
    use_weighting: bool,
) -> None:
    """LD-DPO, f-DPO and WPO: DPO only (TRL 1.16's DPOConfig), refused where TRL refuses the combination
    or would ignore the value."""
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"f_divergence_type must be one of {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")
    if ld_alpha is not None and not 0.0 <= validation.real("ld_alpha", ld_alpha) <= 1.0:
        raise ValueError(f"ld_alpha must be in [0, 1] or None, got {ld_alpha}")
    validation.real("f_alpha_divergence_coef", f_alpha_divergence_coef)
    changed = [
        name
        for name, value, default in (
            ("ld_alpha", ld_alpha, None),
            ("f_divergence_type", f_divergence_type, "reverse_kl"),
            ("f_alpha_divergence_coef", f_alpha_divergence_coef, 0.5),
            ("use_weighting", use_weighting, False),
        )
        if value != default
    ]
    if objective != "dpo" and changed:
        raise ValueError(f"{', '.join(changed)}: dpo options (TRL's DPOConfig), not {objective}'s")
    if f_divergence_type != "reverse_kl":
        unsupported = [name for name in loss_types if name not in F_DIVERGENCE_LOSS_TYPES]
        if unsupported or set(loss_types) == {"sft"}:
            raise ValueError(
                f"f_divergence_type {f_divergence_type!r} applies to loss_type "
                f"{', '.join(name for name in F_DIVERGENCE_LOSS_TYPES if name != 'sft')} (as TRL 1.16), not "
                f"{', '.join(unsupported or loss_types)}; use reverse_kl"
            )
    if f_alpha_divergence_coef != 0.5 and f_divergence_type != "alpha_divergence":
        raise ValueError(
            f"f_alpha_divergence_coef ({f_alpha_divergence_coef}) would be ignored: only f_divergence_type "
            "alpha_divergence uses it"
        )
    unweighted = [name for name in loss_types if name in UNWEIGHTED_DPO_LOSS_TYPES]
    if use_weighting and unweighted:
        raise ValueError(
            f"use_weighting (WPO) is not available for loss_type {', '.join(unweighted)}, as in TRL 1.16 "
            "(aot and aot_unpaired sort the pairs; TRL fails on sft)"
        )


def sequence_logprobs(
    hidden,
    weight,
    targets,
    bias=None,
    *,
    token_weights: torch.Tensor | None = None,
    entropy: bool = False,
    head_metrics: bool = False,
    softcap: float | None = None,
    chunk_size=None,
    backend: Backend = "auto",
) -> _Sequences:
    """Sequence log-probs of ``targets``' loss tokens, from the fused log-softmax (no logits).

    ``token_weights`` [N, T] make the sum a weighted one (LD-DPO); ``entropy`` also returns the
    per-token entropy, which the fused kernel's statistics hold already (Σ p·z beside log Σ e^z);
    ``head_metrics`` each sequence's Σ mean logit and argmax hits (TRL's ``logits/*``, token accuracy),
    from those statistics too. ``softcap``: the model's final-logit softcap (Gemma-2's), applied to the
    logits. Raises a ValueError naming the first sequence without a loss token."""
    validation.require_tensor("targets", targets)
    lengths = loss_token_counts(targets)
    out = token_logprobs(
        hidden,
        weight,
        targets,
        bias,
        return_entropy=entropy,
        return_stats=head_metrics,
        softcap=softcap,
        chunk_size=chunk_size,
        backend=backend,
    )
    out = list(out) if entropy or head_metrics else [out]
    tokens = out.pop(0)
    token_entropy = out.pop(0) if entropy else None
    stats = out.pop(0) if head_metrics else None
    logps = (tokens if token_weights is None else tokens * token_weights).sum(-1)
    return _Sequences(
        logps,
        lengths,
        tokens,
        token_entropy.detach() if entropy else None,
        stats.mean_logit.sum(-1) if head_metrics else None,
        stats.accuracy.float().sum(-1) if head_metrics else None,
    )


def loss_token_counts(targets: torch.Tensor) -> torch.Tensor:
    """[N] fp32 loss tokens of each sequence of ``targets`` [N, T]; a ValueError names the first sequence
    without any."""
    lengths = (targets != IGNORE_INDEX).sum(-1).float()
    if bool((lengths == 0).any()):
        index = int((lengths == 0).nonzero()[0, 0])
        raise ValueError(f"sequence {index} of the batch has no loss tokens (all masked)")
    return lengths


def _wpo_weights(aligned_chosen: torch.Tensor, aligned_rejected: torch.Tensor, pair: _Pairs) -> torch.Tensor:
    """WPO's pair weights [P]: w_chosen·w_rejected, w = exp(mean over the loss tokens of
    log p_t − log Σ_v p_v²) (``aligned_*``: those sums), the policy's length-normalised probability
    aligned by its own distribution (TRL 1.16's ``use_weighting``; whole completions, whatever
    ``ld_alpha``); constants."""
    return (
        torch.exp(aligned_chosen / pair.chosen_len) * torch.exp(aligned_rejected / pair.rejected_len)
    ).detach()


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.mean(),
        "logps/rejected": rejected_logps.mean(),
    }


def _head_metrics(logit_sums: torch.Tensor, top1: torch.Tensor, lengths: torch.Tensor) -> dict:
    """TRL 1.16 DPOTrainer's ``logits/chosen``, ``logits/rejected`` (the mean over the vocabulary of the
    logits, averaged over the completion tokens of the chosen, the rejected rows) and
    ``mean_token_accuracy`` (the share of the chosen completion tokens whose target is the argmax), from
    the per-sequence sums of the fused head (chosen rows first)."""
    pairs = len(lengths) // 2
    chosen, rejected = slice(None, pairs), slice(pairs, None)
    return {
        "logits/chosen": logit_sums[chosen].sum() / lengths[chosen].sum(),
        "logits/rejected": logit_sums[rejected].sum() / lengths[rejected].sum(),
        "mean_token_accuracy": top1[chosen].sum() / lengths[chosen].sum(),
    }


class _Pairs(NamedTuple):
    """Policy sequence log-probs of the chosen and rejected completions, their loss-token counts, and
    the chosen completions' mean NLL per token."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_len: torch.Tensor
    rejected_len: torch.Tensor
    nll: torch.Tensor


def _log_odds_metrics(pair: _Pairs) -> dict:
    """ORPO's logged log-odds: of the mean log-probs, chosen against rejected."""
    chosen_mean, rejected_mean = (
        (pair.chosen / pair.chosen_len).detach(),
        (pair.rejected / pair.rejected_len).detach(),
    )
    log_odds = (
        chosen_mean - rejected_mean - torch.log1p(-chosen_mean.exp()) + torch.log1p(-rejected_mean.exp())
    )
    return {
        "log_odds_ratio": torch.nn.functional.logsigmoid(log_odds).mean(),
        "log_odds_chosen": log_odds.mean(),
    }


class PreferenceLoss(nn.Module):
    """Pairwise preference losses from the policy's hidden states of chosen-then-rejected sequences.

    objective:
        'dpo': ``loss_type`` one of ``DPO_LOSS_TYPES`` or a list of them with ``loss_weights`` (a
            weighted sum of their means, as TRL mixes them); needs reference log-probs unless
            ``reference_free``. 'sft' in the list adds the chosen NLL.
        'simpo': −logσ(β(mean log p_c − mean log p_r − γ/β)) with label smoothing + ``cpo_alpha``·NLL
            (no reference; TRL runs SimPO as CPO's loss type, chosen NLL included: ``cpo_alpha=0`` for the
            paper's loss).
        'cpo': sigmoid / hinge / ipo on the log-prob margin (ipo on mean log-probs) + ``cpo_alpha``·NLL.
        'orpo': chosen NLL − β·logσ(log-odds ratio), on mean log-probs.
    ``alpha`` (simpo, cpo; TRL's CPOConfig): AlphaPO. Each completion's reward is (1 − p^−α)/α of the
        p its log-prob (mean or sum, as above) is the log of, instead of that log-prob (0: off).
    ``discopop_tau`` (dpo loss_type discopop): the temperature of DiscoPOP's log-ratio modulation.

    DPO's options beyond the loss type (TRL 1.16's DPOConfig; each refused where TRL refuses it or would
    ignore it):
        ld_alpha: LD-DPO. Each sequence log-prob (policy and reference) counts the completion tokens past
            the shorter completion of its pair with weight ``ld_alpha`` (None: off).
        f_divergence_type, f_alpha_divergence_coef: f-DPO. The losses on the score difference compare
            f'(π/π_ref) instead of the log-ratios (``fastalign.ops.preference.f_divergence_scores``).
        use_weighting: WPO. Each pair's loss (every loss type) is weighted by w_c·w_r, w = exp(mean over
            the completion of log p_t − log Σ_v p_v²) under the policy, without gradient.
    DPO also logs ``logits/chosen``, ``logits/rejected`` and ``mean_token_accuracy`` (``_head_metrics``)
    and ``entropy``: the mean entropy of the policy's next-token distribution over all loss
    tokens, chosen and rejected.

    ``label_smoothing`` (ε) is refused where TRL 1.16's formula would ignore it (see ``SMOOTHED``), and
    exo_pair, whose loss has log ε, needs it positive.
    """

    def __init__(
        self,
        *,
        objective: str = "dpo",
        loss_type: str | Sequence[str] = "sigmoid",
        loss_weights: Sequence[float] | None = None,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        discopop_tau: float = 0.05,
        reference_free: bool = False,
        gamma: float = 0.5,
        cpo_alpha: float = 1.0,
        alpha: float = 0.0,
        ld_alpha: float | None = None,
        f_divergence_type: str = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        use_weighting: bool = False,
        chunk_size: int | None = None,
        backend: Backend = "auto",
    ):
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        valid = {"dpo": DPO_LOSS_TYPES, "cpo": CPO_LOSS_TYPES}.get(objective, ("sigmoid",))
        unknown = [name for name in loss_types if name not in valid]
        if unknown or not loss_types:
            raise ValueError(
                f"loss_type {unknown or loss_types} is not valid for {objective!r}; valid: {valid}"
            )
        if loss_weights is not None and len(loss_weights) != len(loss_types):
            raise ValueError(f"loss_weights ({len(loss_weights)}) must match loss_type ({len(loss_types)})")
        beta = validation.positive_finite("beta", beta)
        label_smoothing = validation.real("label_smoothing", label_smoothing, finite=False)
        for name, value in (
            ("discopop_tau", discopop_tau), ("gamma", gamma), ("cpo_alpha", cpo_alpha), ("alpha", alpha)
        ):  # fmt: skip
            validation.real(name, value)
        if discopop_tau != 0.05 and "discopop" not in loss_types:
            raise ValueError(
                f"discopop_tau ({discopop_tau}) would be ignored: only loss_type discopop uses it; remove it"
            )
        if alpha != 0 and objective not in ("cpo", "simpo"):
            raise ValueError(f"alpha ({alpha}) is AlphaPO's reward shape of cpo and simpo, not {objective}'s")
        if loss_weights is not None:
            for value in loss_weights:
                validation.real("loss_weights", value)
        _check_options(chunk_size, backend)
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if label_smoothing > 0 and not set(loss_types) & set(SMOOTHED[objective]):
            uses = f"loss_type {', '.join(SMOOTHED[objective])}" if SMOOTHED[objective] else "no loss type"
            raise ValueError(
                f"label_smoothing ({label_smoothing}) would be ignored: for {objective} only {uses} uses it "
                f"(as TRL 1.16), not {', '.join(loss_types)}; set it to 0"
            )
        if "exo_pair" in loss_types and label_smoothing == 0:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0: its loss has log ε (as TRL 1.16)")
        _check_dpo_options(
            objective, loss_types, ld_alpha, f_divergence_type, f_alpha_divergence_coef, use_weighting
        )
        self.objective = objective
        self.loss_types = loss_types
        self.loss_weights = list(loss_weights) if loss_weights is not None else [1.0] * len(loss_types)
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        self.discopop_tau = float(discopop_tau)
        self.reference_free = reference_free or objective != "dpo"
        self.gamma = float(gamma)
        self.cpo_alpha = float(cpo_alpha)
        self.alpha = float(alpha)
        self.ld_alpha = None if ld_alpha is None else float(ld_alpha)
        self.f_divergence_type = f_divergence_type
        self.f_alpha_divergence_coef = float(f_alpha_divergence_coef)
        self.use_weighting = bool(use_weighting)
        self.chunk_size = chunk_size
        self.backend = backend

    def token_weights(self, targets: torch.Tensor) -> torch.Tensor | None:
        """LD-DPO's per-token weights of chosen-then-rejected ``targets`` [2P, T] (None without
        ``ld_alpha``): a reference computed elsewhere must weight its token log-probs with them."""
        return None if self.ld_alpha is None else length_desensitised_weights(targets, self.ld_alpha)

    def _pair(self, kernel_type: str, c, r, smoothed: bool) -> torch.Tensor:
        """The per-pair loss; ``smoothed``: whether TRL's formula for this loss type uses ε."""
        return pair_loss(
            c,
            r,
            kernel_type,
            beta=self.beta,
            label_smoothing=self.label_smoothing if smoothed else 0.0,
            discopop_tau=self.discopop_tau,
            backend=self.backend,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
        ref_hidden: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
        ref_chosen_logps: torch.Tensor | None = None,
        ref_rejected_logps: torch.Tensor | None = None,
        nll_tokens: float | torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> PreferenceLossOutput:
        """hidden [2P, T, D]: the P chosen sequences, then the P rejected ones, each position's state
        predicting ``targets`` [2P, T] there; ``loss_mask`` [2P, T] marks the completion tokens.

        nll_tokens: what the chosen NLL (CPO, ORPO, 'sft') divides its sum by; default this batch's
        chosen-token count. A trainer that splits a batch passes the whole batch's count (scaled by the
        weight it gives this part), so the NLL is the whole batch's token mean.

        softcap: the model's final-logit softcap (Gemma-2's ``final_logit_softcapping``), for the policy's
        and a computed reference's logits alike (and WPO's statistic).

        Masked positions (``loss_mask`` 0 or target -100) are ignored by the fused log-softmax: their hidden
        states (NaN at padding, say) reach neither the loss nor a gradient."""
        validation.require_tensor("hidden", hidden)
        validation.require_tensor("weight", weight)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must have shape [2P, T, D], got {tuple(hidden.shape)}")
        if hidden.shape[0] % 2:
            raise ValueError(
                "hidden holds chosen then rejected sequences: its batch size "
                f"({hidden.shape[0]}) must be even"
            )
        pairs = hidden.shape[0] // 2
        targets = _masked_targets(targets, loss_mask)
        dpo = self.objective == "dpo"
        token_weights = self.token_weights(targets)
        lengths = loss_token_counts(targets)
        nll_divisor = lengths[:pairs].sum() if nll_tokens is None else nll_tokens
        refs = (
            self._reference(
                pairs,
                targets,
                token_weights,
                ref_hidden,
                ref_weight,
                ref_bias,
                ref_chosen_logps,
                ref_rejected_logps,
                softcap,
            )
            if dpo
            else None
        )

        def as_pairs(chosen, rejected, chosen_tokens, index: slice | torch.Tensor = slice(None)) -> _Pairs:
            """Pairs ``index`` of the batch from their sequence log-probs and chosen token sums."""
            nll = -chosen_tokens.sum() / nll_divisor
            return _Pairs(chosen, rejected, lengths[:pairs][index], lengths[pairs:][index], nll)

        if self._pair_head(lengths, weight, softcap):
            # the gradient formed per chunk of whole pairs (logits built once): the loss of the pairs
            # ``index`` from their sums, the same function as below on the whole batch
            def chunk_loss(index: torch.Tensor, sums: PairSums) -> torch.Tensor:
                pair = as_pairs(sums.chosen, sums.rejected, sums.chosen_tokens, index)
                wpo = (
                    _wpo_weights(sums.aligned_chosen, sums.aligned_rejected, pair)
                    if self.use_weighting
                    else None
                )
                chunk_refs = None if refs is None else (refs[0][index], refs[1][index])
                return self._loss(pair, chunk_refs, wpo, pairs)[0]

            head = linear_pair_objective(
                hidden,
                weight,
                targets,
                chunk_loss,
                bias,
                token_weights=token_weights,
                return_entropy=dpo,
                return_aligned=self.use_weighting,
                softcap=softcap,
                chunk_size=self.chunk_size,
                backend=self.backend,
            )
            seq, entropy, logit_sums, top1 = head.logps, head.entropy, head.logit_sums, head.top1
            pair = as_pairs(seq[:pairs], seq[pairs:], head.token_sums[:pairs])
            wpo = _wpo_weights(*head.aligned.chunk(2), pair) if self.use_weighting else None
            with torch.no_grad():
                _, rewards, logps = self._loss(pair, refs, wpo, pairs)  # what the metrics log
            loss = head.loss
        else:
            seq, _, tokens, entropy, logit_sums, top1 = sequence_logprobs(
                hidden,
                weight,
                targets,
                bias,
                token_weights=token_weights,
                entropy=dpo,
                head_metrics=dpo,
                softcap=softcap,
                chunk_size=self.chunk_size,
                backend=self.backend,
            )
            pair = as_pairs(seq[:pairs], seq[pairs:], tokens[:pairs])
            wpo = (
                self._wpo_weights(hidden, weight, bias, targets, tokens, pair, softcap)
                if self.use_weighting
                else None
            )
            loss, rewards, logps = self._loss(pair, refs, wpo, pairs)
        chosen_rewards, rejected_rewards = (self.beta * reward.detach() for reward in rewards)
        metrics = _reward_metrics(chosen_rewards, rejected_rewards, *(value.detach() for value in logps))
        if self.objective in ("cpo", "simpo") and self.cpo_alpha == 0:
            metrics["nll_loss"] = torch.zeros((), device=pair.nll.device)  # as TRL: not computed
        elif self.objective != "dpo" or "sft" in self.loss_types:
            metrics["nll_loss"] = pair.nll.detach()
        if self.objective == "orpo":
            metrics |= _log_odds_metrics(pair)
        if dpo:
            metrics["entropy"] = entropy.detach().sum() / lengths.sum()
            metrics |= _head_metrics(logit_sums, top1, lengths)
        return PreferenceLossOutput(loss, metrics)

    @torch.no_grad()
    def _wpo_weights(self, hidden, weight, bias, targets, tokens, pair: _Pairs, softcap) -> torch.Tensor:
        """WPO's pair weights from per-token log-probs, with a second pass for log Σ_v p_v²."""
        log_sum_sq = token_log_sum_sq_probs(
            hidden, weight, targets, bias, softcap=softcap, chunk_size=self.chunk_size, backend=self.backend
        )
        return _wpo_weights(*(tokens - log_sum_sq).sum(-1).chunk(2), pair)

    def _pair_head(self, lengths: torch.Tensor, weight: torch.Tensor, softcap: float | None) -> bool:
        """Whether the loss runs in chunks of whole pairs with its gradient formed in the forward
        (``linear_pair_objective``): not for 'aot'/'aot_unpaired', whose loss sorts all the pairs, nor
        when a pair's loss tokens are too many for one sweep (``fits_whole_units``)."""
        if {"aot", "aot_unpaired"} & set(self.loss_types):
            return False
        pairs = len(lengths) // 2  # ``lengths``: each sequence's loss tokens, chosen rows first
        units = lengths[:pairs] + lengths[pairs:]
        return fits_whole_units(units, weight, self.chunk_size, self.backend, softcap=softcap)

    def _loss(self, pair: _Pairs, refs: tuple | None, wpo: torch.Tensor | None, pairs: int):
        """The loss of the pairs in ``pair`` (a mean over all ``pairs`` of the batch: a sum over these
        divided by it), its rewards over β (chosen, rejected) and the log-probs it logs."""
        if refs is None:
            return self._reference_free(pair, pairs)
        return self._dpo(pair, *refs, wpo, pairs)

    def _dpo(
        self,
        pair: _Pairs,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
        pair_weights: torch.Tensor | None,
        pairs: int,
    ):
        """The weighted DPO-family loss and the implicit rewards' log-ratios; ``pair_weights`` [P] (WPO)
        scale every loss type's per-pair loss."""
        loss = torch.zeros((), device=pair.chosen.device)
        for loss_type, loss_weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sft":
                loss = loss + loss_weight * pair.nll
                continue
            kernel_type, c, r = dpo_pair_inputs(
                loss_type,
                pair.chosen,
                pair.rejected,
                ref_chosen,
                ref_rejected,
                pair.chosen_len,
                pair.rejected_len,
                f_divergence_type=self.f_divergence_type,
                f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            )
            smoothed = loss_type in SMOOTHED_DPO_LOSS_TYPES
            losses = self._pair(kernel_type, c, r, smoothed)
            if pair_weights is not None:
                losses = losses * pair_weights
            loss = loss + loss_weight * losses.sum() / pairs
        return loss, (pair.chosen - ref_chosen, pair.rejected - ref_rejected), (pair.chosen, pair.rejected)

    def _reference_free(self, pair: _Pairs, pairs: int):
        """SimPO, CPO or ORPO: the loss, its rewards over β and the log-probs it compares (means for
        SimPO, CPO's ipo and ORPO, else sums), which TRL's CPO and ORPO trainers log as ``logps``. The
        rewards are those log-probs, or with ``alpha`` (AlphaPO) (1 − p^−α)/α of their p."""
        chosen_mean, rejected_mean = pair.chosen / pair.chosen_len, pair.rejected / pair.rejected_len
        if self.objective == "orpo":
            loss = pair.nll + self._pair("orpo", chosen_mean, rejected_mean, False).sum() / pairs
            return loss, (chosen_mean, rejected_mean), (chosen_mean, rejected_mean)
        # CPO's IPO variant compares mean log-probs, as SimPO
        means = self.objective == "simpo" or self.loss_types[0] == "ipo"
        logps = (chosen_mean, rejected_mean) if means else (pair.chosen, pair.rejected)
        c, r = (logp if self.alpha == 0 else -torch.expm1(-self.alpha * logp) / self.alpha for logp in logps)
        if self.objective == "simpo":
            margin = self._pair("sigmoid", c, r + self.gamma / self.beta, True)
        else:
            margin = self._pair(self.loss_types[0], c, r, self.loss_types[0] == "sigmoid")
        return margin.sum() / pairs + self.cpo_alpha * pair.nll, (c, r), logps

    def _reference(
        self,
        pairs,
        targets,
        token_weights,
        ref_hidden,
        ref_weight,
        ref_bias,
        ref_chosen,
        ref_rejected,
        softcap,
    ):
        """Reference sequence log-probs (chosen [P], rejected [P]): given (weighted by LD-DPO's
        ``token_weights`` already, when on), computed, or 0 (reference-free)."""
        if self.reference_free:
            zeros = torch.zeros(pairs, device=targets.device)
            return zeros, zeros
        if ref_chosen is not None and ref_rejected is not None:
            for name, value in (("ref_chosen_logps", ref_chosen), ("ref_rejected_logps", ref_rejected)):
                if value.shape != (pairs,):
                    raise ValueError(f"{name} must have shape [P] = ({pairs},), got {tuple(value.shape)}")
            return ref_chosen.float(), ref_rejected.float()
        if ref_hidden is None or ref_weight is None:
            raise ValueError(
                "the reference is missing: pass ref_chosen_logps and ref_rejected_logps, or ref_hidden and "
                "ref_weight, or use reference_free=True"
            )
        with torch.no_grad():
            ref_seq = sequence_logprobs(
                ref_hidden,
                ref_weight,
                targets,
                ref_bias,
                token_weights=token_weights,
                softcap=softcap,
                chunk_size=self.chunk_size,
                backend=self.backend,
            ).logps
        return ref_seq[:pairs], ref_seq[pairs:]


class KTOLoss(nn.Module):
    """KTO on unpaired completions: desirable ones are pushed above the reference by more than the KL
    estimate, undesirable ones below (``desirable_weight``/``undesirable_weight`` balance them).

    The KL estimate is TRL's: mean over the batch of (policy − reference) log-probs of mismatched
    prompt/completion pairs, clamped at 0, without gradient. ``loss_type`` 'apo_zero_unpaired' (APO-zero
    on unpaired completions, TRL 1.16) has no KL reference point: 1 − σ(β·log-ratio) for a desirable
    completion, σ(β·log-ratio) for an undesirable one, i.e. the KTO loss at KL 0; it takes no KL log-probs.
    Also logs ``entropy``: the mean entropy of the policy's next-token distribution over the loss tokens,
    and ``logits/chosen``/``logits/rejected``: the mean logit over the desirable/undesirable completions'
    tokens (TRL 1.16's), from the fused head's row statistics.
    """

    def __init__(
        self,
        *,
        loss_type: str = "kto",
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        chunk_size: int | None = None,
        backend: Backend = "auto",
    ):
        super().__init__()
        if loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
        beta = validation.positive_finite("beta", beta)
        validation.real("desirable_weight", desirable_weight)
        validation.real("undesirable_weight", undesirable_weight)
        _check_options(chunk_size, backend)
        self.loss_type = loss_type
        self.beta = float(beta)
        self.desirable_weight = float(desirable_weight)
        self.undesirable_weight = float(undesirable_weight)
        self.chunk_size = chunk_size
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        *,
        ref_logps: torch.Tensor,
        kl_logps: torch.Tensor | None = None,
        ref_kl_logps: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> PreferenceLossOutput:
        """hidden [N, T, D] of N completions; ``labels`` [N] True where desirable; reference sequence
        log-probs [N]; policy and reference log-probs of the mismatched (KL) completions [M] ('kto'
        only); ``softcap``: the model's final-logit softcap (Gemma-2's)."""
        uses_kl = self.loss_type == "kto"
        if not uses_kl and (kl_logps is not None or ref_kl_logps is not None):
            raise ValueError(f"loss_type {self.loss_type!r} has no KL term: pass no kl_logps/ref_kl_logps")
        for name, tensor in (
            ("hidden", hidden),
            ("weight", weight),
            ("labels", labels),
            ("ref_logps", ref_logps),
            *((("kl_logps", kl_logps), ("ref_kl_logps", ref_kl_logps)) if uses_kl else ()),
        ):
            validation.require_tensor(name, tensor)
        if hidden.dim() != 3:
            raise ValueError(f"hidden must have shape [N, T, D], got {tuple(hidden.shape)}")
        count = hidden.shape[0]
        if labels.shape != (count,):
            raise ValueError(f"labels must have shape [N] = ({count},), got {tuple(labels.shape)}")
        if ref_logps.shape != (count,):
            raise ValueError(f"ref_logps must have shape [N] = ({count},), got {tuple(ref_logps.shape)}")
        if uses_kl and kl_logps.shape != ref_kl_logps.shape:
            raise ValueError(
                f"kl_logps {tuple(kl_logps.shape)} and ref_kl_logps {tuple(ref_kl_logps.shape)} differ"
            )
        targets = _masked_targets(targets, loss_mask)
        lengths = loss_token_counts(targets)
        if uses_kl:
            kl = (kl_logps.float() - ref_kl_logps.float()).mean().clamp(min=0).detach()
        else:
            kl = torch.zeros((), device=hidden.device)
        ref_logps = ref_logps.float()
        desirable = labels.bool()
        weights = torch.where(desirable, self.desirable_weight, self.undesirable_weight)

        def loss_of(seq: torch.Tensor, index: slice | torch.Tensor = slice(None)) -> torch.Tensor:
            """The loss of completions ``index`` from their log-probs ``seq``: their share of the mean."""
            logratios = seq - ref_logps[index]
            c = torch.where(desirable[index], logratios, kl)
            r = torch.where(desirable[index], kl, logratios)
            losses = pair_loss(c, r, "kto", beta=self.beta, backend=self.backend)
            return (losses * weights[index]).sum() / count

        if fits_whole_units(lengths, weight, self.chunk_size, self.backend, softcap=softcap):
            # each completion's loss is its own once the KL is fixed: the gradient formed per chunk of
            # whole completions, the logits built once (``linear_sequence_objective``)
            head = linear_sequence_objective(
                hidden,
                weight,
                targets,
                lambda index, sums: loss_of(sums.logps, index),
                bias,
                return_entropy=True,
                softcap=softcap,
                chunk_size=self.chunk_size,
                backend=self.backend,
            )
            loss, seq, entropy, logit_sums = head.loss, head.logps, head.entropy, head.logit_sums
        else:
            seq, _, _, entropy, logit_sums, _ = sequence_logprobs(
                hidden,
                weight,
                targets,
                bias,
                entropy=True,
                head_metrics=True,
                softcap=softcap,
                chunk_size=self.chunk_size,
                backend=self.backend,
            )
            loss = loss_of(seq)
        rewards = self.beta * (seq.detach() - ref_logps)
        metrics = {"kl": kl, "entropy": entropy.sum() / lengths.sum()}
        for name, selected in (("chosen", desirable), ("rejected", ~desirable)):
            if bool(selected.any()):
                metrics[f"rewards/{name}"] = rewards[selected].mean()
                metrics[f"logps/{name}"] = seq.detach()[selected].mean()
                # TRL 1.16 KTOTrainer's: the mean logit over the desirable (undesirable) completion tokens
                metrics[f"logits/{name}"] = logit_sums[selected].sum() / lengths[selected].sum()
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return PreferenceLossOutput(loss, metrics)
