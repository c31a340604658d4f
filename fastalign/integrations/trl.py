"""Serve TRL's fused LM head with fastalign's fused linear cross-entropy.

TRL 1.16 gives its trainers' models a chunked LM head (``trl.trainer.utils.add_fused_lm_head``: SFT, DPO,
KTO, GRPO, RLOO and the async GRPO trainer) and calls ``model(..., fused_lm_head=True)``; that forward
runs the backbone itself and never reaches a patched model's loss, so ``fastalign.patch_model`` alone
leaves TRL's head (and its per-token Python loop on CPU) in place. ``enable()`` swaps the one function
that head calls, ``trl.trainer.utils._ChunkedLogProbFunction``, for ``FusedLogProbs``: the same protocol
(hidden [N, H], head weight [V, H], bias, targets [N], temperature, vocabulary chunk width, softcap,
logit scale, requested outputs -> log-probs, entropy, log Σp², mean logit, top-1 flag) computed by
``fastalign.ops.token_logprobs``. The swap is process-wide and looked up by TRL on every call, so it
serves models given the head before or after ``enable()``, with or without ``patch_model``, under peft
and gradient checkpointing alike (both only change what produces the hidden states).

It is explicit, not a side effect of ``patch_model``: it changes a TRL module for every model of the
process, which a per-model call should not do silently.

The protocol is TRL 1.16's; on another TRL version, or if the function's signature changed, ``enable()``
warns once and leaves TRL's own head in place: a slower step, never a wrong number. Calls fastalign does
not cover go to TRL's function too: ``log_sum_sq_probs`` (DPO's WPO weighting), an empty batch, and a
DeepSpeed ZeRO-3 head (whose backward must re-gather the weight, which only TRL's backward does).

One documented difference: ``is_top1`` counts a target that ties another token for the largest logit as
top-1 (TRL counts it only when no earlier token ties); with continuous logits such ties have measure zero.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from packaging.version import Version

from fastalign.ops import token_logprobs
from fastalign.ops.head_workspace import head_workspace_bytes

#: The TRL releases whose fused-head protocol ``FusedLogProbs`` implements.
SUPPORTED_TRL = (Version("1.16"), Version("1.17"))
#: ``ChunkedLogProbFunction.forward``'s parameters in TRL 1.16, checked by name and order.
PROTOCOL = (
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
#: Tokens per tile of TRL's head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``).
TRL_TOKEN_TILE = 4096
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

#: TRL's own function while ``enable()`` is in effect (the fallback), else None.
_trl_function = None
_warned = False


class FusedLogProbs:
    """Stand-in for ``trl.kernels.ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its
    five outputs (None where not requested), differentiable like TRL's (log-probs and entropy w.r.t.
    hidden, weight and bias; the rest detached)."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ):
        if "log_sum_sq_probs" in outputs or hidden.shape[0] == 0 or hasattr(weight, "ds_id"):
            args = (hidden, weight, bias, targets, temperature, chunk_size)
            return _trl_function.apply(*args, final_logit_softcapping, logit_scale, outputs)
        if not torch.is_autocast_enabled(hidden.device.type) and weight.dtype != hidden.dtype:
            # `cast_lm_head_to_fp32`: TRL runs the projection in the hidden states' dtype (fp32). It casts
            # one vocabulary chunk at a time; this whole-weight copy costs V·H·4 bytes more (docs/trl.md)
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        if logit_scale != 1.0:
            # The logits are linear in (hidden, bias): scaling both scales them before the softcap, as in TRL
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        # TRL's head holds one [4096 tokens, chunk_size vocabulary] tile; fastalign's chunks may take as much
        # (more rows per GEMM: on CPU its 32 MiB default makes 32-row chunks of a 49k vocabulary, 2.5x slower)
        dtype = (
            torch.get_autocast_dtype(hidden.device.type)
            if torch.is_autocast_enabled(hidden.device.type)
            else hidden.dtype
        )
        trl_tile = min(hidden.shape[0], TRL_TOKEN_TILE) * min(weight.shape[0], chunk_size) * dtype.itemsize
        workspace = max(head_workspace_bytes(hidden.device.type, None, weight), trl_tile)
        with_entropy = "entropy" in outputs
        with_stats = "mean_logits" in outputs or "is_top1" in outputs
        result = token_logprobs(
            hidden,
            weight,
            targets,
            bias,
            temperature=temperature,
            softcap=final_logit_softcapping,
            return_entropy=with_entropy,
            return_stats=with_stats,
            workspace_bytes=workspace,
        )
        result = result if isinstance(result, tuple) else (result,)
        logprobs, entropy = result[0], result[1] if with_entropy else None
        stats = result[-1] if with_stats else None
        mean_logits = stats.mean_logit if "mean_logits" in outputs else None
        is_top1 = stats.accuracy if "is_top1" in outputs else None
        return logprobs, entropy, None, mean_logits, is_top1


def _protocol_mismatch(trl_utils) -> str | None:
    """Why TRL's fused head is not the protocol ``FusedLogProbs`` implements, or None when it is."""
    import trl

    try:
        version = Version(trl.__version__)
    except Exception:  # an unparsable version ("unknown" from a source tree) is not a supported one
        return f"TRL version {trl.__version__!r} is not a release"
    if not SUPPORTED_TRL[0] <= version < SUPPORTED_TRL[1]:
        return f"TRL {version} is outside the supported {SUPPORTED_TRL[0]}.x"
    function = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if function is None:
        return "trl.trainer.utils has no _ChunkedLogProbFunction"
    parameters = tuple(inspect.signature(function.forward).parameters)
    if parameters != PROTOCOL:
        return f"TRL's ChunkedLogProbFunction.forward takes {parameters}, not {PROTOCOL}"
    return None


def enable() -> bool:
    """Make TRL's fused LM head (every ``model(..., fused_lm_head=True)``) run on fastalign's kernels.

    Idempotent. Returns whether fastalign now serves the head: False, with one warning per process, when
    the installed TRL is not the supported protocol (TRL's own head stays, unchanged)."""
    global _trl_function, _warned
    from trl.trainer import utils as trl_utils

    if _trl_function is not None:
        return True
    mismatch = _protocol_mismatch(trl_utils)
    if mismatch is not None:
        if not _warned:
            warnings.warn(
                f"fastalign.integrations.trl: {mismatch}; TRL's fused LM head keeps its own kernels",
                stacklevel=2,
            )
            _warned = True
        return False
    _trl_function = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = FusedLogProbs
    return True


def patch_model(model, **options):
    """``fastalign.patch_model`` for a model that TRL's trainers will train: the same, with
    ``skip_slower_on_cpu=True`` (on a CPU-only model the pieces whose CPU path does not earn its place,
    ``fastalign.patching.patch.CPU_SLOWER``: the RMSNorms and RoPE, stay the model's: patching must not
    slow TRL down). Call it before handing the model to the trainer (TRL's fused head wraps the forward
    it finds), and ``enable()`` for the head. ``options`` are ``fastalign.patch_model``'s. Returns the
    model."""
    from fastalign.patching import patch_model as patch

    return patch(model, **({"skip_slower_on_cpu": True} | options))


def disable() -> None:
    """Give TRL its own fused head back (e.g. to compare both in one process)."""
    global _trl_function
    if _trl_function is None:
        return
    from trl.trainer import utils as trl_utils

    trl_utils._ChunkedLogProbFunction = _trl_function
    _trl_function = None
