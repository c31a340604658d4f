"""``patch_model`` on the mixture-of-experts families: Mixtral, Qwen1.5-MoE, Qwen3-MoE, GPT-OSS and
DeepSeek-V3, each a random-weight model built from its published config.json (sizes shrunk, read and
built as ``test_published_configs`` does).

What is patched: the RMSNorms, RoPE and the shared-expert / dense-layer gated MLPs as in the dense
families; each ``*Experts`` module's ``act(gate) · up`` through the fused activation, in both of
transformers' expert paths ("grouped_mm", its default, and the "eager" loop over the hit experts); and
the fused head adds the router's load-balancing loss (``output_router_logits``, as an argument or from the
config) times ``router_aux_loss_coef``, as each family's ``*ForCausalLM`` does. What is not: GPT-OSS's
experts (a clamped, biased, alpha-scaled ``(up + 1) · glu``) and norms (w·x̂ in fp32), DeepSeek-V3's
interleaved RoPE (its config's default).

The sizes: hidden 64 (head dims kept), 2 layers, the published top-k with at most 16 experts, expert
intermediate 32-128, vocabulary 512; DeepSeek-V3's ``first_k_dense_replace`` 3 → 1 (one dense layer, one
MoE layer). The published FP8 / MXFP4 ``quantization_config`` entries are left out (random bf16/fp32
weights here).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fastalign
from fastalign.models.structure import decoder_layers
from fastalign.patching import patched_pieces, shift_labels, unpatch_model
from fastalign.patching.families import PIECES, family_of
from fastalign.sampling import generation
from tests.helpers import relative_error, to_device
from tests.patching import test_trainer as trainer_runs
from tests.patching.test_patch_model import TOLERANCE as DTYPE_TOLERANCE
from tests.patching.test_published_configs import (
    TOLERANCE,
    VOCAB,
    Published,
    assert_same_gradients,
    build,
    read_config,
)

# fmt: off
MOE = [
    Published(
        "mixtral",
        "mistralai/Mixtral-8x7B-v0.1",
        # published sizes: hidden 4096 (32 heads of 128, 8 KV heads), 8 experts of intermediate 14336,
        # 32 layers, vocab 32000
        {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
            "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
            "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
            "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
        },
    ),
    Published(
        "qwen1.5-moe",
        "Qwen/Qwen1.5-MoE-A2.7B",
        # published sizes: hidden 2048 (16 heads of 128), 60 experts of 1408, shared expert 5632,
        # 24 layers, vocab 151936
        {
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
            "decoder_sparse_step": 1, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 8192, "max_window_layers": 21, "norm_topk_prob": False,
            "num_experts_per_tok": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": 32768,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
            "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128,
        },
        # q/k biases: the q/k gradients nearly cancel, and the original's own fp32 gradients are 2e-5 off
        # its fp64 ones there (the patched model's 1.8e-5): the fused head's rounding alone moves them 1.3e-5
        tolerance=5e-5,
    ),
    Published(
        "qwen3-moe",
        "Qwen/Qwen3-30B-A3B",
        # published sizes: hidden 2048 (32 heads of 128, 4 KV heads), 128 experts of 768, 48 layers,
        # vocab 151936
        {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 48,
            "mlp_only_layers": [], "norm_topk_prob": True, "num_experts_per_tok": 8,
            "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 1,
            "num_experts": 16, "moe_intermediate_size": 32,
        },
    ),
    Published(
        "gpt-oss",
        "openai/gpt-oss-20b",
        # published sizes: hidden 2880 (64 heads of 64, 8 KV heads), 32 experts of 2880, 24 layers
        # alternating sliding (128) / full, vocab 201088
        {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "initial_context_length": 4096, "initializer_range": 0.02,
            "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
            "num_experts_per_tok": 4, "output_router_logits": False, "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                "rope_type": "yarn", "truncate": False,
            },
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
            "tie_word_embeddings": False, "use_cache": True,
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 1, "num_local_experts": 8,
        },
        attn_implementation="eager",  # its attention sinks: no sdpa
    ),
    Published(
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        # published sizes: hidden 7168 (128 heads), q/kv LoRA ranks 1536/512, 256 experts of 2048 in 8
        # groups, dense intermediate 18432, 61 layers (the first 3 dense), vocab 129280
        {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
            "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 163840, "moe_layer_freq": 1,
            "n_group": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": 8,
            "num_nextn_predict_layers": 1, "pretraining_tp": 1, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096, "type": "yarn",
            },
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
            "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "use_cache": True,
            "v_head_dim": 128,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "first_k_dense_replace": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 48, "kv_lora_rank": 32,
            "n_routed_experts": 16, "moe_intermediate_size": 32,
        },
    ),
]
# fmt: on
BY_ID = {family.id: family for family in MOE}
IDS = list(BY_ID)
#: The families whose *ForCausalLM adds the router's load-balancing loss (DeepSeek-V3 balances without).
AUX_IDS = [family_id for family_id in IDS if family_of(BY_ID[family_id].config["model_type"]).router_aux_loss]
IMPLEMENTATIONS = ["grouped_mm", "eager"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family id, changes) → a copy of the random fp32 model, each built once per module."""
    built: dict[tuple, torch.nn.Module] = {}

    def get(family_id: str, **changes) -> torch.nn.Module:
        key = (family_id, *sorted(changes.items()))
        if key not in built:
            family = BY_ID[family_id]
            built[key] = build(family, read_config(family, tmp_path_factory.mktemp(family_id), **changes))
        return copy.deepcopy(built[key])

    return get


