"""GRPO ops: ``group_advantages`` and ``grpo_token_loss``, dispatch and PyTorch implementations.

The math is stated in ``fastalign/kernels/grpo.py``; the PyTorch functions here follow TRL's
``GRPOTrainer`` formulas op for op (and let autograd derive the gradient).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from fastalign.ops import validation
from fastalign.ops.backend import Backend, resolve_backend

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # shaped like the rewards, fp32; 0 where the reward is NaN
    num_zero_std_groups: torch.Tensor  # groups whose rewards are all equal (the frac_reward_zero_std metric)
    group_std: torch.Tensor  # [groups] std of each group's non-NaN rewards (unbiased)


def _nan_group_stats(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, centered values, unbiased std) of each row's non-NaN values; 0 where NaN.

    A row whose values are all equal is centered to exactly 0 with std exactly 0: the rounding of its
    mean must not turn a zero-std group into a tiny std (and advantages of ±0.5/eps)."""
    valid = ~torch.isnan(groups)
    count = valid.sum(-1).float()
    mean = torch.where(valid, groups, 0.0).sum(-1) / count.clamp_min(1.0)
    spread = torch.where(valid, groups, -torch.inf).amax(-1) > torch.where(valid, groups, torch.inf).amin(-1)
    centered = torch.where(valid & spread[:, None], groups - mean[:, None], 0.0)
    std = (centered.square().sum(-1) / (count - 1.0).clamp_min(1.0)).sqrt()
    return count, centered, std


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    _, _, std = _nan_group_stats(rewards.reshape(1, -1))
    return std.reshape(1)


def _group_advantages_torch(groups, rloo: bool, scale: str, batch_std, eps: float):
    count, centered, std = _nan_group_stats(groups)
    if rloo:
        factor = torch.where(count > 1.0, count / (count - 1.0).clamp_min(1.0), 0.0)
        centered = centered * factor[:, None]
    if scale == "group":
        centered = centered / (std[:, None] + eps)
    elif scale == "batch":
        centered = centered / (batch_std + eps)
    return centered, std


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    advantage_estimator: Literal["grpo", "rloo"] = "grpo",
    eps: float = 1e-4,
    backend: Backend = "auto",
) -> GroupAdvantages:
    """Advantages of ``rewards`` [B·G] or [B, G] (completions of one prompt adjacent) within groups.

    'grpo': reward minus its group mean; 'rloo': minus the mean of the group's other rewards. Then
    divided by the group std + eps ('group'), the batch std + eps ('batch'), or left ('none'). NaN
    rewards (no reward function applied to the sample) are left out of every statistic and get
    advantage 0. Sum several reward functions first (``combine_rewards``).
    """
    validation.require_tensor("rewards", rewards)
    group_size = validation.positive_int("group_size", group_size)
    eps = validation.real("eps", eps)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {advantage_estimator!r}"
        )
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) must be a positive multiple of "
            f"group_size ({group_size})"
        )
    if group_size < 2 and (scale_rewards == "group" or advantage_estimator == "rloo"):
        raise ValueError(
            "group_size must be at least 2 for scale_rewards='group' or advantage_estimator='rloo', "
            f"got {group_size}"
        )
    if rewards.dim() == 2 and rewards.shape[1] != group_size:
        raise ValueError(
            f"rewards [B, G] must have G = group_size = {group_size}, got {tuple(rewards.shape)}"
        )
    flat = rewards.reshape(-1).float().contiguous()
    batch_std = _batch_std(flat) if scale_rewards == "batch" else torch.ones(1, device=flat.device)
    rloo = advantage_estimator == "rloo"
    if resolve_backend(backend, flat) == "torch":
        advantages, std = _group_advantages_torch(
            flat.view(-1, group_size), rloo, scale_rewards, batch_std, eps
        )
    else:
        from fastalign.kernels import grpo as kernels

        scale = {"none": 0, "group": 1, "batch": 2}[scale_rewards]
        advantages, std = kernels.group_advantages(flat, group_size, rloo, scale, batch_std, eps)
    zero_std = torch.isclose(std, torch.zeros_like(std)).sum()
    return GroupAdvantages(advantages.view(rewards.shape), zero_std, std)


