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
from fastalign.patching import patched_pieces
from fastalign.quant import QuantOptions, load_4bit_model, quantize_model
from fastalign.train.loading import load_model_and_tokenizer, materialize_model
from tests.helpers import relative_error

VOCAB = 512  # len(tiny_tokenizer()): the saved tokenizer's ids must all be rows of the embedding
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # tiny_tokenizer's
TOLERANCE = 1e-5  # fp32, patched vs original: loss and each gradient, relative

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
]
# fmt: on
BY_ID = {family.id: family for family in FAMILIES}
IDS = [family.id for family in FAMILIES]


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


def assert_patched_matches(original, batch, backend: str):
    patched = fastalign.patch_model(copy.deepcopy(original), backend=backend)
    assert set(patched_pieces(patched)) == {"rms_norm", "mlp", "rope", "loss"}, patched_pieces(patched)
    expected, got = original(**batch), patched(**batch)
    assert got.logits is None  # the fused head
    assert relative_error(got.loss, expected.loss) <= TOLERANCE, (got.loss.item(), expected.loss.item())
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched)


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
    _, directory = checkpoints(family_id)
    loaded = load_4bit_model(directory, QuantOptions())
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
    assert_patched_matches(original, packed_row(crossing_lengths(original.config)), backend="torch")


@pytest.mark.parametrize("family_id", IDS)
def test_triton_kernels_on_the_published_shapes(checkpoints, family_id):
    """The Triton kernels (interpreted on CPU: a short packed row) on these head dims (64, 96, 128, 256),
    GQA ratios, norms, activations, q/k/v biases and the final softcap."""
    original, _ = checkpoints(family_id)
    original.train()
    assert_patched_matches(original, packed_row([5, 3]), backend="triton")


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
        if "final_logit_softcapping" in change:  # applied by the fused head: it must move the loss
            assert relative_error(got.loss, expected.loss) > 1e-3, change

    if family_id != "phi3-128k":  # longrope picks its factors by the row's largest position
        last = crossing_lengths(model.config)[-1]
        alone = model(input_ids=batch["input_ids"][:, -last:], use_cache=False).logits
        torch.testing.assert_close(expected.logits[:, -last:], alone, rtol=1e-5, atol=1e-5)


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