def padded_batch(length: int = 24) -> dict[str, torch.Tensor]:
    """Two rows, the second right-padded (the aux loss leaves padding out through the attention mask)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, VOCAB, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, length - 7 :] = 0
    input_ids[1, length - 7 :] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "use_cache": False}


def expected_pieces(model) -> tuple[str, ...]:
    """The family's pieces, less RoPE where DeepSeek-V3 rotates interleaved pairs (not patched) and less
    the gated MLP where the config has no dense layer (Qwen3-MoE's empty ``mlp_only_layers``)."""
    pieces = family_of(model.config.model_type).pieces
    if getattr(model.config, "rope_interleave", False):
        pieces = tuple(piece for piece in pieces if piece != "rope")
    if not any(type(module).__name__.endswith("MLP") for module in model.modules()):
        pieces = tuple(piece for piece in pieces if piece != "mlp")
    return pieces


def pair(models, family_id: str, implementation: str = "grouped_mm", backend: str = "torch", **changes):
    original = models(family_id, **changes).train()
    original.set_experts_implementation(implementation)
    patched = fastalign.patch_model(copy.deepcopy(original), backend=backend)
    got = patched_pieces(patched)
    assert tuple(piece for piece in PIECES if piece in got) == expected_pieces(original), got
    return original, patched


# ---------------------------------------------------------------------------------------------------
# What the published configs turn on, and which modules get which patch.


def test_the_published_details_and_what_is_patched(models):
    mixtral = models("mixtral")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.router_aux_loss_coef) == (8, 2, 0.02)
    assert mixtral.config._experts_implementation == "grouped_mm"  # transformers' default, also on CPU
    patched = fastalign.patch_model(mixtral)
    # linear: q, k, v, o of each layer (the experts are 3-D tensors, the router's gate is its own module)
    assert patched_pieces(patched) == {"rms_norm": 5, "experts": 2, "rope": 2, "loss": 1, "linear": 8}
    experts = patched.model.layers[0].mlp.experts
    assert {"forward", "_apply_gate"} <= experts.__dict__.keys()
    unpatch_model(patched)
    assert not {"forward", "_apply_gate"} & experts.__dict__.keys()

    qwen2 = models("qwen1.5-moe")  # the shared expert is a Qwen2MoeMLP: the gated-MLP path
    assert patched_pieces(fastalign.patch_model(qwen2))["mlp"] == 2
    assert qwen2.model.layers[0].mlp.gate.norm_topk_prob is False

    deepseek = models("deepseek-v3")  # layer 0 dense, layer 1 routed + shared: three DeepseekV3MLPs
    assert type(deepseek.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert deepseek.config.rope_interleave and deepseek.config.rope_parameters["rope_type"] == "yarn"
    pieces = patched_pieces(fastalign.patch_model(deepseek))
    assert pieces["mlp"] == 2 and pieces["experts"] == 1 and "rope" not in pieces  # dense + shared MLP

    gpt_oss = models("gpt-oss")  # RoPE (its half tables repeated), the head, q k v o of its 2 layers
    assert gpt_oss.model.rotary_emb(torch.zeros(1), torch.arange(4)[None])[0].shape[-1] == 32  # of 64
    assert patched_pieces(fastalign.patch_model(gpt_oss)) == {"rope": 2, "loss": 1, "linear": 8}

    assert decoder_layers(mixtral) == list(mixtral.model.layers)  # what FSDP2 shards one by one


# ---------------------------------------------------------------------------------------------------
# Loss, router aux loss and every gradient: patched vs original.


def _forward(model, batch, router: str):
    """``router``: "off", "argument" (``output_router_logits=True``) or "config" (set on the config)."""
    model.config.output_router_logits = router == "config"
    return model(**batch, **({"output_router_logits": True} if router == "argument" else {}))


@pytest.mark.parametrize("router", ["off", "argument"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family_id", IDS)
def test_loss_aux_loss_and_gradients_match(models, family_id, implementation, router):
    original, patched = pair(models, family_id, implementation)
    batch = padded_batch()
    expected, got = _forward(original, batch, router), _forward(patched, batch, router)
    assert got.logits is None  # the fused head
    assert relative_error(got.loss, expected.loss) <= TOLERANCE, (got.loss.item(), expected.loss.item())
    if router == "off" or family_id not in AUX_IDS:
        assert got.aux_loss is None and getattr(expected, "aux_loss", None) is None
    else:
        assert relative_error(got.aux_loss, expected.aux_loss) <= TOLERANCE
        coef = original.config.router_aux_loss_coef
        with torch.no_grad():  # the aux loss is in the loss, times the family's coefficient
            without = _forward(copy.deepcopy(patched), batch, "off").loss
        torch.testing.assert_close(got.loss - without, coef * got.aux_loss.detach(), rtol=1e-4, atol=1e-6)
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, BY_ID[family_id].tolerance)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bf16_gradients_match(models, implementation):
    original, patched = pair(models, "qwen1.5-moe", implementation)
    original.to(torch.bfloat16)
    patched.to(torch.bfloat16)
    batch = padded_batch()
    expected, got = _forward(original, batch, "argument"), _forward(patched, batch, "argument")
    tolerance = DTYPE_TOLERANCE[torch.bfloat16]
    assert relative_error(got.loss, expected.loss) <= tolerance
    assert relative_error(got.aux_loss, expected.aux_loss) <= tolerance
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, tolerance)


def test_output_router_logits_from_the_config(models):
    """The config's ``output_router_logits`` (off in every published config) turns the aux loss on too."""
    original, patched = pair(models, "mixtral")
    batch = padded_batch()
    expected, got = _forward(original, batch, "config"), _forward(patched, batch, "config")
    assert got.aux_loss is not None
    assert relative_error(got.aux_loss, expected.aux_loss) <= TOLERANCE
    assert relative_error(got.loss, expected.loss) <= TOLERANCE


@pytest.mark.parametrize(
    "family_id, implementation, changes",
    [
        ("qwen1.5-moe", "grouped_mm", {}),
        ("qwen1.5-moe", "eager", {}),
        ("deepseek-v3", "grouped_mm", {"rope_interleave": False}),  # RoPE on MLA's q/k rotary slices
    ],
    ids=["qwen1.5-moe-grouped_mm", "qwen1.5-moe-eager", "deepseek-v3-no-interleave"],
)
def test_triton_kernels(models, family_id, implementation, changes, device):
    """The Triton kernels (on CUDA, or interpreted on CPU: short rows) on the experts' gate/up halves (through
    ``_apply_gate`` and through the eager loop's ``glu_linear``), the shared expert, norms, RoPE, head."""
    original, patched = pair(models, family_id, implementation, backend="triton", **changes)
    original, patched = original.to(device), patched.to(device)
    batch = {key: to_device(value, device) for key, value in padded_batch(length=10).items()}
    expected, got = _forward(original, batch, "argument"), _forward(patched, batch, "argument")
    assert relative_error(got.loss, expected.loss) <= TOLERANCE
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, BY_ID[family_id].tolerance)


