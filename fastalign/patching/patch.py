"""``patch_model`` / ``unpatch_model``: instance-level patching of a Hugging Face causal LM.

Every change is an instance attribute ``forward`` on a module of the model in hand (its RMSNorms,
MLPs, attentions and the causal-LM head), marked as fastalign's: the classes and the transformers
modules are untouched, other models in the process are unaffected, and deleting those attributes
restores the original exactly. Nothing captures a tensor at patch time, so a model moved to another
device or dtype before or after patching keeps working.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from torch import nn
from transformers.activations import ACT2FN

from fastalign.models.structure import base_model, decoder_body
from fastalign.ops.backend import BACKENDS, Backend
from fastalign.ops.tiled import DEFAULT_BUDGET_MIB
from fastalign.patching.bound import MARK, PatchedMethod
from fastalign.patching.causal_lm import fused_causal_lm_forward
from fastalign.patching.families import FAMILIES, GATED_ACTIVATIONS, Family, family_of
from fastalign.patching.generic import generic_plan
from fastalign.patching.lora import is_lora_linear, lora_linear_forward
from fastalign.patching.modules import (
    attention_forward_with_fused_rope,
    experts_forward,
    fused_gate,
    gated_mlp_forward,
    linear_forward,
    rms_norm_forward,
    uses_module_rope,
)

logger = logging.getLogger(__name__)

#: The attribute of the causal LM recording the pieces ``patch_model`` left out, and why.
_SKIPPED = "_fastalign_skipped"

#: Pieces whose CPU path (backend "torch") does not earn its place there: measured slower than the model's
#: own module, forward and backward, on the real model's shapes, or level and buying nothing
#: (``benchmarks/e2e/bench_trl_cpu_pieces.py``: SmolLM2-135M, fp32, batch 4 x 256 tokens, A and B
#: alternating in one process, on a 2-core AVX2 EPYC, shared); ``skip_slower_on_cpu`` leaves them out.
#: The gated MLP stays: level within the noise (0.92-1.03x in four runs) and one [tokens, intermediate]
#: activation less per layer.
CPU_SLOWER = {
    "rms_norm": (
        "its CPU path recomputes the norm in backward to keep only the input: 0.69x the model's own "
        "RMSNorm forward+backward at 1 thread, 0.28-0.87x at 2 (SmolLM2-135M shapes, fp32)"
    ),
    "rope": (
        "its CPU path is the model's own rotate-half arithmetic behind a dispatch: no memory saved, "
        "0.80-1.06x the model's own attention forward+backward (within the noise)"
    ),
}


def _base_causal_lm(model: nn.Module, *, head: bool, generic: bool = False) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside ``model`` (itself, or under a peft wrapper); without
    ``head`` (no fused loss), also a ``*ForSequenceClassification`` (a reward model: the same ``.model``
    body under a ``score`` head). Without ``generic``, its family must be in the table."""
    inner = base_model(model)
    if hasattr(inner, "config") and not generic:
        family_of(inner.config.model_type)  # an unsupported family: say so, listing the supported ones
    if (
        not hasattr(inner, "config")
        or decoder_body(inner) is None
        or (head and not hasattr(inner, "lm_head"))
    ):
        wanted = "a *ForCausalLM with a decoder body and .lm_head" if head else "a model with a decoder body"
        raise ValueError(
            f"patch_model expects a transformers causal LM ({wanted}), got {type(inner).__name__}"
        )
    return inner


#: The methods a patch replaces on an instance: ``forward``, and the ``*Experts`` modules' ``_apply_gate``
#: (which transformers' grouped expert matmuls call).
_METHODS = ("forward", "_apply_gate")


#: Where a module hooked by accelerate (``device_map``, ``cpu_offload``) had its ``_old_forward`` before
#: fastalign replaced it: ``unpatch_model`` puts it back.
_SAVED_OLD_FORWARD = "_fastalign_old_forward"


def _slot(module: nn.Module, method: str) -> str:
    """The attribute a patch of ``method`` replaces: accelerate's hooked ``forward`` wraps the module's
    ``_old_forward`` (its hooks move the inputs and load offloaded weights around that call), so on a
    hooked module the patch replaces ``_old_forward`` and leaves the hooks in place."""
    hooked = hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__
    return "_old_forward" if method == "forward" and hooked else method


