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

``is_top1`` is TRL's: the target is the argmax, the first of the largest logits, so a target tied with an
earlier token for the maximum (frequent with bf16 logits) is not top-1.

``enable()`` and ``disable()`` take a lock. TRL's own function is kept in one place from the first swap on;
``disable()`` puts it back only while TRL's slot still holds fastalign's function (a third party's patch
installed since stays, with one warning), and from then on ``FusedLogProbs``, wherever a reference to it
was kept, passes every call to TRL's function. ``enable()`` likewise leaves a third party's function in the
slot, whether it came before or after fastalign's first swap (one warning, returns False).
"""

from __future__ import annotations

import inspect
import threading
import warnings

import torch
from packaging.version import Version

from fastalign.ops import token_logprobs
from fastalign.ops.head_workspace import configured_head_workspace_bytes, head_workspace_bytes

#: The TRL minor release whose fused-head protocol ``FusedLogProbs`` implements (its patch releases and
#: pre-releases; a 1.17 pre-release is 1.17's, not 1.16's).
SUPPORTED_TRL = (1, 16)
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

#: Guards the swap of TRL's slot and the state below.
_lock = threading.Lock()
#: The function TRL's slot held when fastalign first took it (TRL's own): the fallback of the calls
#: fastalign does not cover, and what ``disable()`` puts back. Set by the first swap, never changed after.
_trl_function = None
#: Whether ``FusedLogProbs`` serves calls with fastalign's kernels (between ``enable()`` and ``disable()``).
_serving = False
_warned = False
_warned_foreign = False


def _trl_original():
    """TRL's function: the one fastalign took from TRL's slot, or, before any swap, TRL's own class."""
    if _trl_function is not None:
        return _trl_function
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction


class FusedLogProbs:
    """Stand-in for ``trl.kernels.ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its
    five outputs (None where not requested), differentiable like TRL's (log-probs and entropy w.r.t.
    hidden, weight and bias; the rest detached). Outside ``enable()`` (never enabled, or after
    ``disable()``) every call goes to TRL's function."""

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
        uncovered = "log_sum_sq_probs" in outputs or hidden.shape[0] == 0 or hasattr(weight, "ds_id")
        if uncovered or not _serving:
            args = (hidden, weight, bias, targets, temperature, chunk_size)
            return _trl_original().apply(*args, final_logit_softcapping, logit_scale, outputs)
        autocast = torch.is_autocast_enabled(hidden.device.type)
        # TRL's compute dtype: autocast's (fastalign's ops cast hidden, weight and bias to it there), else the
        # hidden states'. Outside autocast a head weight or bias of another dtype is cast to it, as TRL does.
        dtype = torch.get_autocast_dtype(hidden.device.type) if autocast else hidden.dtype
        if not autocast and weight.dtype != dtype:
            # `cast_lm_head_to_fp32`: TRL runs the projection in the hidden states' dtype (fp32). It casts
            # one vocabulary chunk at a time; this whole-weight copy costs V·H·4 bytes more (docs/trl.md)
            weight = weight.to(dtype)
        if not autocast and bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        if logit_scale != 1.0:
            # The logits are linear in (hidden, bias): scaling both scales them before the softcap, as in TRL
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        workspace = configured_head_workspace_bytes()
        if workspace is None:
            # Unless the user set a budget, TRL's: its head holds one [4096 tokens, chunk_size vocabulary]
            # tile, and fastalign's chunks may take as much (more rows per GEMM: on CPU its 32 MiB default
            # makes 32-row chunks of a 49k vocabulary, 2.5x slower)
            tokens, columns = min(hidden.shape[0], TRL_TOKEN_TILE), min(weight.shape[0], chunk_size)
            trl_tile = tokens * columns * dtype.itemsize
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
    """Why TRL's fused head is not the protocol ``FusedLogProbs`` implements, or None when it is: the
    version, then TRL's own function (not whatever its slot holds now) and its parameters."""
    import trl

    try:
        version = Version(trl.__version__)
    except Exception:  # an unparsable version ("unknown" from a source tree) is not a supported one
        return f"TRL version {trl.__version__!r} is not a release"
    if version.release[:2] != SUPPORTED_TRL:
        return f"TRL {version} is outside the supported {'.'.join(map(str, SUPPORTED_TRL))}.x"
    if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
        return "trl.trainer.utils has no _ChunkedLogProbFunction"
    try:
        forward = _trl_original().forward
    except (ImportError, AttributeError) as error:
        return f"TRL's ChunkedLogProbFunction is not there ({error})"
    parameters = tuple(inspect.signature(forward).parameters)
    if parameters != PROTOCOL:
        return f"TRL's ChunkedLogProbFunction.forward takes {parameters}, not {PROTOCOL}"
    return None


def enable() -> bool:
    """Make TRL's fused LM head (every ``model(..., fused_lm_head=True)``) run on fastalign's kernels.

    Idempotent and thread-safe. Returns whether fastalign now serves the head: False, with one warning
    per process, when the installed TRL is not the supported protocol (TRL's own head stays,
    unchanged), or when another library's function holds TRL's slot (that one stays)."""
    global _trl_function, _serving, _warned, _warned_foreign
    from trl.trainer import utils as trl_utils

    with _lock:
        if getattr(trl_utils, "_ChunkedLogProbFunction", None) is FusedLogProbs:
            _serving = True
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
        current = trl_utils._ChunkedLogProbFunction
        if current is not _trl_original():
            # Another library's function in TRL's slot (put there before or since fastalign took TRL's
            # own): replacing it would drop it for good (the fallback and disable() know TRL's only)
            if not _warned_foreign:
                warnings.warn(
                    f"fastalign.integrations.trl.enable(): trl.trainer.utils._ChunkedLogProbFunction is "
                    f"{getattr(current, '__qualname__', current)!r}, put there by another library: left in "
                    "place, and TRL's fused LM head is not fastalign's",
                    stacklevel=2,
                )
                _warned_foreign = True
            return False
        if _trl_function is None:  # the first swap: what TRL's slot holds is TRL's function, kept for good
            _trl_function = current
        trl_utils._ChunkedLogProbFunction = FusedLogProbs
        _serving = True
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
    """Give TRL its own fused head back (e.g. to compare both in one process). Thread-safe.

    TRL's slot gets TRL's function back only if it still holds fastalign's: a function another library
    put there since stays, with one warning. Either way ``FusedLogProbs`` (a reference to it kept
    anywhere) passes every call to TRL's function from now on."""
    global _serving, _warned_foreign
    from trl.trainer import utils as trl_utils

    with _lock:
        _serving = False
        current = trl_utils._ChunkedLogProbFunction
        if current is FusedLogProbs:
            trl_utils._ChunkedLogProbFunction = _trl_original()
        elif _trl_function is not None and current is not _trl_function and not _warned_foreign:
            warnings.warn(
                f"fastalign.integrations.trl.disable(): trl.trainer.utils._ChunkedLogProbFunction is now "
                f"{getattr(current, '__qualname__', current)!r}, put there by another library: left in "
                "place (fastalign's function, if it still calls it, passes every call to TRL's)",
                stacklevel=2,
            )
            _warned_foreign = True