# ---------------------------------------------------------------------------------------------------
# The fused head's other outputs, and generation.


@torch.no_grad()
@pytest.mark.parametrize("family_id", IDS)
def test_token_logprobs_and_greedy_generation_match(models, family_id):
    original = models(family_id)
    patched = fastalign.patch_model(copy.deepcopy(original))
    batch = padded_batch()
    targets = shift_labels(batch.pop("labels"))
    logits = original(**batch).logits
    expected = (logits / 0.7).log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    out = patched(**batch, logprob_targets=targets, temperature=0.7, output_router_logits=True)
    torch.testing.assert_close(out.token_logprobs, expected * (targets != -100), rtol=1e-5, atol=1e-5)
    reference = original(**batch, output_router_logits=True)
    if getattr(reference, "router_logits", None) is None:
        # transformers 5.17's DeepSeek-V3 records no router logits (5.23's does): none to pass on
        assert getattr(out, "router_logits", None) is None
    else:
        routed = sum(hasattr(layer.mlp, "experts") for layer in original.model.layers)
        assert len(out.router_logits) == len(reference.router_logits) == routed
    if family_id in AUX_IDS:  # computed for trainers that add it themselves (TRL's DPO, GRPO)
        torch.testing.assert_close(out.aux_loss, reference.aux_loss, rtol=1e-5, atol=1e-6)

    prompt = {"input_ids": batch["input_ids"][:1, :6]}
    generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**prompt, **generate), original.generate(**prompt, **generate))


