"""What the policy losses on sampled completions (``GRPOLoss``, ``RLOOLoss``, ``PPOLoss``) share: one call
signature (the completion tokens' hidden states, the LM head, the tokens, their mask and advantages),
the checks of those inputs, and the fused head's options, which turn hidden states into the tokens'
log-probs and entropies without [tokens, vocab] logits."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from fastalign.models.structure import IGNORE_INDEX
from fastalign.ops import token_logprobs, validation
from fastalign.ops.backend import BACKENDS, Backend


class Completions(NamedTuple):
    """One micro-batch of completions as a loss receives them."""

    hidden: Tensor  # [B, T, D] the state predicting each completion token
    weight: Tensor  # [V, D] the LM head
    completion_ids: Tensor  # [B, T] integer token ids
    completion_mask: Tensor  # [B, T] 0/1 (bool or integer)
    advantages: Tensor  # [B], or [B, T] for a per-token loss (PPO's)
    bias: Tensor | None  # [V]
    softcap: float | None = None  # the model's final-logit softcap (Gemma-2's): s·tanh(logits/s)

    @property
    def targets(self) -> Tensor:
        """The completion ids with masked tokens ignored: the fused head never reads their hidden
        states (NaN at padding reaches nothing), and their log-probs are 0."""
        return self.completion_ids.masked_fill(~self.completion_mask.bool(), IGNORE_INDEX)


def check_completion_inputs(
    inputs: Completions,
    *,
    per_token: dict[str, Tensor | None],
    token_advantages: bool = False,
    **optional: Tensor | None,
) -> None:
    """Types and shapes of a completion loss's inputs: ``hidden`` [B, T, D], integer ``completion_ids``
    [B, T], ``completion_mask`` and the ``per_token`` tensors [B, T], ``advantages`` [B] (or [B, T] with
    ``token_advantages``); ``optional`` tensors only need to be tensors (their shapes are the caller's
    to check)."""
    hidden, weight, completion_ids, completion_mask, advantages, bias, _ = inputs
    for name, tensor in (
        ("hidden", hidden),
        ("weight", weight),
        ("completion_ids", completion_ids),
        ("completion_mask", completion_mask),
        ("advantages", advantages),
    ):
        validation.require_tensor(name, tensor)
    for name, tensor in (*per_token.items(), ("bias", bias), *optional.items()):
        validation.require_tensor(name, tensor, optional=True)
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must have shape [B, T], got {tuple(completion_ids.shape)}")
    if (
        completion_ids.is_floating_point()
        or completion_ids.is_complex()
        or completion_ids.dtype == torch.bool
    ):
        raise ValueError(f"completion_ids must be integer token ids, got dtype {completion_ids.dtype}")
    batch, length = completion_ids.shape
    if token_advantages:
        per_token = {"advantages": advantages, **per_token}
    for name, tensor in (("completion_mask", completion_mask), *per_token.items()):
        if tensor is not None and tensor.shape != completion_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} must equal completion_ids shape {(batch, length)}"
            )
    if hidden.shape[:2] != completion_ids.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [B, T, D] with [B, T] = {(batch, length)}")
    if not token_advantages and advantages.shape != (batch,):
        raise ValueError(f"advantages must have shape [B] = ({batch},), got {tuple(advantages.shape)}")


def completion_value_checks(completion_mask: Tensor, advantages: Tensor) -> validation.DeferredChecks:
    """The value checks of a completion loss's mask (0/1) and advantages (finite), deferred so that the
    caller adds its own and pays one host sync for all (``raise_first``)."""
    checks = validation.DeferredChecks()
    checks.binary_mask("completion_mask", completion_mask)
    checks.finite("advantages", advantages)
    return checks


class CompletionLoss(nn.Module):
    """A policy loss from the completions' hidden states: ``loss(hidden, weight, completion_ids,
    completion_mask, advantages, bias=..., **inputs)`` hands a subclass's ``completion_loss`` the
    ``Completions`` and its own keyword inputs (the sampling policy's log-probs, ...).

    ``temperature`` scales the logits of the fused, chunked linear log-softmax; ``chunk_size`` (tokens
    per logits chunk) trades memory for speed as in ``linear_cross_entropy``."""

    def __init__(self, *, temperature: float, chunk_size: int | None, backend: Backend):
        super().__init__()
        self.temperature = validation.positive_finite("temperature", temperature)
        if chunk_size is not None:
            validation.positive_int("chunk_size", chunk_size, "a positive number of tokens")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.chunk_size, self.backend = chunk_size, backend

    def forward(
        self,
        hidden,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        *,
        bias=None,
        softcap=None,
        **inputs,
    ):
        """The loss of completions [B, T] from their hidden states [B, T, D] and the LM head ``weight``
        [V, D] (and ``bias`` [V]; ``softcap``: the model's final-logit softcap): see the subclass's
        ``completion_loss`` for ``advantages``, the other inputs and the output."""
        completions = Completions(hidden, weight, completion_ids, completion_mask, advantages, bias, softcap)
        return self.completion_loss(completions, **inputs)

    def completion_loss(self, completions: Completions, **inputs):
        """The subclass's loss (``forward`` calls it)."""
        raise NotImplementedError

    def fused_options(self, softcap: float | None, return_entropy: bool = True) -> dict:
        """How the fused head computes the completion tokens' log-probs at ``temperature``, from the
        model's logits (``softcap``: its final-logit softcap), and their entropy (a metric, and GRPO's
        entropy mask's input)."""
        return dict(
            softcap=softcap,
            temperature=self.temperature,
            return_entropy=return_entropy,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )

    def token_logprobs(self, completions: Completions) -> tuple[Tensor, Tensor]:
        """The completion tokens' log-probs and entropies [B, T] fp32 (0 at masked tokens)."""
        return token_logprobs(
            completions.hidden,
            completions.weight,
            completions.targets,
            completions.bias,
            **self.fused_options(completions.softcap),
        )