def _set_forward(module: nn.Module, function: Callable, piece: str, method: str = "forward") -> None:
    bound = PatchedMethod(function, module)
    slot = _slot(module, method)
    if slot == "_old_forward" and _SAVED_OLD_FORWARD not in module.__dict__:
        module.__dict__[_SAVED_OLD_FORWARD] = module.__dict__["_old_forward"]
    setattr(module, slot, bound)
    setattr(function, MARK, piece)


def _patched_piece(module: nn.Module, method: str = "forward") -> str | None:
    forward = module.__dict__.get(_slot(module, method))
    return getattr(getattr(forward, "__func__", None), MARK, None)


def _applies_rope(attention: nn.Module, family: Family) -> bool:
    """Whether this attention module rotates q/k with the module-level ``apply_rotary_pos_emb`` (not a
    NoPE layer of a family that mixes them)."""
    return uses_module_rope(attention) and (family.rope_layer is None or family.rope_layer(attention))


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo ``patch_model``: every module gets its class's forward back. Returns the model."""
    for module in model.modules():
        for method in _METHODS:
            if _patched_piece(module, method) is None:
                continue
            if _slot(module, method) == "_old_forward":
                module._old_forward = module.__dict__.pop(_SAVED_OLD_FORWARD)
            else:
                delattr(module, method)
        module.__dict__.pop(_SKIPPED, None)
    return model


def skipped_pieces(model: nn.Module) -> dict[str, str]:
    """The pieces the last ``patch_model(..., skip_slower_on_cpu=True)`` of ``model`` left the model's
    own, each with the reason (empty when none was left out)."""
    for module in model.modules():
        if _SKIPPED in module.__dict__:
            return dict(module.__dict__[_SKIPPED])
    return {}


def _cpu_only(model: nn.Module) -> bool:
    devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    return devices <= {"cpu"}


