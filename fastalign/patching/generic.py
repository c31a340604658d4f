"""``patch_model(model, generic=True)``: fused kernels for a model whose family is not in the table, only
where a probe proves them equal to the model's own forward.

For a ``config.model_type`` outside ``fastalign.patching.families.FAMILIES`` no adapter says which RMSNorm
convention the norms follow, whether the MLP is the gated one the kernels compute, or what the causal LM
does to its logits. Candidates are found by structure, and what they compute is decided by trying:

- rms_norm: a module whose class name ends in ``RMSNorm``, with a 1-D ``weight`` and a numeric
  ``variance_epsilon`` or ``eps``; its convention ("llama" ``w·cast(x̂)`` or "gemma" ``cast(x̂·(1+w))``) is
  the one that reproduces it, never read off its name;
- mlp: a module with ``gate_proj``/``up_proj``/``down_proj`` (or ``gate_up_proj``/``down_proj``) modules
  and an ``act_fn``; the gating activation (SiLU or tanh-GeLU) is the one that reproduces it;
- rope: a module whose forward calls its modeling module's ``apply_rotary_pos_emb``;
- loss: the causal LM's head, with the logit scale (none, ``logit_scale``, ``1/logits_scaling`` or
  ``logits_scaling``) that reproduces its logits, and the config's ``final_logit_softcapping``.

The probe: one forward of the model on ``PROBE_TOKENS`` random token ids records each candidate's inputs;
each candidate then runs on an fp32 copy of itself (in train mode, both forwards from the same RNG seed,
so that a dropout the patch would drop shows) with its own forward and with the patched one, and is kept
where the two agree within ``MODULE_TOLERANCE``. A norm is also run at an input whose mean square is its
eps (where a wrong eps shows) and, in bf16, must equal the convention's PyTorch arithmetic bit for bit
(where OLMo-2's single rounding of ``w·x̂`` shows). Last, the whole model with every kept piece against
the model as it is, in its own dtype and in eval mode: logits, loss and the gradients of the input
embeddings and of the head weight within ``MODEL_TOLERANCE``. A piece that fails stays the model's own
code and the report says why; if the probe itself fails (an error, weights on the meta device) or the
whole model disagrees, nothing is patched. The model is left as it was: the probe works on copies, on
temporary forwards it removes, and on ``torch.autograd.grad`` (no ``.grad`` is touched).
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from fastalign.errors import one_line
from fastalign.models.structure import base_model, decoder_body
from fastalign.ops.backend import Backend
from fastalign.patching.causal_lm import fused_causal_lm_forward
from fastalign.patching.families import over_logits_scaling, times_logit_scale, times_logits_scaling
from fastalign.patching.modules import (
    attention_forward_with_fused_rope,
    gated_mlp_forward,
    rms_norm_forward,
    uses_module_rope,
)

#: Length of the probe's random token sequence (one row).
PROBE_TOKENS = 16
#: Relative error (‖patched − original‖ / ‖original‖) a module may show on its fp32 copy.
MODULE_TOLERANCE = 1e-5
#: Relative error the whole model may show (logits, loss, gradients), by the model's dtype; half precision
#: otherwise (the kernels round differently from the model's bf16/fp16 ops).
MODEL_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_PRECISION_TOLERANCE = 2e-2

#: (patched piece, module, its replacement forward)
Forward = tuple[str, nn.Module, Callable]


@dataclass(frozen=True)
class GenericReport:
    """What ``patch_model(model, generic=True)`` patched and what it left, per piece and module class.

    patched: ``"<piece> <class>"`` → how many modules and what the probe found they compute (the norm
        convention, the activation, the logit scale).
    unpatched: ``"<piece> <class>"`` → why those modules keep their own forward (``"probe"``: why nothing
        was patched).
    """

    model_type: str
    patched: dict[str, str] = field(default_factory=dict)
    unpatched: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        patched = "; ".join(f"{key} ({how})" for key, how in self.patched.items()) or "nothing"
        line = f"generic patch of {self.model_type!r}: patched {patched}"
        if self.unpatched:
            line += "; kept " + "; ".join(f"{key} ({why})" for key, why in self.unpatched.items())
        return line


@dataclass(frozen=True)
class GenericPlan:
    """The forwards to set (``patch_model`` sets them, marked as its own) and the report."""

    forwards: list[Forward]
    report: GenericReport

    @classmethod
    def nothing(cls, model_type: str, why: str) -> GenericPlan:
        """No forward set: the probe (``why``) found nothing it could patch safely."""
        return cls([], GenericReport(model_type, unpatched={"probe": why}))


def generic_report(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    loss: bool = True,
    backend: Backend = "auto",
) -> GenericReport:
    """What ``patch_model(model, generic=True, ...)`` would patch in this (unpatched) model, and why not
    the rest, without patching it: ``patch_model`` logs the same report at INFO."""
    pieces = dict(rms_norm=rms_norm, rope=rope, mlp=mlp, loss=loss)
    return generic_plan(base_model(model), **pieces, return_logits=False, backend=backend).report


def generic_plan(
    causal_lm: nn.Module,
    *,
    rms_norm: bool,
    rope: bool,
    mlp: bool,
    loss: bool,
    return_logits: bool,
    backend: Backend,
    tile_budget: int | None = None,
) -> GenericPlan:
    """Probe ``causal_lm`` (a transformers model with a decoder body, ``decoder_body``, and ``.lm_head`` when
    ``loss``) and plan the forwards that reproduce it; see the module docstring."""
    model_type = causal_lm.config.model_type
    if any(param.is_meta for param in causal_lm.parameters()):
        why = "its weights are on the meta device: patch it once they are loaded"
        return GenericPlan.nothing(model_type, why)
    wanted = {"rms_norm": rms_norm, "mlp": mlp, "rope": rope}
    try:
        pieces = [piece for piece in _PROBES if wanted[piece]]
        return _plan(causal_lm, pieces, loss, return_logits, backend, tile_budget)
    except Exception as error:  # the model's own code, whatever it raises: then it stays as it is
        why = f"the probe failed ({type(error).__name__}: {one_line(error)})"
        return GenericPlan.nothing(model_type, why)


# ---------------------------------------------------------------------------------------------------
# Candidates: each probe returns (what it computes, the replacement forward) or why none fits.

Found = tuple[str, Callable] | str


def _norm_eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _probe_norm(module: nn.Module, args: tuple, kwargs: dict, backend: Backend) -> Found:
    weight, eps = getattr(module, "weight", None), _norm_eps(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return "no 1-D weight and numeric variance_epsilon/eps"
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return "called with more than one tensor"
    probe = _fp32_copy(module)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a weight far from 1 and from 0, so that w·x̂ and (1+w)·x̂ differ
        probe.weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5 + 0.25)
    x = args[0].float()
    at_eps = x * (eps / x.pow(2).mean(-1, keepdim=True).clamp_min(1e-30)).sqrt()
    for convention in ("llama", "gemma"):
        function = rms_norm_forward(convention == "gemma", backend)
        if any(_error(probe, function, (inputs,), {}) > MODULE_TOLERANCE for inputs in (x, at_eps)):
            continue
        half, x_half = copy.deepcopy(probe).to(torch.bfloat16), x.to(torch.bfloat16)
        reference = rms_norm_forward(convention == "gemma", "torch")
        with torch.no_grad():
            if not torch.equal(reference(half, x_half), half(x_half)):
                return f"computes the {convention} convention but rounds it otherwise in bf16"
        return f"{convention} convention", function
    return "computes neither w·x̂ nor (1+w)·x̂"


def _mlp_layout(module: nn.Module) -> str | None:
    def has(*names: str) -> bool:
        return all(isinstance(getattr(module, name, None), nn.Module) for name in names)

    if has("gate_up_proj", "down_proj"):
        return "fused_gate_up"
    if has("gate_proj", "up_proj", "down_proj"):
        return "gate_up_down"
    return None


def _probe_mlp(
    module: nn.Module, args: tuple, kwargs: dict, backend: Backend, tile_budget: int | None = None
) -> Found:
    layout = _mlp_layout(module)
    if not isinstance(getattr(module, "act_fn", None), nn.Module):
        return "no act_fn module"
    probe = _fp32_copy(module)
    for dropout in (False, True) if hasattr(module, "residual_dropout") else (False,):
        for gelu, activation in ((False, "SiLU"), (True, "tanh-GeLU")):
            function = gated_mlp_forward(layout, gelu, dropout, backend, tile_budget)
            if _error(probe, function, args, kwargs) <= MODULE_TOLERANCE:
                return f"down({activation}(gate)·up){' + dropout' if dropout else ''}", function
    return "not down(act(gate)·up) with SiLU or tanh-GeLU"


def _probe_rope(module: nn.Module, args: tuple, kwargs: dict, backend: Backend) -> Found:
    function = attention_forward_with_fused_rope(type(module), backend)  # the class's code
    if _error(_fp32_copy(module), function, args, kwargs) > MODULE_TOLERANCE:
        return "the fused rotate-half RoPE changes its output"
    return "rotate-half RoPE", function


#: piece → (is this module a candidate, its probe)
_PROBES: dict[str, tuple[Callable[[nn.Module], bool], Callable[..., Found]]] = {
    "rms_norm": (lambda module: type(module).__name__.endswith("RMSNorm"), _probe_norm),
    "mlp": (lambda module: _mlp_layout(module) is not None, _probe_mlp),
    "rope": (uses_module_rope, _probe_rope),
}


def _logit_scales(config: PretrainedConfig) -> list[tuple[str, Callable[[PretrainedConfig], float] | None]]:
    """The head's candidate logit scales: none, Cohere's ``logit_scale`` factor, Granite's
    ``logits_scaling`` divisor, HyperCLOVA X's ``logits_scaling`` factor."""
    scales: list[tuple[str, Callable[[PretrainedConfig], float] | None]] = [("lm_head(hidden)", None)]
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scales.append(("lm_head(hidden)·logit_scale", times_logit_scale))
    if isinstance(getattr(config, "logits_scaling", None), (int, float)):
        scales.append(("lm_head(hidden)/logits_scaling", over_logits_scaling))
        scales.append(("lm_head(hidden)·logits_scaling", times_logits_scaling))
    return scales


