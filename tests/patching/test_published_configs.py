"""The published config.json of one model per family, shrunk to CPU size: what a random default config
never exercises (llama3 and longrope RoPE scaling, q/k/v biases, logit softcapping, sliding windows
crossed by the sequence, Gemma-3's local/global RoPE bases, query_pre_attn_scalar, tied embeddings).

For each: the trainer's meta-skeleton loading path equals ``from_pretrained``, and ``patch_model``
keeps the loss and every gradient of the original model on a packed row longer than the family's
sliding window (or longrope's ``original_max_position_embeddings``).

The configs are written as on the Hub (legacy ``rope_scaling`` / ``rope_theta`` /
``rope_local_base_freq`` / ``sliding_window_pattern`` keys, which transformers 5 turns into
``rope_parameters`` and ``layer_types`` when it reads a config.json) with the architectural details
exact and only the sizes shrunk: hidden size, intermediate size, layer count, head counts (head_dim
kept: RoPE frequencies, longrope's factor lists and query_pre_attn_scalar depend on it), vocabulary
(512, the size of ``fastalign.builtin.tiny_tokenizer()``, whose special ids replace the published
ones), ``max_position_embeddings`` only where noted. Where a window of 4096 makes a crossing row too slow
for the default run, the fast tests shrink it (``fast``, said per family) and a ``slow`` test keeps the
published value.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_tokenizer
from fastalign.patching import patched_pieces, shift_labels
from fastalign.patching.families import PIECES, family_of
from fastalign.quant import QuantOptions, load_4bit_model, quantize_model
from fastalign.train.loading import load_model_and_tokenizer, materialize_model
from tests.helpers import relative_error, require, to_device

VOCAB = 512  # len(tiny_tokenizer()): the saved tokenizer's ids must all be rows of the embedding
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # tiny_tokenizer's
TOLERANCE = 1e-5  # fp32, patched vs original: loss and each gradient, relative
#: Partial-rotary families with q/k biases or a 1/64 attention scale: the q/k gradients nearly cancel,
#: and the fp32 rounding of the fused loss head alone (every other piece unpatched) reaches 7e-5 there
#: (Phi-2's k_proj.bias: 1.4e-4 on the short Triton row).
PARTIAL_ROTARY_TOLERANCE = 2e-4

# fmt: off
# microsoft/Phi-3-mini-128k-instruct config.json, rope_scaling (48 = head_dim 96 / 2 values each).
PHI3_LONG_FACTOR = [
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
    1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
    6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
    14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
    54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
    60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
    63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
    64.57435607910156, 64.69000244140625, 64.76000213623047,
]
PHI3_SHORT_FACTOR = [
    1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
    1.5500000000000005, *[2.000000000000001] * 17, *[2.0500000000000007] * 6, 2.1000000000000005,
    2.1000000000000005, 2.1500000000000004, 2.25, 2.25, 2.25, 2.25, 2.25, 2.3999999999999995,
    2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982,
    2.799999999999998, 2.8999999999999977, 3.049999999999997,
]
# fmt: on


@dataclass(frozen=True)
class Published:
    """One family's published config.json (sizes shrunk) and what the tests need to know about it."""

    id: str
    model_id: str  # the Hub model whose config.json the values come from
    config: dict  # config.json as published, sizes shrunk (the published sizes in a comment)
    fast: dict = field(default_factory=dict)  # further shrinking for the default run (said why)
    #: config changes that each turn one of the family's details off: each must move the logits
    off: tuple[dict, ...] = ()
    attn_implementation: str = "sdpa"
    #: multipliers of some weights (by parameter-name suffix) so that, at random init, the details
    #: matter: sharper attention for RoPE scaling and attention softcapping, larger logits for the
    #: final softcapping.
    scale: dict = field(default_factory=dict)
    #: gradients' relative tolerance, patched vs original
    tolerance: float = TOLERANCE