def patched_pieces(model: nn.Module) -> dict[str, int]:
    """How many modules of each piece ('rms_norm', 'mlp', 'experts', 'rope', 'loss', 'lora') are patched
    (a piece the family computes otherwise is absent: ``fastalign.patching.families.Family.pieces``)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        piece = _patched_piece(module)
        if piece is not None:
            counts[piece] = counts.get(piece, 0) + 1
    return counts


def patch_model(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    loss: bool = True,
    lora: bool = True,
    linear: bool = True,
    return_logits: bool = False,
    backend: Backend = "auto",
    generic: bool = False,
    tiled_mlp: bool | None = None,
    tiled_mlp_budget_mib: float | None = None,
    skip_slower_on_cpu: bool = False,
) -> nn.Module:
    """Make a supported Hugging Face causal LM use fastalign's kernels, in place; returns the model.

    Args:
        model: a ``*ForCausalLM`` of a supported ``config.model_type`` (see
            ``fastalign.patching.SUPPORTED_MODEL_TYPES``; any other with ``generic``), or a peft model
            wrapping one; with ``loss=False`` also a ``*ForSequenceClassification`` (a reward model's
            body).
        rms_norm, rope, mlp: fuse the RMSNorms, the rotary embedding of q/k, the gated MLP activation
            (with ``mlp``, also each expert's of a mixture-of-experts' ``*Experts``), where the family
            computes them as the kernels do (``fastalign.patching.families``: e.g. a LayerNorm, a
            non-gated MLP or an interleaved RoPE stays the model's own).
        loss: with ``labels`` (or ``logprob_targets``) the forward computes the loss (or per-token
            log-probs) with the fused linear cross-entropy and builds no logits.
        lora: in a peft model, each LoRA linear adds its update into the frozen layer's output in place
            (``fastalign.patching.lora``: peft's sum without its two temporaries per layer).
        linear: under autocast, each ``nn.Linear`` of the decoder casts its weight to the autocast dtype
            in forward and again in backward instead of saving the cast copy
            (``fastalign.ops.autocast_linear``: autocast's arithmetic, without a low-precision copy of
            every weight alive from forward to backward).
        return_logits: default of the forward's ``return_logits``: also build logits when a loss is
            computed (costs the [tokens, vocab] memory the fused head avoids).
        backend: 'auto' (Triton on CUDA, PyTorch elsewhere), 'triton' or 'torch'.
        generic: for a ``model_type`` not in the table (a supported one still uses the table), find the
            RMSNorms, gated MLPs, RoPE attentions and head by their structure and patch those that a probe
            on random tokens proves equal to the model's own forward (``fastalign.patching.generic``: the
            model must hold its weights). What it patched and why not the rest is logged at INFO
            (``generic_report`` returns it); ``patched_pieces`` counts the patched modules.
        tiled_mlp: with ``mlp``, a patched gated MLP given more tokens than one tile runs (with its LoRA
            adapters) in token tiles in forward and again in backward, keeping only its input
            (``fastalign.ops.tiled``): at long context a layer's working set is a tile's, not the
            sequence's [tokens, intermediate]. None: the ``FASTALIGN_TILED_MLP`` environment variable
            (``1`` turns it on).
        tiled_mlp_budget_mib: the working set of one tile in MiB, which sizes the tiles; None:
            ``FASTALIGN_TILED_MLP_BUDGET_MIB``, else 256.
        skip_slower_on_cpu: on a model whose weights are all on the CPU, with ``backend='auto'``, leave
            the model's own forward where fastalign's CPU path does not earn its place (``CPU_SLOWER``:
            the RMSNorms, slower; RoPE, level and saving nothing); what was left out, and why, is logged
            at INFO and returned by ``skipped_pieces``. The choice is made here, at patch time: patch
            after moving the model to a GPU. ``fastalign.integrations.trl.patch_model`` sets it
            (patching must not slow TRL down).

    Patching again replaces the earlier patch (so options can change); ``unpatch_model`` restores the
    original.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    causal_lm = _base_causal_lm(model, head=loss, generic=generic)
    if loss:
        _refuse_foreign_forward(causal_lm)
    config = causal_lm.config
    tile_budget = _tile_budget(tiled_mlp, tiled_mlp_budget_mib)
    wanted = {"rms_norm": rms_norm, "rope": rope, "mlp": mlp, "loss": loss}
    skipped = {}
    if skip_slower_on_cpu and backend == "auto" and _cpu_only(model):
        skipped = {piece: why for piece, why in CPU_SLOWER.items() if wanted.get(piece)}
        rms_norm, rope, mlp, loss = (wanted[piece] and piece not in skipped for piece in wanted)
        for piece, why in skipped.items():
            logger.info("fastalign: on CPU the model keeps its own %s: %s", piece, why)
    if generic and config.model_type not in FAMILIES:
        unpatch_model(model)
        pieces = dict(rms_norm=rms_norm, rope=rope, mlp=mlp, loss=loss)
        plan = generic_plan(
            causal_lm, **pieces, return_logits=return_logits, backend=backend, tile_budget=tile_budget
        )
        logger.info("fastalign: %s", plan.report.summary())
        for piece, module, function in plan.forwards:
            _set_forward(module, function, piece)
        if lora:
            patch_lora_layers(model)
        causal_lm.__dict__[_SKIPPED] = skipped
        return model
    family = family_of(config.model_type)
    unpatch_model(model)
    causal_lm.__dict__[_SKIPPED] = skipped

    unfused: set[str] = set()  # activations of MLPs left as they are (said once)
    if family.unpatched:
        logger.info("fastalign: %s keeps its own %s", config.model_type, family.unpatched)

    for module in decoder_body(causal_lm).modules():
        name = type(module).__name__
        norm = rms_norm and family.norm and name.endswith("RMSNorm")
        if norm and getattr(module, "weight", None) is not None:
            _set_forward(module, rms_norm_forward(family.norm == "gemma", backend), "rms_norm")
        elif mlp and family.mlp and name.endswith("MLP"):
            gelu = _fused_activation(module, config, unfused)
            if gelu is not None:
                forward = gated_mlp_forward(family.mlp, gelu, family.mlp_dropout, backend, tile_budget)
                _set_forward(module, forward, "mlp")
        elif mlp and family.experts and name.endswith("Experts"):
            gelu = _fused_activation(module, config, unfused)
            if gelu is not None:
                _set_forward(module, experts_forward(gelu, backend), "experts")
                _set_forward(module, fused_gate(gelu, backend), "experts", method="_apply_gate")
        elif rope and family.rope and name.endswith("Attention") and _applies_rope(module, family):
            fused = attention_forward_with_fused_rope(type(module), backend, family.rope_half_tables)
            _set_forward(module, fused, "rope")
        elif linear and type(module) is nn.Linear:
            _set_forward(module, linear_forward, "linear")
    for activation in sorted(unfused):
        logger.warning(
            "fastalign: activation %s has no fused kernel; those MLPs stay as they are", activation
        )
    if loss:
        head = fused_causal_lm_forward(backend, return_logits, family.logit_scale, family.router_aux_loss)
        _set_forward(causal_lm, head, "loss")
    if lora:
        patch_lora_layers(model)
    return model


def _fused_activation(module: nn.Module, config, unfused: set[str]) -> bool | None:
    """Whether the gated MLP (or experts) ``module`` computes tanh-GeLU (True) or SiLU (False), read from
    the activation it runs, its ``act_fn`` (Gemma's MLP reads ``hidden_act``, Gemma 2's and 3's
    ``hidden_activation``: a config may hold both, differing), else the config's; None, with its name added
    to ``unfused``, for an activation no fused kernel computes."""
    act_fn = getattr(module, "act_fn", None)
    if isinstance(act_fn, nn.Module):
        for name, gelu in GATED_ACTIVATIONS.items():
            if name in ACT2FN and type(act_fn) is type(ACT2FN[name]):
                return gelu
        unfused.add(type(act_fn).__name__)
        return None
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation in GATED_ACTIVATIONS:
        return GATED_ACTIVATIONS[activation]
    unfused.add(repr(activation))
    return None


def _refuse_foreign_forward(causal_lm: nn.Module) -> None:
    """Patching the head replaces the causal LM's instance ``forward``: refuse when one is there that
    fastalign did not install (TRL's fused LM head, which its trainers add when they are built, answers
    ``fused_lm_head=True`` with per-token log-probs that fastalign's forward does not give). On a module
    hooked by accelerate the patch replaces ``_old_forward`` and leaves the hook's ``forward`` alone."""
    if _slot(causal_lm, "forward") != "forward" or "forward" not in causal_lm.__dict__:
        return
    if _patched_piece(causal_lm) is None:
        forward = causal_lm.__dict__["forward"]
        name = getattr(forward, "__qualname__", type(forward).__name__)
        raise ValueError(
            f"patch_model: {type(causal_lm).__name__} already has an instance forward fastalign did not "
            f"install ({name}: TRL's fused LM head, if its trainer was built) and patching would replace it; "
            "patch the model before the trainer is built"
        )


def _tile_budget(tiled: bool | None, budget_mib: float | None) -> int | None:
    """``patch_model``'s tiling options (or their environment variables) as a tile budget in bytes, or
    None for untiled MLPs."""
    if tiled is None:
        tiled = os.environ.get("FASTALIGN_TILED_MLP", "0") not in ("", "0")
    if not tiled:
        return None
    if budget_mib is None:
        budget_mib = float(os.environ.get("FASTALIGN_TILED_MLP_BUDGET_MIB", DEFAULT_BUDGET_MIB))
    if budget_mib <= 0:
        raise ValueError(f"tiled_mlp_budget_mib must be > 0, got {budget_mib}")
    return int(budget_mib * 2**20)


def patch_lora_layers(model: nn.Module) -> int:
    """Give each peft LoRA linear of ``model`` the in-place update (``fastalign.patching.lora``); returns
    how many. ``patch_model`` does it (``lora=True``); call it again after adding adapters to a model
    that was patched before peft wrapped it."""
    layers = [module for module in model.modules() if is_lora_linear(module)]
    for layer in layers:
        _set_forward(layer, lora_linear_forward, "lora")
    return len(layers)
