"""Model shapes for the memory planner: built-in configs of public models, tiny test models, local
``config.json`` files, and the ``ModelShape`` the planner's arithmetic reads.

Only shapes matter (no weights): sizes of the embeddings, the decoder layers' linear layers, biases and
norms, and a mixture-of-experts layer's router and experts (Mixtral, Qwen1.5-MoE, Qwen3-MoE: every layer
routed). ``ModelShape.params`` equals ``sum(p.numel() for p in model.parameters())`` of the Hugging Face
model built from the same config (tests check it for every built-in shape on the meta device).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from fastalign.errors import one_line


class PlanError(ValueError):
    """Bad planner input; ``option`` is the ``plan_memory`` parameter at fault (the CLI names its flag)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
_QWEN25 = {"model_type": "qwen2", "vocab_size": 152064, "rope_theta": 1000000.0}
_QWEN25_SMALL = {**_QWEN25, "vocab_size": 151936, "tie_word_embeddings": True}


def _llama3(hidden: int, intermediate: int, layers: int, heads: int, **extra) -> dict:
    return {
        **_LLAMA3,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        **extra,
    }


def _qwen25(base: dict, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict:
    return {
        **base,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }


#: Hugging Face config fields of public models (from their config.json files), by planner name.
BUILTIN_SHAPES: dict[str, dict] = {
    "llama-3-8b": _llama3(4096, 14336, 32, 32),
    "llama-3-70b": _llama3(8192, 28672, 80, 64),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64),
    "llama-3.1-405b": _llama3(16384, 53248, 126, 128),
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-0.5b": _qwen25(_QWEN25_SMALL, 896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": _qwen25(_QWEN25_SMALL, 1536, 8960, 28, 12, 2),
    "qwen2.5-3b": _qwen25(_QWEN25_SMALL, 2048, 11008, 36, 16, 2),
    "qwen2.5-7b": _qwen25(_QWEN25, 3584, 18944, 28, 28, 4),
    "qwen2.5-14b": _qwen25(_QWEN25, 5120, 13824, 48, 40, 8),
    "qwen2.5-32b": _qwen25(_QWEN25, 5120, 27648, 64, 40, 8),
    "qwen2.5-72b": _qwen25(_QWEN25, 8192, 29568, 80, 64, 8),
    "mistral-7b": {  # Mistral-7B-v0.3 (v0.1: vocab 32000)
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    # mixture-of-experts (their config.json files): every layer routes each token to top-k of E experts
    "mixtral-8x7b": {  # Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B activated per token
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,  # each expert's
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B: 30.5B parameters, 3.3B activated per token
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # the dense MLP of mlp_only_layers (none)
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    },
}


def _tiny_names() -> tuple[str, ...]:
    from fastalign.builtin import TINY_MODEL_TYPES

    return tuple(f"tiny-{family}" for family in TINY_MODEL_TYPES)


def shape_names() -> tuple[str, ...]:
    """Every built-in shape name: public models, then the repo's tiny test models."""
    return (*BUILTIN_SHAPES, *_tiny_names())


#: Config attributes that mark a mixture-of-experts model.
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
#: The mixture-of-experts model types the planner counts: every layer routed, experts of gated MLPs
#: held as 3-D ``gate_up_proj``/``down_proj`` (no biases), a bias-free router; Qwen1.5-MoE adds a shared
#: expert with a sigmoid gate. (DeepSeek-V3's latent attention and dense first layers, GPT-OSS's biased
#: experts and sinks are not modelled.)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
#: The sizes every Llama-style config has: ``ModelShape`` field ← config attribute.
_REQUIRED_SIZES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder (embeddings, L × [attention, gated MLP, norms], final norm, head).

    ``q_dim = num_heads · head_dim`` and ``kv_dim = num_kv_heads · head_dim`` are the widths of the query
    and of each of key/value (grouped-query attention).
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; or attention_bias (then o_proj has one too)
    o_bias: bool = False
    mlp_bias: bool = False
    norms_per_layer: int = 2  # Gemma 2/3: 4 (pre/post attention, pre/post MLP)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k (weights of head_dim)
    fused_qkv: bool = False  # Phi-3: one qkv_proj and one gate_up_proj
    fused_gate_up: bool = False
    # mixture of experts (0: a dense gated MLP of intermediate_size): each layer's E experts of width
    # expert_intermediate_size, top-k per token, and a shared expert (Qwen1.5-MoE) of its own width
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise PlanError(
                    "config",
                    f"{self.name} ({self.model_type}): {item.name} must be a size >= 0, got {value!r}",
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linears(self) -> list[tuple[str, int, int]]:
        """``(name, in_features, out_features)`` of one decoder layer's linear layers (LoRA targets, what
        4-bit quantization applies to). A MoE layer's experts and router are no ``nn.Linear``: its
        linear layers are the attention's and the shared expert's (with its gate)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        attention = (
            [("qkv_proj", h, q + 2 * kv)]
            if self.fused_qkv
            else [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv)]
        )
        if self.is_moe:
            s = self.shared_expert_intermediate_size
            shared = [
                ("gate_proj", h, s),
                ("up_proj", h, s),
                ("down_proj", s, h),
                ("shared_expert_gate", h, 1),
            ]
            return [*attention, ("o_proj", q, h), *(shared if s else [])]
        mlp = [("gate_up_proj", h, 2 * i)] if self.fused_gate_up else [("gate_proj", h, i), ("up_proj", h, i)]
        return [*attention, ("o_proj", q, h), *mlp, ("down_proj", i, h)]

    @property
    def layer_expert_params(self) -> int:
        """One layer's routed experts (a gated MLP each: 3·hidden·width) and router (experts × hidden)."""
        h = self.hidden_size
        return self.num_experts * (3 * h * self.expert_intermediate_size + h)

    @property
    def layer_active_params(self) -> int:
        """The weights one token's forward through a layer multiplies with (matrices only: the 2-D
        weights, as ``fastalign.train.metrics.training_flops_per_token`` counts them): the linear layers,
        the router, and its top-k experts."""
        expert = 3 * self.hidden_size * self.expert_intermediate_size
        routing = self.num_experts * self.hidden_size + self.experts_per_token * expert
        return self.layer_linear_params + (routing if self.is_moe else 0)

    def flops_per_token(self, sequence_length: int) -> float:
        """Training FLOPs per token as ``training_flops_per_token`` counts a dense model's, 6·P + 12·L·d·S,
        with P the weights a token activates (its top-k experts, not all E) and the head's."""
        active = self.num_layers * self.layer_active_params + self.vocab_size * self.hidden_size
        return 6.0 * active + 12 * self.num_layers * self.hidden_size * sequence_length

    @property
    def activation_shape(self) -> ModelShape:
        """The shape whose per-token activations the planner's formula counts: a MoE layer's as a dense
        gated MLP as wide as what a token goes through (its top-k experts and the shared one). An
        approximation: the router's logits and the tokens' gathering into experts are not counted."""
        if not self.is_moe:
            return self
        width = self.experts_per_token * self.expert_intermediate_size + self.shared_expert_intermediate_size
        return dataclasses.replace(self, intermediate_size=width, num_experts=0, experts_per_token=0)

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's linear layers (what 4-bit quantization and LoRA apply to)."""
        return sum(fan_in * fan_out for _, fan_in, fan_out in self.linears())

    @property
    def max_linear_params(self) -> int:
        return max(fan_in * fan_out for _, fan_in, fan_out in self.linears())

    @property
    def layer_other_params(self) -> int:
        """One layer's parameters outside its linear layers: biases, norm weights, and a MoE layer's
        experts and router (neither quantized to 4 bits nor LoRA targets)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        mlp_bias = 0 if self.is_moe else (2 * i + h) * self.mlp_bias
        biases = (q + 2 * kv) * self.qkv_bias + h * self.o_bias + mlp_bias
        return biases + self.norms_per_layer * h + 2 * self.head_dim * self.qk_norm + self.layer_expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of ``lm_head`` of its own: 0 when tied to the embeddings."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, final norm, untied head (FSDP's root unit)."""
        return self.embedding_params + self.hidden_size + self.head_params

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + self.layer_other_params

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    def lora_params(self, rank: int) -> int:
        """LoRA on every linear layer of the decoder layers (peft's 'all-linear': not ``lm_head``)."""
        return self.num_layers * rank * sum(fan_in + fan_out for _, fan_in, fan_out in self.linears())


#: How far (relative) the planner's parameter count may be from the model's own.
PARAMS_TOLERANCE = 0.005


def shape_from_config(config: PretrainedConfig, name: str | None = None) -> ModelShape:
    """The ``ModelShape`` of a decoder-only causal LM config (multimodal configs: their text config).

    Checked against the parameters of the model transformers builds from the config (on the meta
    device: no memory): a family whose layers the Llama-style count misses by more than
    ``PARAMS_TOLERANCE`` (a non-gated MLP, say) is refused rather than planned wrong; a few norm or bias
    vectors more or less (OLMo-2's q/k norms, Cohere's single norm) are within it."""
    shape = _shape_from_config(config, name)
    actual = _model_params(config.to_json_string())
    if actual is not None and abs(actual - shape.params) > PARAMS_TOLERANCE * actual:
        raise PlanError(
            "config",
            f"{shape.name} ({shape.model_type}) has {actual:,} parameters, but the planner's Llama-style "
            f"count of its layers gives {shape.params:,}: its norms, biases or MLP are not modelled yet",
        )
    return shape


@functools.lru_cache(maxsize=64)
def _model_params(config_json: str) -> int | None:
    """Parameters of the causal LM transformers builds from this config (None where it cannot)."""
    try:
        config = AutoConfig.for_model(**json.loads(config_json))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # a family transformers cannot build here: the Llama-style count stands alone
        return None
    return sum(parameter.numel() for parameter in model.parameters())


def _shape_from_config(config: PretrainedConfig, name: str | None) -> ModelShape:
    label = name or getattr(config, "name_or_path", "") or config.model_type
    moe = _moe_sizes(config, label)
    missing = [attribute for attribute in _REQUIRED_SIZES.values() if not getattr(config, attribute, None)]
    if missing:
        raise PlanError(
            "config",
            f"{label} ({config.model_type}) is not a Llama-style decoder: its config "
            f"has no {', '.join(missing)}",
        )
    sizes = {field: getattr(config, attribute) for field, attribute in _REQUIRED_SIZES.items()}
    heads = sizes["num_heads"]
    model_type = config.model_type
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelShape(
        name=label,
        model_type=model_type,
        **sizes,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias or bool(getattr(config, "qkv_bias", model_type == "qwen2")),
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
        **moe,
    )


def _moe_sizes(config: PretrainedConfig, label: str) -> dict[str, int]:
    """The ``ModelShape`` expert fields of a config (none for a dense one); a mixture-of-experts model
    the planner does not model (another type, or one with dense layers among the routed) is an error."""
    marks = [field for field in _MOE_FIELDS if getattr(config, field, None)]
    if not marks:
        return {}
    dense_layers = getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1
    if config.model_type not in MOE_MODEL_TYPES or dense_layers:
        what = "dense layers among the routed ones" if dense_layers else marks[0]
        raise PlanError(
            "config",
            f"{label} is a mixture-of-experts model ({what}) the planner does not model: it counts "
            f"{', '.join(MOE_MODEL_TYPES)} with every layer routed",
        )
    mixtral = config.model_type == "mixtral"
    return {
        "num_experts": config.num_local_experts if mixtral else config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "expert_intermediate_size": config.intermediate_size if mixtral else config.moe_intermediate_size,
        "shared_expert_intermediate_size": getattr(config, "shared_expert_intermediate_size", 0) or 0,
    }


def builtin_config(name: str) -> PretrainedConfig:
    """The Hugging Face config of a built-in shape name."""
    if name in BUILTIN_SHAPES:
        fields = dict(BUILTIN_SHAPES[name])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if name in _tiny_names():
        from fastalign.builtin import tiny_config

        return tiny_config(name.removeprefix("tiny-"))
    raise PlanError("config", _unknown_name(name))


def _unknown_name(name: str) -> str:
    names = shape_names()
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}?" if close else f"built-in shapes: {', '.join(names)}"
    return f"unknown model shape {name!r} and no such file ({hint})"


def _is_causal_lm(config: PretrainedConfig) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return False
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(arch.endswith(("ForCausalLM", "LMHeadModel")) for arch in architectures)
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def load_config(path: str | Path) -> PretrainedConfig:
    """A local ``config.json`` (or the directory holding one), read offline by ``AutoConfig``."""
    path = Path(path)
    directory = path.parent if path.is_file() and path.name == "config.json" else path
    source = directory if directory.is_dir() else path
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as error:
        # huggingface_hub's StrictDataclassError (a field of the wrong type) is not a ValueError
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, (StrictDataclassError, TypeError)):  # the field, then why, on lines of their own
            first = one_line(error)
        raise PlanError("config", f"cannot read a model config from {str(path)!r}: {first}") from error
    if not _is_causal_lm(config):
        kind = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise PlanError("config", f"{str(path)!r} describes {kind}, not a causal LM")
    return config


def resolve_model(model: str) -> tuple[str, PretrainedConfig]:
    """``(label, config)`` of a built-in shape name or a local config.json path / model directory."""
    if model in BUILTIN_SHAPES or model in _tiny_names():
        return model, builtin_config(model)
    path = Path(model).expanduser()
    if path.exists():
        config = load_config(path)
        return str(path), config
    if "/" in model or model.endswith(".json"):
        raise PlanError("config", f"no such file or directory: {model!r}")
    raise PlanError("config", _unknown_name(model))
