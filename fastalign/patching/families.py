"""What ``patch_model`` needs to know about each supported architecture family.

One small adapter per ``config.model_type``, read off its transformers 5 modeling file: which RMSNorm
convention its norms follow, how its MLP is laid out, whether its attention's module-level
``apply_rotary_pos_emb`` is the rotate-half RoPE the fused op computes, and what its ``*ForCausalLM``
does to the logits besides ``lm_head``. A piece is patched only where the kernel computes the family's
own arithmetic; the rest (``unpatched`` says what and why) stays the model's code. Every family gets the
fused loss head, which applies ``final_logit_softcapping`` (read from the config) and ``logit_scale``.

Mixture-of-experts families: the ``*Experts`` module (3-D ``gate_up_proj``/``down_proj``, one
``act(gate)·up`` per expert) gets the fused activation where it is the plain gated one, the shared or
dense-layer ``*MLP``s the gated-MLP path, and the fused head adds the router's load-balancing loss as the
family's ``*ForCausalLM`` does (``router_aux_loss``).

Norm conventions: "llama" is ``w · cast(x̂)``, "gemma" is ``cast(x̂ · (1 + w))`` with x̂ in fp32. OLMo-2/3
and Helium compute ``cast(w · x̂)`` (the product in fp32), which neither kernel mode rounds the same way
in bf16: their norms stay unpatched, as do LayerNorms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn
from transformers import PretrainedConfig

NormConvention = Literal["llama", "gemma"]
MLPLayout = Literal["gate_up_down", "fused_gate_up"]
#: The pieces ``patch_model`` can patch, as ``patched_pieces`` names them.
PIECES = ("rms_norm", "mlp", "experts", "rope", "loss")


def times_logit_scale(config: PretrainedConfig) -> float:
    """Cohere's head: the logits times ``logit_scale``. (The logit scales are module-level functions: a
    patched head's recipe names them, so that a pickled patched model rebuilds it.)"""
    return config.logit_scale


def over_logits_scaling(config: PretrainedConfig) -> float:
    """Granite's head: the logits divided by ``logits_scaling``."""
    return 1.0 / config.logits_scaling


def times_logits_scaling(config: PretrainedConfig) -> float:
    """HyperCLOVA X's head: the logits times ``logits_scaling``."""
    return config.logits_scaling


@dataclass(frozen=True)
class Family:
    """One family's adapter. New fields must have defaults (other family tables build on this one)."""

    #: Convention of the modules named ``*RMSNorm``; None: its norms are not fused (see ``unpatched``).
    norm: NormConvention | None
    #: ``gate_proj``/``up_proj``/``down_proj`` or one ``gate_up_proj`` (gate first), applied as
    #: ``down(act(gate) · up)``; None: not a gated MLP, left as is.
    mlp: MLPLayout | None = "gate_up_down"
    #: The MLP ends in ``dropout(p=self.residual_dropout)`` (Seed-OSS): the patched MLP keeps it.
    mlp_dropout: bool = False
    #: The attention calls a module-level ``apply_rotary_pos_emb`` that rotates halves (not interleaved
    #: pairs), in the q/k dtype, over the first ``cos.shape[-1]`` dims: the fused op's arithmetic.
    rope: bool = True
    #: Which attention modules apply RoPE (None: all); the others (NoPE layers) are not patched.
    rope_layer: Callable[[nn.Module], bool] | None = None
    #: The cos/sin tables hold each frequency once (half the rotary dims) and ``apply_rotary_pos_emb``
    #: rotates ``(x1, x2)`` halves by them (GPT-OSS): the fused op gets them repeated, ``cat(cos, cos)``.
    rope_half_tables: bool = False
    #: Its ``*Experts`` modules hold ``[gate; up]`` concatenated in a 3-D ``gate_up_proj`` without biases
    #: and compute ``down(act(gate) · up)`` per expert: the fused activation applies.
    experts: bool = False
    #: Its ``*ForCausalLM`` adds ``router_aux_loss_coef · load_balancing_loss_func(router_logits, ...)`` to
    #: the loss when ``output_router_logits`` is on: the fused head does the same.
    router_aux_loss: bool = False
    #: The factor the ``*ForCausalLM`` multiplies ``lm_head``'s logits by (None: 1).
    logit_scale: Callable[[PretrainedConfig], float] | None = None
    #: What stays the model's own code, and why (logged by ``patch_model``).
    unpatched: str = ""

    @property
    def pieces(self) -> tuple[str, ...]:
        """The pieces ``patch_model`` patches in this family (the MLP also needs a fused activation)."""
        on = {
            "rms_norm": self.norm is not None,
            "mlp": self.mlp is not None,
            "experts": self.experts,
            "rope": self.rope,
            "loss": True,
        }
        return tuple(piece for piece in PIECES if on[piece])