@torch.no_grad()
@pytest.mark.parametrize("shared", [False, True], ids=["repeated", "shared"])
@pytest.mark.parametrize("family_id", IDS)
def test_the_rollout_engine_samples_as_generate(models, family_id, shared, monkeypatch):
    """Greedy rollouts of 2 prompts × 2 rows give ``generate``'s tokens, with the prompts' KV held once
    where the engine can (DeepSeek-V3's latent cache is not keys and values: it keeps the repeated
    cache; the shared one used to crash) or repeated."""
    monkeypatch.setattr(generation, "SHARE_FROM", 0 if shared else 10**9)
    model = fastalign.patch_model(models(family_id)).eval()
    ids = padded_batch()["input_ids"][:2, :8]
    mask = torch.ones_like(ids)
    options = dict(do_sample=False, max_new_tokens=6, eos_token_id=1, pad_token_id=0)
    expected = model.generate(
        input_ids=ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0), **options
    )
    assert torch.equal(generation.sample_groups(model, ids, mask, 2, options), expected)


# ---------------------------------------------------------------------------------------------------
# Training: transformers' Trainer on the patched model.


def test_transformers_trainer_losses_match_with_the_aux_loss(models, tmp_path, monkeypatch):
    """``tests/patching/test_trainer.py``'s run (4 steps of 2 accumulated micro-batches) on Mixtral with
    ``output_router_logits``: the patched model logs the original's losses, aux loss included. (The
    eager expert loop: torch's CPU grouped_mm is slow, and the tests above cover both paths.)"""
    model = models("mixtral")
    model.config.output_router_logits = True
    model.set_experts_implementation("eager")
    monkeypatch.setattr(trainer_runs, "tiny_model", lambda *args, **kwargs: copy.deepcopy(model))
    original = trainer_runs._train(False, tmp_path / "original")
    patched = trainer_runs._train(True, tmp_path / "patched")
    assert len(original) == 4
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(original), rtol=1e-4, atol=1e-4)