def nan_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std [] of the non-NaN entries of ``values`` (any shape); 0 for fewer than two."""
    validation.require_tensor("values", values)
    return _batch_std(values.reshape(-1).float())[0]


def normalize_advantages(advantages: torch.Tensor, valid: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """RLOO's ``normalize_advantages``: (A − mean) / (std + eps) with the mean and the unbiased std of the
    ``valid`` entries (the completions some reward function scored), 0 elsewhere, and 0 everywhere when
    fewer than two are valid (TRL's NaN statistics, which its ``nan_to_num`` makes 0)."""
    validation.require_tensor("advantages", advantages)
    validation.require_tensor("valid", valid)
    if valid.shape != advantages.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor shaped like advantages {tuple(advantages.shape)}")
    values = torch.where(valid, advantages.float(), float("nan"))
    scaled = (values - values.nanmean()) / (nan_std(values) + eps)
    return torch.where(valid & (valid.sum() > 1), scaled, 0.0)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over reward functions [N, F] → [N], skipping NaN (a function that returned None);
    NaN where every function returned None, so the sample stays out of the group statistics."""
    validation.require_tensor("rewards_per_func", rewards_per_func)
    validation.require_tensor("weights", weights, optional=True)
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must have shape [N, F], got {tuple(rewards_per_func.shape)}")
    weights = (
        torch.ones(rewards_per_func.shape[1], device=rewards_per_func.device) if weights is None else weights
    )
    total = (rewards_per_func * weights.to(rewards_per_func)).nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), float("nan"), total)


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) of 1-D fp32 ``values``, bit for bit, without
    its limit of 2^24 values (a micro-batch's tokens on many ranks can pass it): the same fp32 rank
    arithmetic on a sort (NaN, sorted last, makes the quantile NaN, as there)."""
    ordered = values.sort().values
    last = values.numel() - 1
    rank = torch.tensor(q, dtype=values.dtype, device=values.device) * last
    rank = torch.where(ordered[-1].isnan(), float(last), rank)
    below = rank.long()  # truncation: the floor of a rank >= 0
    return torch.lerp(ordered[below], ordered[rank.ceil().long()], rank - below)


def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """TRL's ``top_entropy_quantile`` (ρ, "Beyond the 80/20 rule"): bool [B, T], True at the masked-in
    tokens whose entropy is at least the (1 − ρ)-quantile of the entropies of every masked-in token.

    As TRL's ``GRPOTrainer.get_high_entropy_mask``: the quantile is ``torch.quantile``'s (linear
    interpolation) over the fp32 entropies of this micro-batch's masked-in tokens, and of every
    process's when ``gather`` is given (it returns all processes' 1-D values of this call, concatenated:
    TRL gathers across processes, per micro-batch); ties at the threshold are all kept (≥); no token is
    kept when there is none at all. ρ = 1 keeps every token, ρ = 0 those of the highest entropy.
    ``entropy`` is detached: the mask is a constant of the loss."""
    validation.require_tensor("entropy", entropy)
    validation.require_tensor("mask", mask)
    if entropy.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal entropy shape {tuple(entropy.shape)}")
    top_entropy_quantile = validation.real("top_entropy_quantile", top_entropy_quantile)
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    inside = mask.bool()
    entropy = entropy.detach().float()
    values = entropy[inside]
    if gather is not None:
        values = gather(values)
    if values.numel() == 0:
        return torch.zeros_like(inside)
    return (entropy >= _quantile(values, 1.0 - top_entropy_quantile)) & inside


# --------------------------------------------------------------------------------------------------
# The token loss.


@dataclass(frozen=True)
class TokenLossConfig:
    beta: float
    eps_low: float
    eps_high: float
    delta: float | None
    sequence_level: bool
    cispo: bool
    #: TRL's ``use_bias_correction_kl``: the KL term times the importance ratio (at sequence level, the
    #: completion's: its gradient then couples a completion's tokens, so that runs in PyTorch)
    bias_correction_kl: bool = False


class TokenLossInputs(NamedTuple):
    """Per-token inputs of the token loss, flattened over the completions' [B, T] tokens (fp32)."""

    mask: torch.Tensor
    advantage: torch.Tensor  # each token's completion advantage
    weight: torch.Tensor  # the aggregation weight w_t = mask_t · norm_b
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    keep: torch.Tensor | None = None  # 0/1: whether the token's policy term counts (None: all do)

    @classmethod
    def build(cls, mask, advantages, seq_weight, old_logp=None, ref_logp=None, keep=None) -> TokenLossInputs:
        mask = mask.float()

        def per_token(values):  # masked tokens' values (NaN there, say) are replaced, never weighted by 0
            return (
                None
                if values is None
                else torch.where(mask != 0, values.float(), 0.0).reshape(-1).contiguous()
            )

        return cls(
            mask=mask.reshape(-1).contiguous(),
            advantage=advantages.float()[:, None].expand_as(mask).reshape(-1).contiguous(),
            weight=(mask * seq_weight.float()[:, None]).reshape(-1).contiguous(),
            old_logp=per_token(old_logp),
            ref_logp=per_token(ref_logp),
            keep=None if keep is None else (keep.bool() & (mask != 0)).float().reshape(-1).contiguous(),
        )

    def rows(self, rows: slice | torch.Tensor) -> TokenLossInputs:
        """The inputs of some tokens: a slice, or a tensor of indices into the flat tokens."""
        return TokenLossInputs(*(None if t is None else t[rows] for t in self))


def _token_loss_torch(logp, log_weight, inputs: TokenLossInputs, config: TokenLossConfig):
    """TRL's per-token loss on flat tokens, weighted and summed; returns (loss, sums [5]).

    Differentiable w.r.t. ``logp`` (and ``log_weight``, the sequence-level log importance weights)."""
    old = logp.detach() if inputs.old_logp is None else inputs.old_logp
    coef_1 = torch.exp(log_weight if config.sequence_level else logp - old)
    adv, mask = inputs.advantage, inputs.mask
    ratio = coef_1  # before delta's cap: what the bias-corrected KL is weighted by
    if config.cispo:
        per_token_loss = -torch.clamp(coef_1, max=config.eps_high).detach() * adv * logp
        high = (coef_1 > config.eps_high) & (adv > 0)
        low = torch.zeros_like(high)
    else:
        coef_2 = torch.clamp(coef_1, 1 - config.eps_low, 1 + config.eps_high)
        if config.delta is not None:
            coef_1 = torch.clamp(coef_1, max=config.delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        low = (coef_1 < 1 - config.eps_low) & (adv < 0)
        high = (coef_1 > 1 + config.eps_high) & (adv > 0)
    if inputs.keep is not None:  # the policy term only, as TRL's entropy mask (never the KL term)
        per_token_loss = per_token_loss * inputs.keep
    kl = torch.zeros_like(logp)
    if inputs.ref_logp is not None:
        kl = torch.exp(inputs.ref_logp - logp) - (inputs.ref_logp - logp) - 1
        if config.bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + config.beta * kl
    loss = (per_token_loss * inputs.weight).sum()
    flags = [(flag.float() * mask).sum() for flag in (low, high, low | high)]
    return loss, torch.stack([loss.detach(), (kl.detach() * mask).sum(), *flags])


def _token_loss_triton(logp, log_weight, inputs: TokenLossInputs, config: TokenLossConfig):
    """(∂L/∂logp, sums [5]) from the Triton kernel; ``log_weight`` is taken as a value."""
    from fastalign.kernels import grpo as kernels

    # the kernel's scalar options are the config's fields (sequence level: log_weight given or not)
    options = {key: value for key, value in dataclasses.asdict(config).items() if key != "sequence_level"}
    log_weight = None if log_weight is None else log_weight.detach().contiguous()
    per_token = (inputs.old_logp, inputs.ref_logp, log_weight, inputs.mask, inputs.advantage, inputs.weight)
    return kernels.grpo_token_loss(logp.contiguous(), *per_token, inputs.keep, **options)


class _TokenLossFunction(torch.autograd.Function):
    """The Triton kernel: the gradient w.r.t. the log-probs is formed in forward."""

    @staticmethod
    def forward(ctx, logp, log_weight, inputs: TokenLossInputs, config: TokenLossConfig):
        grad, sums = _token_loss_triton(logp, log_weight, inputs, config)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(sums)
        return sums[0].clone(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None


def sequence_log_weights(
    logp: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor | None
) -> torch.Tensor:
    """GSPO's per-completion log importance weight Σ mask·(ℓ − ℓ_old) / Σ mask, [B] (old = ℓ detached
    when absent, which makes it 0 with the gradient of the mean log-prob)."""
    old = logp.detach() if old_logp is None else old_logp.float()
    return torch.where(mask != 0, (logp - old) * mask, 0.0).sum(-1) / mask.sum(-1).clamp(min=1.0)


def completion_clip_fractions(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    config: TokenLossConfig,
    old_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's share of its tokens whose ratio is clipped below (advantage < 0) and above
    (advantage > 0), [B] each, NaN for a completion without tokens; at sequence level its one flag.
    TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max`` are their extremes (the token loss sums
    the flags over all completions, which loses them). On the detached [B, T] log-probs the fused
    head returns, so no pass over the vocabulary: a few elementwise ops."""
    mask = mask.float()
    logp = torch.where(mask != 0, logp.detach().float(), 0.0)
    old = logp if old_logp is None else torch.where(mask != 0, old_logp.float(), 0.0)
    if config.sequence_level:
        coef = sequence_log_weights(logp, mask, old).exp()[:, None]
    else:
        coef = (logp - old).exp()
    if config.delta is not None:
        coef = coef.clamp(max=config.delta)
    advantages = advantages.float()[:, None]
    low = (coef < 1 - config.eps_low) & (advantages < 0)
    high = (coef > 1 + config.eps_high) & (advantages > 0)
    if config.sequence_level:
        return low[:, 0].float(), high[:, 0].float()
    count = mask.sum(-1)
    return (low * mask).sum(-1) / count, (high * mask).sum(-1) / count


def _check_token_loss_inputs(logp, mask, advantages, seq_weight, old_logp, ref_logp, keep) -> None:
    """Types and shapes, then the mask's and the advantages' values in one host sync."""
    for name, tensor in (
        ("logp", logp),
        ("mask", mask),
        ("advantages", advantages),
        ("seq_weight", seq_weight),
    ):
        validation.require_tensor(name, tensor)
    for name, tensor in (("old_logp", old_logp), ("ref_logp", ref_logp), ("keep", keep)):
        validation.require_tensor(name, tensor, optional=True)
    for name, tensor in (("mask", mask), ("old_logp", old_logp), ("ref_logp", ref_logp), ("keep", keep)):
        if tensor is not None and tensor.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} must equal logp shape {tuple(logp.shape)}")
    if logp.dim() != 2 or advantages.shape != logp.shape[:1] or seq_weight.shape != logp.shape[:1]:
        raise ValueError(
            f"logp must be [B, T] with advantages and seq_weight [B]; got logp {tuple(logp.shape)}, "
            f"advantages {tuple(advantages.shape)}, seq_weight {tuple(seq_weight.shape)}"
        )
    checks = validation.DeferredChecks()
    checks.binary_mask("mask", mask)
    if keep is not None:
        checks.binary_mask("keep", keep)
    checks.finite("advantages", advantages)
    checks.raise_first()


def grpo_token_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    seq_weight: torch.Tensor,
    config: TokenLossConfig,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    backend: Backend = "auto",
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_b seq_weight_b Σ_t mask·loss_t of log-probs [B, T] (differentiable w.r.t. ``logp``), and the
    sums [5]: L, Σ mask·kl, and the low-, high- and region-clipped token counts (of every masked-in
    token: ``keep`` leaves them, as TRL's metrics).

    ``mask`` is a 0/1 mask [B, T] (bool or integer) and ``advantages`` [B] must be finite: one host sync
    checks both; a ValueError names the argument. ``keep`` (0/1 [B, T], optional) multiplies the policy
    term of each token, not its KL term (``high_entropy_mask``). ``check_inputs=False`` skips every
    check, for a caller that has made them already (``GRPOLoss`` does, in its own sync)."""
    if check_inputs:
        _check_token_loss_inputs(logp, mask, advantages, seq_weight, old_logp, ref_logp, keep)
    mask = mask.float()
    # A masked token's log-prob (NaN at padding, say) is replaced, not weighted by 0 (0·NaN is NaN).
    logp = torch.where(mask != 0, logp.float(), 0.0)
    inputs = TokenLossInputs.build(mask, advantages, seq_weight, old_logp, ref_logp, keep)
    log_weight = None
    if config.sequence_level:
        log_weight = sequence_log_weights(logp, mask, old_logp)[:, None].expand_as(logp).reshape(-1)
    # The kernel takes a completion's importance weight as a value: right for the clipped term, whose
    # gradient per token is the same through it, not for a KL term it multiplies, whose gradient through
    # it sums the completion's KL; autograd does that (on [B, T] values, elementwise). So with ``keep``:
    # a kept token's term passes gradient to every token of its completion through the weight.
    coupled = config.sequence_level and (keep is not None or (config.bias_correction_kl and config.beta > 0))
    if coupled or resolve_backend(backend, logp) == "torch":
        return _token_loss_torch(logp.reshape(-1), log_weight, inputs, config)
    return _TokenLossFunction.apply(logp.reshape(-1), log_weight, inputs, config)


#: ``grpo_token_loss`` on inputs the caller has checked (``GRPOLoss`` does, in its one sync).
unchecked_grpo_token_loss = functools.partial(grpo_token_loss, check_inputs=False)


def grpo_token_objective(inputs: TokenLossInputs, config: TokenLossConfig, backend: Backend):
    """The token-level GRPO loss as a ``token_objective`` (gradient formed in forward, chunk by chunk)."""
    if config.sequence_level:
        raise ValueError("sequence-level importance sampling needs every log-prob of a completion first")

    def objective(rows: slice, logp: torch.Tensor):
        chunk = inputs.rows(rows)
        if resolve_backend(backend, logp) == "torch":
            with torch.enable_grad():
                leaf = logp.detach().requires_grad_()
                loss, sums = _token_loss_torch(leaf, None, chunk, config)
                (grad,) = torch.autograd.grad(loss, leaf)
            return loss.detach(), grad, sums[1:]
        grad, sums = _token_loss_triton(logp, None, chunk, config)
        return sums[0], grad, sums[1:]

    return objective