# ---------------------------------------------------------------------------------------------------
# The plan.


def _plan(
    causal_lm: nn.Module,
    pieces: list[str],
    loss: bool,
    return_logits: bool,
    backend: Backend,
    tile_budget: int | None,
) -> GenericPlan:
    """``generic_plan``'s probe, unguarded: the module ``pieces`` (names in ``_PROBES``) and, with
    ``loss``, the head; the MLPs found are tiled with ``tile_budget`` (``gated_mlp_forward``)."""
    config = causal_lm.config
    candidates = [
        (piece, module)
        for module in decoder_body(causal_lm).modules()
        for piece in pieces
        if _PROBES[piece][0](module)
    ]
    ids = _probe_ids(causal_lm)
    inputs = _record_inputs(causal_lm, {module for _, module in candidates}, ids)

    forwards: list[Forward] = []
    found: dict[str, list[str]] = {}  # "<piece> <class>" → what each patched module computes
    refused: dict[str, list[str]] = {}  # "<piece> <class>" → why each refused module was refused
    for piece, module in candidates:
        key = f"{piece} {type(module).__name__}"
        if module not in inputs:
            refused.setdefault(key, []).append("not called by the model's forward")
            continue
        try:
            options = {"tile_budget": tile_budget} if piece == "mlp" else {}
            result = _PROBES[piece][1](module, *inputs[module], backend, **options)
        except Exception as error:  # e.g. a quantized layer that has no fp32 copy
            result = f"its probe failed ({type(error).__name__}: {one_line(error)})"
        if isinstance(result, str):
            refused.setdefault(key, []).append(result)
        else:
            found.setdefault(key, []).append(result[0])
            forwards.append((piece, module, result[1]))

    head, head_refused = None, None
    with _eval(causal_lm), torch.enable_grad():
        expected = _outputs(causal_lm, ids, loss, fused_head=False)
        with _forwards(forwards):
            if loss:
                for description, scale in _logit_scales(config):
                    function = fused_causal_lm_forward(
                        backend, return_logits, scale, original_with_router_logits=True
                    )
                    with _forwards([("loss", causal_lm, function)]):
                        error = _max_error(_outputs(causal_lm, ids, loss, fused_head=True), expected)
                    if error <= _model_tolerance(causal_lm):
                        head = ("loss", causal_lm, function), description
                        break
                else:
                    head_refused = "its logits are not lm_head(hidden) times a config scale, then softcapped"
            body_error = 0.0
            if head is None:
                body_error = _max_error(_outputs(causal_lm, ids, loss, fused_head=False), expected)

    if body_error > _model_tolerance(causal_lm):
        why = f"the probed pieces together change the model's output (relative error {body_error:.1e})"
        return GenericPlan.nothing(config.model_type, why)
    patched = {key: _describe(values) for key, values in found.items()}
    unpatched = {key: _describe(values) for key, values in refused.items()}
    head_key = f"loss {type(causal_lm).__name__}"
    if head is not None:
        forwards.append(head[0])
        patched[head_key] = head[1]
    elif head_refused is not None:
        unpatched[head_key] = head_refused
    return GenericPlan(forwards, GenericReport(config.model_type, patched, unpatched))