# fmt: off
FAMILIES = [
    Published(
        "llama3.1",
        "meta-llama/Llama-3.1-8B",
        # published sizes: hidden 4096, intermediate 14336, 32 layers, 32 heads / 8 KV heads of 128,
        # vocab 128256
        {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3",
            },
            "rope_theta": 500000.0, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        },
        off=({"rope_scaling": None},),  # plain RoPE at the same theta
        scale={"q_proj.weight": 8.0, "k_proj.weight": 8.0},
    ),
    Published(
        "qwen2.5",
        "Qwen/Qwen2.5-0.5B-Instruct",
        # published sizes: hidden 896 (14 heads of 64, 2 KV heads), intermediate 4864, 24 layers,
        # vocab 151936; here 7 heads of 64 share 1 KV head (the published 7:1)
        {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
            "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
            "max_window_layers": 21, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": True, "use_cache": True, "use_sliding_window": False,
            "hidden_size": 448, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 7, "num_key_value_heads": 1,
        },
        off=({"rope_theta": 10000.0},),  # the default base instead of 1e6
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "gemma2",
        "google/gemma-2-2b",
        # published sizes: hidden 2304, intermediate 9216, 26 layers, 8 heads / 4 KV heads of 256,
        # vocab 256000
        {
            "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid",
            "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02,
            "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0, "sliding_window": 4096,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        # Rows crossing 4096 take seconds each (eager attention, 4100² scores): the fast tests use a
        # window of 24; the slow test the published 4096.
        fast={"sliding_window": 24},
        off=(
            {"attn_logit_softcapping": None}, {"final_logit_softcapping": None}, {"sliding_window": 1 << 20},
        ),
        attn_implementation="eager",  # sdpa has no softcapping (transformers picks eager by itself too)
        scale={"q_proj.weight": 20.0, "k_proj.weight": 20.0, "embed_tokens.weight": 20.0},
    ),
    Published(
        "gemma3",
        "google/gemma-3-1b-pt",
        # published sizes: hidden 1152, intermediate 6912, 26 layers, 4 heads / 1 KV head of 256,
        # vocab 262144; here 6 layers (one period of the 5 local : 1 global pattern), 2 heads
        {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": None, "cache_implementation": "hybrid",
            "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": 512, "sliding_window_pattern": 6,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        off=({"rope_local_base_freq": 1000000}, {"sliding_window": 1 << 20}),  # one base; no window
    ),
    Published(
        "phi3-128k",
        "microsoft/Phi-3-mini-128k-instruct",
        # published sizes: hidden 3072 (32 heads of 96, 32 KV heads), intermediate 8192, 32 layers,
        # vocab 32064
        {
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
            "attention_dropout": 0.0, "embd_pdrop": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "resid_pdrop": 0.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": PHI3_LONG_FACTOR, "short_factor": PHI3_SHORT_FACTOR, "type": "longrope",
            },
            "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False,
            "hidden_size": 192, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        # Rows longer than 4096 take seconds each: the fast tests switch factors past 24 positions,
        # max_position_embeddings shrunk with it to keep the ratio 32 (attention factor
        # sqrt(1 + ln 32 / ln 24) instead of sqrt(1 + ln 32 / ln 4096)); the slow test keeps 4096.
        fast={"original_max_position_embeddings": 24, "max_position_embeddings": 24 * 32},
        off=({"rope_scaling": None},),  # plain RoPE
        scale={"qkv_proj.weight": 3.0},
    ),
    Published(
        "mistral",
        "mistralai/Mistral-7B-v0.1",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), intermediate 14336, 32 layers,
        # vocab 32000 (head_dim 128 written out: hidden 64 here)
        {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "use_cache": True,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        },
        # Rows crossing 4096 take seconds each: the fast tests use a window of 24; the slow test 4096.
        fast={"sliding_window": 24},
        off=({"sliding_window": None},),
    ),
    # -- Dense families of issue 23. Shrunk as above: hidden 64 (head_dim kept), intermediate 128, two
    # layers or one period of a layer pattern, published head_dim / partial rotary / multipliers /
    # scales / eps / biases / RoPE scaling kept.
    Published(
        "granite3.3",
        "ibm-granite/granite-3.3-2b-instruct",
        # published sizes: hidden 2048 (32 heads of 64, 8 KV heads), intermediate 8192, 40 layers,
        # vocab 49159
        {
            "architectures": ["GraniteForCausalLM"], "model_type": "granite", "attention_bias": False,
            "attention_dropout": 0.1, "attention_multiplier": 0.015625, "embedding_multiplier": 12.0,
            "hidden_act": "silu", "initializer_range": 0.02, "logits_scaling": 8.0,
            "max_position_embeddings": 131072, "mlp_bias": False, "residual_multiplier": 0.22,
            "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
            "tie_word_embeddings": True,
            "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        off=({"logits_scaling": 1.0}, {"embedding_multiplier": 1.0}),
        scale={"embed_tokens.weight": 8.0, "q_proj.weight": 8.0, "k_proj.weight": 8.0},
    ),
    Published(
        "olmo",
        "allenai/OLMo-1B-0724-hf",
        # published sizes: hidden 2048 (16 heads of 128), intermediate 8192, 16 layers, vocab 50304
        {
            "architectures": ["OlmoForCausalLM"], "model_type": "olmo", "attention_bias": False,
            "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 4096, "rope_scaling": None, "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
    ),
    Published(
        "olmo2",
        "allenai/OLMo-2-0425-1B",
        # published sizes: hidden 2048 (16 heads of 128), intermediate 8192, 16 layers, vocab 100352
        {
            "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 500000, "tie_word_embeddings": False,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
    ),
    Published(
        "olmo3",
        "allenai/Olmo-3-1025-7B",
        # published sizes: hidden 4096 (32 heads of 128), intermediate 11008, 32 layers, vocab 100278;
        # here 4 layers (one period of 3 sliding : 1 full)
        {
            "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                "original_max_position_embeddings": 8192, "rope_type": "yarn",
            },
            "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        fast={"sliding_window": 24},  # as Mistral's
        off=({"sliding_window": 1 << 20}, {"rope_scaling": None}),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "glm4-0414",
        "THUDM/GLM-4-9B-0414",
        # published sizes: hidden 4096 (32 heads of 128, 2 KV heads), intermediate 13696, 40 layers,
        # vocab 151552
        {
            "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": True,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        scale={"q_proj.weight": 8.0, "k_proj.weight": 8.0},
        tolerance=PARTIAL_ROTARY_TOLERANCE,
    ),
    Published(
        "glm-4-chat",
        "THUDM/glm-4-9b-chat-hf",
        # published sizes: hidden 4096 (32 heads of 128, 2 KV heads), intermediate 13696, 40 layers,
        # vocab 151552
        {
            "architectures": ["GlmForCausalLM"], "model_type": "glm", "attention_bias": True,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "partial_rotary_factor": 0.5, "rms_norm_eps": 1.5625e-07,
            "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        scale={"q_proj.weight": 8.0, "k_proj.weight": 8.0},
        tolerance=PARTIAL_ROTARY_TOLERANCE,
    ),
    Published(
        "smollm3",
        "HuggingFaceTB/SmolLM3-3B",
        # published sizes: hidden 2048 (16 heads of 128, 4 KV heads), intermediate 11008, 36 layers,
        # vocab 128256; here 4 layers (one period: RoPE, RoPE, RoPE, NoPE)
        {
            "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 65536, "mlp_bias": False, "no_rope_layer_interval": 4,
            "no_rope_layers": [1, 1, 1, 0], "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 5000000.0, "sliding_window": None, "tie_word_embeddings": True,
            "use_sliding_window": False,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        off=({"no_rope_layers": [1, 1, 1, 1]},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "ministral",
        "mistralai/Ministral-8B-Instruct-2410",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), intermediate 12288, 36 layers,
        # vocab 131072. The Hub config declares model_type mistral; transformers' ministral reads the
        # same keys.
        {
            "architectures": ["MinistralForCausalLM"], "model_type": "ministral", "attention_dropout": 0.0,
            "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 100000000.0,
            "sliding_window": 32768, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        fast={"sliding_window": 24},  # as Mistral's (published: 32768)
        off=({"sliding_window": 1 << 20},),
    ),
    Published(
        "nemotron",
        "nvidia/Minitron-4B-Base",
        # published sizes: hidden 3072 (24 heads of 128, 8 KV heads), intermediate 9216, 32 layers,
        # vocab 256000
        {
            "architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "relu2", "initializer_range": 0.0134,
            "max_position_embeddings": 4096, "mlp_bias": False, "norm_eps": 1e-05,
            "partial_rotary_factor": 0.5, "rope_theta": 10000, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
        },
        off=({"partial_rotary_factor": 1.0},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "exaone4",
        "LGAI-EXAONE/EXAONE-4.0-32B",
        # published sizes: hidden 5120 (40 heads of 128, 8 KV heads), intermediate 27392, 64 layers,
        # vocab 102400; here 4 layers (one LLLG period: 3 sliding with RoPE, 1 global without)
        {
            "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "attention_dropout": 0.0,
            "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3",
            },
            "rope_theta": 1000000, "sliding_window": 4096, "sliding_window_pattern": 4,
            "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        fast={"sliding_window": 24},
        off=({"sliding_window": 1 << 20},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "cohere",
        "CohereForAI/c4ai-command-r-v01",
        # published sizes: hidden 8192 (64 heads of 128), intermediate 22528, 40 layers, vocab 256000
        {
            "architectures": ["CohereForCausalLM"], "model_type": "cohere", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "max_position_embeddings": 8192,
            "rope_theta": 8000000.0, "tie_word_embeddings": True, "use_qk_norm": False,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        off=({"logit_scale": 1.0},),
        scale={"embed_tokens.weight": 20.0},  # (tied head) logits large enough for logit_scale to matter
    ),
    Published(
        "cohere2",
        "CohereForAI/c4ai-command-r7b-12-2024",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), intermediate 14336, 32 layers,
        # vocab 256000; here 4 layers (one period of 3 sliding : 1 global)
        {
            "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "layer_norm_eps": 1e-05, "logit_scale": 0.25, "max_position_embeddings": 8192,
            "rope_theta": 50000.0, "sliding_window": 4096, "sliding_window_pattern": 4,
            "tie_word_embeddings": True,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        fast={"sliding_window": 24},
        off=({"logit_scale": 1.0}, {"sliding_window": 1 << 20}),
        scale={"embed_tokens.weight": 20.0},
    ),
    Published(
        "helium",
        "kyutai/helium-1-preview-2b",
        # published sizes: hidden 2048 (16 heads of 128), intermediate 8192, 28 layers, vocab 48000
        {
            "architectures": ["HeliumForCausalLM"], "model_type": "helium", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 4096, "mlp_bias": False, "rms_norm_eps": 1e-08,
            "rope_theta": 100000.0, "tie_word_embeddings": False,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
    ),
    Published(
        "seed-oss",
        "ByteDance-Seed/Seed-OSS-36B-Instruct",
        # published sizes: hidden 5120 (80 heads of 128, 8 KV heads), intermediate 27648, 64 layers,
        # vocab 155136
        {
            "architectures": ["SeedOssForCausalLM"], "model_type": "seed_oss", "attention_bias": True,
            "attention_dropout": 0.1, "attention_out_bias": False, "head_dim": 128, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 524288, "mlp_bias": False,
            "residual_dropout": 0.1, "rms_norm_eps": 1e-06, "rope_theta": 10000000.0,
            "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
    ),
    Published(
        "hunyuan-dense",
        "tencent/Hunyuan-7B-Instruct",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), intermediate 14336, 32 layers,
        # vocab 128167
        {
            "architectures": ["HunYuanDenseV1ForCausalLM"], "model_type": "hunyuan_v1_dense",
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 32768, "mlp_bias": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
            "rope_theta": 10000.0, "tie_word_embeddings": False, "use_qk_norm": True,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        off=({"rope_scaling": None},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "ernie4.5",
        "baidu/ERNIE-4.5-0.3B-PT",
        # published sizes: hidden 1024 (16 heads of 128, 2 KV heads), intermediate 3072, 18 layers,
        # vocab 103424
        {
            "architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "head_dim": 128,
            "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "rope_theta": 500000, "tie_word_embeddings": True, "use_bias": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
    ),
    Published(
        "apertus",
        "swiss-ai/Apertus-8B-2509",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), intermediate 21504, 32 layers,
        # vocab 131072
        {
            "architectures": ["ApertusForCausalLM"], "model_type": "apertus", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "xielu", "initializer_range": 0.02,
            "max_position_embeddings": 65536, "mlp_bias": False, "qk_norm": True, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3",
            },
            "rope_theta": 12000000, "tie_word_embeddings": False,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
    ),
    Published(
        "arcee",
        "arcee-ai/AFM-4.5B",
        # published sizes: hidden 2560 (20 heads of 128, 4 KV heads), intermediate 18432, 36 layers,
        # vocab 128004
        {
            "architectures": ["ArceeForCausalLM"], "model_type": "arcee", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "relu2", "initializer_range": 0.02,
            "max_position_embeddings": 65536, "mlp_bias": False, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0, "beta_slow": 1.0, "factor": 20.0, "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
            },
            "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        off=({"rope_scaling": None},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "vaultgemma",
        "google/vaultgemma-1b",
        # published sizes: hidden 1152 (4 heads of 256), intermediate 6912, 26 layers, vocab 256000
        {
            "architectures": ["VaultGemmaForCausalLM"], "model_type": "vaultgemma", "attention_bias": False,
            "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02,
            "max_position_embeddings": 1024, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0, "sliding_window": 512, "tie_word_embeddings": True,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        fast={"sliding_window": 24},
        attn_implementation="eager",  # transformers has no sdpa path for it
    ),
    Published(
        "starcoder2",
        "bigcode/starcoder2-3b",
        # published sizes: hidden 3072 (24 heads of 128, 2 KV heads), intermediate 12288, 30 layers,
        # vocab 49152
        {
            "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "attention_dropout": 0.1,
            "embedding_dropout": 0.1, "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.018042,
            "max_position_embeddings": 16384, "norm_epsilon": 1e-05, "residual_dropout": 0.1,
            "rope_theta": 999999.4420358813, "sliding_window": 4096, "tie_word_embeddings": True,
            "use_bias": True,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        fast={"sliding_window": 24},
        off=({"sliding_window": None},),
    ),
    Published(
        "stablelm2",
        "stabilityai/stablelm-2-1_6b",
        # published sizes: hidden 2048 (32 heads of 64), intermediate 5632, 24 layers, vocab 100352
        {
            "architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "attention_dropout": 0.0,
            "hidden_act": "silu", "hidden_dropout": 0.0, "initializer_range": 0.02, "layer_norm_eps": 1e-05,
            "max_position_embeddings": 4096, "partial_rotary_factor": 0.25, "qk_layernorm": False,
            "rope_theta": 10000, "tie_word_embeddings": False, "use_parallel_residual": False,
            "use_qkv_bias": True,
            "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        off=({"partial_rotary_factor": 1.0},),
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
        tolerance=PARTIAL_ROTARY_TOLERANCE,
    ),
    Published(
        "phi2",
        "microsoft/phi-2",
        # published sizes: hidden 2560 (32 heads of 80), intermediate 10240, 32 layers, vocab 51200
        {
            "architectures": ["PhiForCausalLM"], "model_type": "phi", "attention_dropout": 0.0,
            "embd_pdrop": 0.0, "hidden_act": "gelu_new", "initializer_range": 0.02, "layer_norm_eps": 1e-05,
            "max_position_embeddings": 2048, "partial_rotary_factor": 0.4, "qk_layernorm": False,
            "resid_pdrop": 0.1, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_size": 160, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2,
        },
        off=({"partial_rotary_factor": 1.0},),
        scale={"q_proj.weight": 8.0, "k_proj.weight": 8.0},
        tolerance=PARTIAL_ROTARY_TOLERANCE,
    ),
    Published(
        "cwm",
        "facebook/cwm",
        # published sizes: hidden 6144 (48 heads of 128, 8 KV heads), intermediate 21504, 64 layers,
        # vocab 128256; here 4 layers (one period of 3 sliding : 1 global)
        {
            "architectures": ["CwmForCausalLM"], "model_type": "cwm", "attention_dropout": 0.0,
            "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3",
            },
            "rope_theta": 1000000.0, "sliding_window": 8192,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        fast={"sliding_window": 24},
        off=({"sliding_window": 1 << 20},),
    ),
]
# fmt: on
BY_ID = {family.id: family for family in FAMILIES}
IDS = [family.id for family in FAMILIES]


#: Config keys of what the ``*ForCausalLM`` does to the logits, which the fused head reproduces.
HEAD_DETAILS = {"final_logit_softcapping", "logits_scaling", "logit_scale"}


def threshold(config) -> int:
    """The length a row must exceed to reach the family's long-context code path, or 0."""
    if config.model_type == "phi3":
        return config.rope_parameters["original_max_position_embeddings"]
    return getattr(config, "sliding_window", None) or 0


def _config_dict(family: Published, fast: bool, **changes) -> dict:
    config = copy.deepcopy(family.config) | SPECIAL_IDS | {"vocab_size": VOCAB}
    return config | (copy.deepcopy(family.fast) if fast else {}) | changes


def read_config(family: Published, directory: Path, *, fast: bool = True, **changes):
    """The config as transformers reads the (shrunk) published config.json from a directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_config_dict(family, fast, **changes)))
    return AutoConfig.from_pretrained(directory)


def build(family: Published, config) -> torch.nn.Module:
    """Random fp32 weights from seed 0; norms and biases randomized too (they init to constants) and
    the ``scale`` weights multiplied, so that every detail moves the output."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=family.attn_implementation, dtype=torch.float32
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(torch.randn_like(param), alpha=0.5 if name.endswith("bias") else 0.1)
                for suffix, factor in family.scale.items():
                    if name.endswith(suffix):
                        param.mul_(factor)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family id, fast) → (a copy of the random model, the directory it was saved in with the tiny
    tokenizer), each built once per module."""
    built: dict[tuple[str, bool], tuple[torch.nn.Module, Path]] = {}

    def get(family_id: str, fast: bool = True) -> tuple[torch.nn.Module, Path]:
        key = (family_id, fast)
        if key not in built:
            family = BY_ID[family_id]
            root = tmp_path_factory.mktemp(f"{family_id}-{'fast' if fast else 'published'}")
            model = build(family, read_config(family, root / "hub", fast=fast))
            model.save_pretrained(root / "checkpoint")
            tiny_tokenizer().save_pretrained(root / "checkpoint")
            built[key] = model, root / "checkpoint"
        model, directory = built[key]
        return copy.deepcopy(model), directory

    return get


def packed_row(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Sequences packed in one row (positions restart, no attention mask, as padding-free collators
    give them); labels -100 on the first token of each later sequence (no target across a boundary)
    and on one more token."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, VOCAB, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.clone()
    starts = torch.tensor(lengths).cumsum(0)[:-1]
    labels[0, starts] = -100
    labels[0, 3] = -100
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "use_cache": False}


def crossing_lengths(config) -> list[int]:
    """A first sequence 8 tokens past the threshold (window or longrope switch), then a short one."""
    return [max(threshold(config), 16) + 8, 8]


def is_tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def assert_same_gradients(original, patched, tolerance=TOLERANCE):
    for (name, a), (_, b) in zip(original.named_parameters(), patched.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert a.grad.abs().sum() > 0, f"{name}: no gradient reaches it"
        assert relative_error(b.grad, a.grad) <= tolerance, f"{name}: {relative_error(b.grad, a.grad):.2e}"


def same_dropout(model, batch):
    """The forward with the RNG reseeded: a family whose published config keeps dropout on (Granite,
    Seed-OSS, StarCoder2, Phi-2) draws the same masks in the original and the patched model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model(**batch)


def assert_patched_matches(original, batch, backend: str, tolerance: float = TOLERANCE):
    patched = fastalign.patch_model(copy.deepcopy(original), backend=backend)
    pieces = family_of(original.config.model_type).pieces
    got_pieces = patched_pieces(patched)
    assert tuple(piece for piece in PIECES if piece in got_pieces) == pieces, got_pieces
    expected, got = same_dropout(original, batch), same_dropout(patched, batch)
    assert got.logits is None  # the fused head
    assert relative_error(got.loss, expected.loss) <= TOLERANCE, (got.loss.item(), expected.loss.item())
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, tolerance)


# ---------------------------------------------------------------------------------------------------
# What transformers reads from each config.json: the tests below exercise these details.


def test_transformers_reads_the_published_details(tmp_path):
    llama = read_config(BY_ID["llama3.1"], tmp_path / "llama")
    assert llama.rope_parameters == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    inv_freq = build(BY_ID["llama3.1"], llama).model.rotary_emb.inv_freq
    plain = 1.0 / 500000.0 ** (torch.arange(0, 128, 2).float() / 128)
    torch.testing.assert_close(inv_freq[:8], plain[:8])  # high frequencies kept, the lowest divided by 8
    torch.testing.assert_close(inv_freq[-8:], plain[-8:] / 8)

    qwen = build(BY_ID["qwen2.5"], read_config(BY_ID["qwen2.5"], tmp_path / "qwen"))
    attention = qwen.model.layers[0].self_attn
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attention.o_proj.bias is None and attention.head_dim == 64
    assert qwen.config.rope_parameters["rope_theta"] == 1e6 and qwen.config.sliding_window is None
    assert is_tied(qwen)

    gemma2 = build(BY_ID["gemma2"], read_config(BY_ID["gemma2"], tmp_path / "gemma2", fast=False))
    assert gemma2.config.layer_types == ["sliding_attention", "full_attention"]
    assert [layer.self_attn.sliding_window for layer in gemma2.model.layers] == [4096, None]
    assert gemma2.model.layers[0].self_attn.scaling == 256**-0.5
    assert (gemma2.config.attn_logit_softcapping, gemma2.config.final_logit_softcapping) == (50.0, 30.0)
    assert is_tied(gemma2) and gemma2.config._attn_implementation == "eager"

    gemma3 = build(BY_ID["gemma3"], read_config(BY_ID["gemma3"], tmp_path / "gemma3"))
    assert gemma3.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert [layer.self_attn.sliding_window for layer in gemma3.model.layers] == [512] * 5 + [None]
    assert gemma3.config.rope_parameters == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000},
    }
    rotary = gemma3.model.rotary_emb
    torch.testing.assert_close(rotary.sliding_attention_inv_freq[-1], torch.tensor(10000.0 ** (-254 / 256)))
    torch.testing.assert_close(rotary.full_attention_inv_freq[-1], torch.tensor(1e6 ** (-254 / 256)))
    assert gemma3.model.layers[0].self_attn.scaling == 256**-0.5
    assert is_tied(gemma3)

    phi3 = read_config(BY_ID["phi3-128k"], tmp_path / "phi3", fast=False)
    rope = phi3.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 4096
    head_dim = phi3.hidden_size // phi3.num_attention_heads
    assert len(rope["short_factor"]) == len(rope["long_factor"]) == head_dim // 2 == 48
    rotary = build(BY_ID["phi3-128k"], phi3).model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))

    mistral = read_config(BY_ID["mistral"], tmp_path / "mistral", fast=False)
    assert mistral.sliding_window == 4096 and mistral.head_dim == 128


# ---------------------------------------------------------------------------------------------------
# 1. The trainer's loading path: a meta skeleton, filled tensor by tensor, equals from_pretrained.


@torch.no_grad()
@pytest.mark.parametrize("family_id", IDS)
def test_skeleton_filled_from_checkpoint_equals_from_pretrained(checkpoints, family_id):
    built, directory = checkpoints(family_id)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    skeleton, _ = load_model_and_tokenizer(str(directory), materialize=False)
    assert all(param.is_meta for param in skeleton.parameters())
    model = materialize_model(skeleton, str(directory), None, torch.device("cpu"), seed=0).eval()

    tied = reference.config.tie_word_embeddings
    assert is_tied(model) == is_tied(reference) == tied
    if not tied:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    for expected in (reference, built):
        state, want = model.state_dict(), expected.state_dict()
        assert state.keys() == want.keys()
        for name, tensor in want.items():
            assert state[name].dtype == tensor.dtype == torch.float32, name
            assert torch.equal(state[name], tensor), name
    buffers = dict(reference.named_buffers())  # rotary tables, Gemma-3's embedding scale: computed
    assert dict(model.named_buffers()).keys() == buffers.keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name

    batch = packed_row(crossing_lengths(model.config))
    del batch["labels"]
    torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("family_id", IDS)
def test_4bit_layer_by_layer_load_equals_quantizing_from_pretrained(checkpoints, family_id):
    """The QLoRA path (``load_4bit_model``: quantized layer by layer as the tensors arrive)."""
    require("bitsandbytes")  # quantizes
    _, directory = checkpoints(family_id)
    loaded = load_4bit_model(directory, QuantOptions()).eval()  # as from_pretrained: no dropout
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    expected = quantize_model(reference, QuantOptions())
    assert is_tied(loaded) == is_tied(expected) == loaded.config.tie_word_embeddings
    state, want = loaded.state_dict(), expected.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    batch = packed_row(crossing_lengths(loaded.config))
    del batch["labels"]
    torch.testing.assert_close(loaded(**batch).logits, expected(**batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family_id", IDS)
def test_the_loaded_tokenizer_is_the_saved_one(checkpoints, family_id):
    """transformers 5's AutoTokenizer replaces the generic tokenizer class a qwen2 checkpoint declares
    by Qwen2Tokenizer (its own pre-tokenizer, an added <|endoftext|> past the embedding): the loader
    keeps the declared one."""
    _, directory = checkpoints(family_id)
    _, tokenizer = load_model_and_tokenizer(str(directory), materialize=False)
    saved = tiny_tokenizer()
    text = "What is 12 plus 30? The answer is 42."
    assert len(tokenizer) == len(saved) == VOCAB
    assert tokenizer(text)["input_ids"] == saved(text)["input_ids"]


# ---------------------------------------------------------------------------------------------------
# 2. patch_model keeps the loss and every gradient, on a packed row that crosses the window.


@pytest.mark.parametrize("family_id", IDS)
def test_patched_matches_original_on_a_packed_row_past_the_window(checkpoints, family_id):
    original, _ = checkpoints(family_id)
    original.train()
    batch = packed_row(crossing_lengths(original.config))
    assert_patched_matches(original, batch, backend="torch", tolerance=BY_ID[family_id].tolerance)


@pytest.mark.parametrize("family_id", IDS)
def test_triton_kernels_on_the_published_shapes(checkpoints, family_id, device):
    """The Triton kernels (on CUDA, or interpreted on CPU: a short packed row) on these head dims (64,
    96, 128, 256), GQA ratios, norms, activations, q/k/v biases and the final softcap."""
    original, _ = checkpoints(family_id)
    original = copy.deepcopy(original).to(device).train()  # the shared fixture's model stays on CPU
    batch = {key: to_device(value, device) for key, value in packed_row([5, 3]).items()}
    tolerance = BY_ID[family_id].tolerance
    assert_patched_matches(original, batch, backend="triton", tolerance=tolerance)


@torch.no_grad()
@pytest.mark.parametrize("family_id", IDS)
def test_the_rows_exercise_each_detail(checkpoints, family_id, tmp_path):
    """The same weights with one of the family's details switched off give other logits on the
    crossing row (so the tests above would see a patch that lost it), and packing is honoured: the
    last sequence of the row has the logits it has alone."""
    family = BY_ID[family_id]
    model, _ = checkpoints(family_id)
    batch = packed_row(crossing_lengths(model.config))
    expected = model(**batch)
    for i, change in enumerate(family.off):
        off = build(family, read_config(family, tmp_path / str(i), **change))
        off.load_state_dict(model.state_dict())
        got = off(**batch)
        assert relative_error(got.logits, expected.logits) > 1e-4, change
        if set(change) & HEAD_DETAILS:  # applied by the fused head: it must move the loss
            assert relative_error(got.loss, expected.loss) > 1e-3, change

    if family_id != "phi3-128k":  # longrope picks its factors by the row's largest position
        last = crossing_lengths(model.config)[-1]
        alone = model(input_ids=batch["input_ids"][:, -last:], use_cache=False).logits
        torch.testing.assert_close(expected.logits[:, -last:], alone, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# The dense families of issue 23: what their configs turn on, and the fused head's other outputs.

DENSE_IDS = IDS[IDS.index("granite3.3") :]


def test_the_dense_families_details_and_what_is_patched(checkpoints):
    granite, _ = checkpoints("granite3.3")
    config = granite.config
    multipliers = (config.logits_scaling, config.embedding_multiplier, config.residual_multiplier)
    assert multipliers == (8.0, 12.0, 0.22)
    assert granite.model.layers[0].self_attn.scaling == 0.015625

    smollm3, _ = checkpoints("smollm3")  # every 4th layer NoPE: its attention keeps the model's forward
    assert [layer.self_attn.use_rope for layer in smollm3.model.layers] == [1, 1, 1, 0]
    exaone4, _ = checkpoints("exaone4")  # LLLG: RoPE in the 3 sliding layers, none in the global one
    assert [layer.self_attn.is_sliding for layer in exaone4.model.layers] == [True, True, True, False]
    for model in (smollm3, exaone4):
        patched = fastalign.patch_model(model)
        assert patched_pieces(patched)["rope"] == 3
        assert "forward" not in patched.model.layers[3].self_attn.__dict__

    nemotron, _ = checkpoints("nemotron")  # partial rotary: cos/sin of 64 of the head's 128 dims
    assert nemotron.model.rotary_emb.inv_freq.shape == (32,)
    assert nemotron.model.layers[0].self_attn.head_dim == 128
    for family_id, scale in (("cohere", 0.0625), ("cohere2", 0.25)):
        model, _ = checkpoints(family_id)
        assert model.logit_scale == scale and is_tied(model)
    seed, _ = checkpoints("seed-oss")
    assert seed.model.layers[0].mlp.residual_dropout == 0.1


@torch.no_grad()
@pytest.mark.parametrize("family_id", DENSE_IDS)
def test_fused_head_outputs_and_greedy_generation_match(checkpoints, family_id):
    """Per-token log-probs (at a temperature), logits on request and ``head_fn``'s view of the head (with
    the softcap it is handed) equal the original model's logits after its own scaling/softcapping; greedy
    decoding is unchanged."""
    original, _ = checkpoints(family_id)
    patched = fastalign.patch_model(copy.deepcopy(original))
    batch = packed_row([9, 7])
    targets = shift_labels(batch.pop("labels"))
    logits = original(**batch).logits
    expected = (logits / 0.7).log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    out = patched(**batch, logprob_targets=targets, temperature=0.7, return_logits=True)
    torch.testing.assert_close(out.token_logprobs, expected * (targets != -100), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
    cap = getattr(original.config, "final_logit_softcapping", None)
    if cap is None:
        head = patched(**batch, head_fn=lambda h, w, b: torch.nn.functional.linear(h, w, b)).head_output
    else:  # the softcap comes to a head_fn that takes it; one that does not is refused
        with pytest.raises(ValueError, match="head_fn takes no softcap"):
            patched(**batch, head_fn=lambda h, w, b: torch.nn.functional.linear(h, w, b))

        def capped(hidden, weight, bias, softcap):
            return softcap * torch.tanh(torch.nn.functional.linear(hidden, weight, bias) / softcap)

        head = patched(**batch, head_fn=capped).head_output
    torch.testing.assert_close(head, logits, rtol=1e-5, atol=1e-5)

    prompt = {"input_ids": batch["input_ids"][:, :6]}
    generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**prompt, **generate), original.generate(**prompt, **generate))


@pytest.mark.parametrize("family_id", ["granite3.3", "cohere", "smollm3"])
def test_peft_lora_on_scaled_logits_and_nope_layers(checkpoints, family_id):
    peft = require("peft")
    model, _ = checkpoints(family_id)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    original = peft.get_peft_model(model, lora)
    for name, param in original.named_parameters():
        if "lora_B" in name:  # make the adapters matter
            torch.nn.init.normal_(param, std=0.02)
    patched = fastalign.patch_model(copy.deepcopy(original))
    batch = packed_row([9, 7])
    expected, got = same_dropout(original.train(), batch), same_dropout(patched.train(), batch)
    assert relative_error(got.loss, expected.loss) <= TOLERANCE
    expected.loss.backward()
    got.loss.backward()
    for (name, a), (_, b) in zip(original.named_parameters(), patched.named_parameters(), strict=True):
        if a.requires_grad:
            assert relative_error(b.grad, a.grad) <= TOLERANCE, name


# ---------------------------------------------------------------------------------------------------
# Phi-3's longrope: short factors up to original_max_position_embeddings, long ones past it.


def _longrope_inv_freq(factors: list[float]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors) * 10000.0 ** (torch.arange(0, 96, 2).float() / 96))


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_phi3_longrope_factors_switch_with_length(checkpoints, long):
    original, directory = checkpoints("phi3-128k")
    original.train()
    switch = threshold(original.config)
    lengths = [switch + 4, 6] if long else [switch - 4, 6]
    batch = packed_row(lengths)
    assert_patched_matches(original, batch, backend="torch")  # its forward set the factors
    expected = _longrope_inv_freq(PHI3_LONG_FACTOR if long else PHI3_SHORT_FACTOR)
    torch.testing.assert_close(original.model.rotary_emb.inv_freq, expected)

    # The loaded skeleton switches the same way (its rotary buffers came through materialize_model).
    skeleton, _ = load_model_and_tokenizer(str(directory), materialize=False)
    loaded = materialize_model(skeleton, str(directory), None, torch.device("cpu"), seed=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).loss, original(**batch).loss, rtol=0, atol=0)
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, expected)


# ---------------------------------------------------------------------------------------------------
# The published windows themselves (slow: rows of 4100 tokens).


@pytest.mark.slow
@pytest.mark.parametrize("family_id", ["gemma2", "phi3-128k", "mistral"])
def test_published_window_crossed(checkpoints, family_id):
    original, _ = checkpoints(family_id, fast=False)
    assert threshold(original.config) == 4096
    original.train()
    assert_patched_matches(original, packed_row([4096 + 4, 6]), backend="torch")
    if family_id == "phi3-128k":  # that row took the long factors
        torch.testing.assert_close(original.model.rotary_emb.inv_freq, _longrope_inv_freq(PHI3_LONG_FACTOR))