_LLAMA = Family(norm="llama")
_INTERLEAVED_ROPE = "RoPE (interleaved pairs)"
_FP32_PRODUCT_NORM = "RMSNorm (w·x̂ rounded once, in fp32)"
_LAYER_NORM_INTERLEAVED_ROPE = f"LayerNorm; {_INTERLEAVED_ROPE}"

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma": Family(norm="gemma"),
    "gemma2": Family(norm="gemma"),
    "gemma3_text": Family(norm="gemma"),
    "phi3": Family(norm="llama", mlp="fused_gate_up"),
    # Dense families added for issue 23 (transformers 5.23 modeling files).
    "apertus": Family(norm="llama", mlp=None, unpatched="MLP (xIELU, not gated)"),
    "arcee": Family(norm="llama", mlp=None, unpatched="MLP (relu², not gated)"),
    "cohere": Family(
        norm=None, rope=False, logit_scale=times_logit_scale, unpatched=_LAYER_NORM_INTERLEAVED_ROPE
    ),
    "cohere2": Family(
        norm=None, rope=False, logit_scale=times_logit_scale, unpatched=_LAYER_NORM_INTERLEAVED_ROPE
    ),
    "cwm": _LLAMA,
    "ernie4_5": Family(norm="llama", rope=False, unpatched=_INTERLEAVED_ROPE),
    "exaone4": Family(norm="llama", rope_layer=lambda m: m.sliding_window is None or m.is_sliding),
    "glm": Family(norm="llama", mlp="fused_gate_up", rope=False, unpatched=_INTERLEAVED_ROPE),
    "glm4": Family(norm="llama", mlp="fused_gate_up", rope=False, unpatched=_INTERLEAVED_ROPE),
    "granite": Family(norm="llama", logit_scale=over_logits_scaling),
    "helium": Family(norm=None, rope=False, unpatched=f"{_FP32_PRODUCT_NORM}; {_INTERLEAVED_ROPE}"),
    "hunyuan_v1_dense": _LLAMA,
    "ministral": _LLAMA,
    "nemotron": Family(norm=None, mlp=None, unpatched="LayerNorm1P; MLP (relu², not gated)"),
    "olmo": Family(norm=None, unpatched="LayerNorm (no weights)"),
    "olmo2": Family(norm=None, unpatched=_FP32_PRODUCT_NORM),
    "olmo3": Family(norm=None, unpatched=_FP32_PRODUCT_NORM),
    "phi": Family(norm=None, mlp=None, unpatched="LayerNorm; MLP (fc1/fc2, not gated)"),
    "seed_oss": Family(norm="llama", mlp_dropout=True),
    "smollm3": Family(norm="llama", rope_layer=lambda m: m.use_rope),
    "stablelm": Family(norm=None, unpatched="LayerNorm"),
    "starcoder2": Family(norm=None, mlp=None, unpatched="LayerNorm; MLP (c_fc/c_proj, not gated)"),
    "vaultgemma": Family(norm="gemma"),
    # Mixture-of-experts families of issue 23 (transformers 5.23 modeling files).
    "deepseek_v3": Family(
        norm="llama",
        experts=True,  # the first_k_dense_replace layers and the shared experts: DeepseekV3MLP
        rope_layer=lambda m: not m.config.rope_interleave,
        unpatched="RoPE where rope_interleave (interleaved pairs; the config's default)",
    ),
    "gpt_oss": Family(
        norm=None,
        mlp=None,  # GptOssMLP is the router + experts block, not a gated MLP
        rope_half_tables=True,
        router_aux_loss=True,
        unpatched=f"{_FP32_PRODUCT_NORM}; experts (clamped, biased, alpha-scaled (up + 1)·glu)",
    ),
    "mixtral": Family(norm="llama", mlp=None, experts=True, router_aux_loss=True),
    "qwen2_moe": Family(norm="llama", experts=True, router_aux_loss=True),  # *MLP: the shared expert
    "qwen3_moe": Family(norm="llama", experts=True, router_aux_loss=True),  # *MLP: mlp_only_layers
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))

#: Hugging Face activation names the fused gated-MLP kernels compute exactly: name → uses GeLU (tanh).
GATED_ACTIVATIONS: dict[str, bool] = {
    "silu": False,
    "swish": False,
    "gelu_pytorch_tanh": True,
    "gelu_tanh": True,
}


def family_of(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(
            f"fastalign.patch_model does not support model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}; patch_model(model, generic=True) patches what a probe "
            "proves equal to the model's own forward"
        )
    return FAMILIES[model_type]