def _describe(values: list[str]) -> str:
    """``"3 modules: llama convention"``, or each distinct value with its count."""
    counts = {value: values.count(value) for value in values}
    return "; ".join(f"{count} module{'s' * (count > 1)}: {value}" for value, count in counts.items())


# ---------------------------------------------------------------------------------------------------
# Running the probe.


def _probe_ids(causal_lm: nn.Module) -> torch.Tensor:
    embedding = causal_lm.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, embedding.num_embeddings, (1, PROBE_TOKENS), generator=generator)
    return ids.to(embedding.weight.device)


def _record_inputs(causal_lm: nn.Module, modules: set[nn.Module], ids: torch.Tensor) -> dict:
    """module → (args, kwargs) of its first call in one forward of the decoder body."""
    recorded: dict[nn.Module, tuple[tuple, dict]] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        recorded.setdefault(module, (args, kwargs))

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
    try:
        with torch.no_grad(), _eval(causal_lm):
            decoder_body(causal_lm)(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def _outputs(causal_lm: nn.Module, ids: torch.Tensor, loss: bool, fused_head: bool) -> list[torch.Tensor]:
    """What the whole-model check compares: logits and loss (or, without ``loss``, the body's last hidden
    state) and the gradients of the input embeddings and of a trainable head weight."""
    embeds = causal_lm.get_input_embeddings()(ids).detach().requires_grad_()
    if loss:
        extra = {"return_logits": True} if fused_head else {}
        out = causal_lm(inputs_embeds=embeds, labels=ids, use_cache=False, **extra)
        values, scalar = [out.logits, out.loss], out.loss
    else:
        hidden = decoder_body(causal_lm)(inputs_embeds=embeds, use_cache=False).last_hidden_state
        values, scalar = [hidden], hidden.float().square().mean()
    wrt = [embeds]
    head = getattr(getattr(causal_lm, "lm_head", None), "weight", None)
    if loss and isinstance(head, torch.Tensor) and head.requires_grad:
        wrt.append(head)
    return [value.detach() for value in values] + list(torch.autograd.grad(scalar, wrt))


def _model_tolerance(causal_lm: nn.Module) -> float:
    dtype = causal_lm.get_input_embeddings().weight.dtype
    return MODEL_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)


@contextlib.contextmanager
def _forwards(forwards: list[Forward]) -> Iterator[None]:
    """The forwards set on their modules for the block, then each module's own back."""
    before = [(module, module.__dict__.get("forward")) for _, module, _ in forwards]
    for _, module, function in forwards:
        module.forward = types.MethodType(function, module)
    try:
        yield
    finally:
        for module, forward in before:
            if forward is None:
                del module.forward
            else:
                module.forward = forward


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block; each module's own mode back after."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def _fp32_copy(module: nn.Module) -> nn.Module:
    """A copy in fp32 and train mode (dropout on: the probe compares it too)."""
    return copy.deepcopy(module).float().train()


def _to_fp32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_fp32(item) for key, item in value.items()}
    return value


def _error(probe: nn.Module, function: Callable, args: tuple, kwargs: dict) -> float:
    """Relative error of ``function`` bound to ``probe`` against ``probe``'s own forward on the same fp32
    inputs, both from the same RNG seed."""
    args, kwargs = _to_fp32(args), _to_fp32(kwargs)
    device = next((p.device for p in probe.parameters()), torch.device("cpu"))
    outputs = []
    for forward in (probe.forward, types.MethodType(function, probe)):
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            outputs.append(_tensors(forward(*args, **kwargs)))
    return _max_error(outputs[1], outputs[0])


def _tensors(value) -> list[torch.Tensor | None]:
    if isinstance(value, torch.Tensor) or value is None:
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    raise TypeError(f"a module output of type {type(value).__name__}")


def _max_error(got: list, expected: list) -> float:
    """The largest ‖got − expected‖ / ‖expected‖ over paired tensors (inf where their shapes differ or a
    value is not finite)."""
    if len(got) != len(expected):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        if a is None or b is None:
            if a is not b:
                return float("inf")
            continue
        if a.shape != b.shape:
            return float("inf")
        a, b = a.double(), b.double()
        scale = b.norm().item()
        error = (a - b).norm().item()
        error = error / scale if scale > 0 else error
        if not math.isfinite(error):
            return float("inf")
        worst = max(worst, error)
    return worst
