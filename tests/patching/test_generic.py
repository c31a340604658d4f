"""``patch_model(model, generic=True)`` on families that are not in the table: what the probe keeps equals
the original model (loss, every gradient, per-token log-probs, greedy decoding), and what it cannot prove
equal (BitNet's sub-normed relu² MLP, a norm or a head computing something else) stays as it was and is
reported.

The models are built as tests/patching/test_published_configs.py builds its families (its ``Published``,
``read_config`` and ``build``): the published config.json, sizes shrunk.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import fastalign
from fastalign.builtin import tiny_model
from fastalign.patching import patched_pieces, shift_labels, unpatch_model
from fastalign.patching.families import FAMILIES
from fastalign.patching.generic import generic_report
from tests.helpers import relative_error
from tests.patching.test_published_configs import (
    TOLERANCE,
    Published,
    assert_same_gradients,
    build,
    packed_row,
    read_config,
)

# fmt: off
GENERIC = [
    Published(
        "ministral3",
        "mistralai/Ministral-3-8B-Base-2512",
        # its text_config (transformers' Ministral3Config defaults are this checkpoint's); published sizes:
        # hidden 4096 (32 heads of 128, 8 KV heads), intermediate 14336, 34 layers, vocab 131072
        {
            "architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3", "attention_dropout": 0.0,
            "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                "original_max_position_embeddings": 16384, "max_position_embeddings": 262144,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
            "sliding_window": None, "tie_word_embeddings": False,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1,
        },
        # Llama-4's attention scale 1 + β·log(1 + ⌊position / original_max_position_embeddings⌋) starts at
        # position 16384: the fast tests switch at 16 (yarn's factor 16 kept: max positions 256).
        fast={
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                "original_max_position_embeddings": 16, "max_position_embeddings": 256,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
            "max_position_embeddings": 256,
        },
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
    Published(
        "bitnet",
        "microsoft/bitnet-b1.58-2B-4T",
        # published sizes: hidden 2560 (20 heads of 128, 5 KV heads), intermediate 6912, 30 layers, vocab
        # 128256; here 2 heads of 128 (its attention sub-norm needs heads × head_dim = hidden) and 1 KV
        # head. Its quantization_config (packed ternary weights) left out: fine-tuning starts from the
        # bf16 master weights (microsoft/bitnet-b1.58-2B-4T-bf16).
        {
            "architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "relu2", "initializer_range": 0.02,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1,
        },
        scale={"q_proj.weight": 3.0, "k_proj.weight": 3.0},
    ),
]
# fmt: on
BY_ID = {family.id: family for family in GENERIC}
IDS = list(BY_ID)

#: What the probe patches in each: BitNet's MLP is relu² with an RMSNorm before down_proj (no fused kernel
#: computes it); its attention's sub-norm is one more RMSNorm per layer.
EXPECTED_PIECES = {
    "ministral3": {"rms_norm": 5, "mlp": 2, "rope": 2, "loss": 1},
    "bitnet": {"rms_norm": 9, "rope": 2, "loss": 1},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family id → a copy of its random fp32 model, each built once."""
    built: dict[str, torch.nn.Module] = {}

    def get(family_id: str) -> torch.nn.Module:
        if family_id not in built:
            family = BY_ID[family_id]
            built[family_id] = build(family, read_config(family, tmp_path_factory.mktemp(family_id)))
        return copy.deepcopy(built[family_id])

    return get


def crossing_row() -> dict[str, torch.Tensor]:
    """Two packed sequences, the first past Ministral-3's (shrunk) Llama-4 attention-scale switch."""
    return packed_row([24, 8])


def assert_same_loss_and_gradients(original, patched) -> CausalLMOutputWithPast:
    """``patched``'s loss and every parameter's gradient on ``crossing_row`` equal ``original``'s;
    returns ``patched``'s output."""
    batch = crossing_row()
    expected, got = original(**batch), patched(**batch)
    assert relative_error(got.loss, expected.loss) <= TOLERANCE
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched)
    return got


def test_the_families_are_not_in_the_table(models):
    assert not set(IDS) & set(FAMILIES)
    with pytest.raises(ValueError, match=r"supported: .*generic=True"):
        fastalign.patch_model(models("ministral3"))


@pytest.mark.parametrize("family_id", IDS)
def test_generic_patch_keeps_loss_and_every_gradient(models, family_id, caplog):
    original = models(family_id).train()
    patched = copy.deepcopy(original)
    state = {name: tensor.clone() for name, tensor in patched.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="fastalign.patching.patch"):
        fastalign.patch_model(patched, generic=True)
    assert patched_pieces(patched) == EXPECTED_PIECES[family_id]
    assert f"generic patch of {family_id!r}" in caplog.text
    # the probe left the model as it was: weights, modes, no gradients
    assert all(torch.equal(tensor, state[name]) for name, tensor in patched.state_dict().items())
    assert all(module.training for module in patched.modules())
    assert all(param.grad is None for param in patched.parameters())

    assert assert_same_loss_and_gradients(original, patched).logits is None  # the fused head


@torch.no_grad()
@pytest.mark.parametrize("family_id", IDS)
def test_generic_patch_logprobs_and_greedy_generation(models, family_id):
    original = models(family_id)
    patched = fastalign.patch_model(copy.deepcopy(original), generic=True)
    batch = crossing_row()
    targets = shift_labels(batch.pop("labels"))
    logits = original(**batch).logits
    expected = (logits / 0.7).log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    out = patched(**batch, logprob_targets=targets, temperature=0.7)
    torch.testing.assert_close(out.token_logprobs, expected * (targets != -100), rtol=1e-5, atol=1e-5)

    prompt = {"input_ids": batch["input_ids"][:, :6]}
    generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**prompt, **generate), original.generate(**prompt, **generate))


def test_the_report_says_what_was_patched_and_why_not_the_rest(models):
    report = generic_report(models("bitnet"))
    assert report.model_type == "bitnet"
    assert report.patched == {
        "rope BitNetAttention": "2 modules: rotate-half RoPE",
        "rms_norm BitNetRMSNorm": "9 modules: llama convention",
        "loss BitNetForCausalLM": "lm_head(hidden)",
    }
    assert report.unpatched == {"mlp BitNetMLP": "2 modules: not down(act(gate)·up) with SiLU or tanh-GeLU"}

    report = generic_report(models("ministral3"), mlp=False, loss=False)  # the pieces asked for only
    assert set(report.patched) == {"rope Ministral3Attention", "rms_norm Ministral3RMSNorm"}
    assert report.unpatched == {}


class _EpsOutsideRMSNorm(torch.nn.Module):
    """x / (rms(x) + eps) · w: not an RMSNorm the kernel computes (shows only where rms(x)² ~ eps)."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon)).type_as(
            hidden_states
        )


class _Fp32ProductRMSNorm(torch.nn.Module):
    """cast(w · x̂) as OLMo-2 computes it: the llama convention in fp32, one rounding fewer in bf16."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x_hat).to(hidden_states.dtype)


@pytest.mark.parametrize(
    ("forward", "why"),
    [
        (_EpsOutsideRMSNorm.forward, "computes neither w·x̂ nor (1+w)·x̂"),
        (_Fp32ProductRMSNorm.forward, "computes the llama convention but rounds it otherwise in bf16"),
    ],
    ids=["eps-outside", "fp32-product"],
)
def test_a_norm_computing_otherwise_is_left_and_reported(models, forward, why, caplog):
    original = models("ministral3")
    norm = original.model.layers[0].input_layernorm
    # a test-local subclass of the model's RMSNorm class with another forward, on one module
    norm.__class__ = type("OtherRMSNorm", (type(norm),), {"forward": forward})
    with caplog.at_level(logging.INFO, logger="fastalign.patching.patch"):
        patched = fastalign.patch_model(copy.deepcopy(original), generic=True)
    assert patched_pieces(patched) == {"rms_norm": 4, "mlp": 2, "rope": 2, "loss": 1}
    assert "forward" not in patched.model.layers[0].input_layernorm.__dict__
    assert caplog.text.rstrip().endswith(f"; kept rms_norm OtherRMSNorm (1 module: {why})")

    assert_same_loss_and_gradients(original, patched)


def test_a_head_computing_otherwise_is_left_and_reported(models, caplog):
    """A causal LM that scales its logits by a constant of its own: the fused head cannot know it."""
    original = models("ministral3")

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = type(self).__mro__[1].forward(self, input_ids=input_ids, **kwargs).logits * 3.0
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    original.__class__ = type("TripledLogitsForCausalLM", (type(original),), {"forward": forward})
    with caplog.at_level(logging.INFO, logger="fastalign.patching.patch"):
        patched = fastalign.patch_model(copy.deepcopy(original), generic=True)
    assert patched_pieces(patched) == {"rms_norm": 5, "mlp": 2, "rope": 2}
    why = "its logits are not lm_head(hidden) times a config scale, then softcapped"
    assert caplog.text.rstrip().endswith(f"; kept loss TripledLogitsForCausalLM ({why})")
    batch = crossing_row()
    torch.testing.assert_close(patched(**batch).loss, original(**batch).loss, rtol=1e-5, atol=1e-5)


def test_the_logit_scale_is_found_by_probing(tmp_path, caplog):
    """HyperCLOVA X multiplies its logits by ``logits_scaling`` where Granite divides by it: the probe
    takes the one that reproduces the logits. (transformers' HyperCLOVAXConfig defaults, not a published
    config, sizes shrunk, with a logits_scaling of 0.25 so that it matters.)"""
    shrunk = {
        "model_type": "hyperclovax", "logits_scaling": 0.25, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    }  # fmt: skip
    family = Published("hyperclovax", "naver-hyperclovax/HyperCLOVAX-SEED-Think-14B", shrunk)
    original = build(family, read_config(family, tmp_path))
    with caplog.at_level(logging.INFO, logger="fastalign.patching.patch"):
        patched = fastalign.patch_model(copy.deepcopy(original), generic=True)
    assert patched_pieces(patched) == {"rms_norm": 9, "mlp": 2, "rope": 2, "loss": 1}  # 4 norms a layer
    assert "loss HyperCLOVAXForCausalLM (lm_head(hidden)·logits_scaling)" in caplog.text
    assert_same_loss_and_gradients(original, patched)


def test_generic_uses_the_table_for_a_supported_family(caplog):
    with caplog.at_level(logging.INFO, logger="fastalign.patching.patch"):
        patched = fastalign.patch_model(tiny_model("llama"), generic=True)
    assert patched_pieces(patched) == patched_pieces(fastalign.patch_model(tiny_model("llama")))
    assert "generic patch" not in caplog.text


def test_weights_on_the_meta_device_patch_nothing(models):
    config = models("ministral3").config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    assert patched_pieces(fastalign.patch_model(skeleton, generic=True)) == {}
    assert "meta device" in generic_report(skeleton).unpatched["probe"]


def test_unpatch_restores_the_generic_patch(models):
    model = models("bitnet")
    batch = crossing_row()
    before = model(**batch).logits
    unpatch_model(fastalign.patch_model(model, generic=True))
    assert patched_pieces(model) == {}
    assert all("forward" not in module.__dict__ for module in model.modules())
    torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)


def test_a_probe_that_fails_patches_nothing(models):
    original = models("ministral3")

    def forward(self, *args, **kwargs):
        raise RuntimeError("this head runs only on its own hardware")

    original.__class__ = type("OddForCausalLM", (type(original),), {"forward": forward})
    assert patched_pieces(fastalign.patch_model(original, generic=True)) == {}
    assert generic_report(original).unpatched == {
        "probe": "the probe failed (RuntimeError: this head runs only on its own hardware)"
    }


@pytest.mark.parametrize("model_type", ["olmoe", "granitemoe", "phimoe"])
def test_router_aux_loss_asked_for_at_call_time_is_in_the_loss(model_type):
    """A mixture of experts the table does not hold, given ``output_router_logits=True`` in the call:
    the loss includes the router's load-balancing loss, as the original's (the generic head does not
    know it: that call runs the original forward)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts=4,
        num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.5, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config).eval()
    patched = fastalign.patch_model(copy.deepcopy(original), generic=True)
    assert "loss" in patched_pieces(patched)
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        expected = original(input_ids=ids, labels=ids, output_router_logits=True)
    except AttributeError as error:  # transformers 5.17's granitemoe: its aux loss is an int 0 here
        pytest.skip(f"transformers {transformers.__version__}'s own {model_type} forward fails: {error}")
    got = patched(input_ids=ids, labels=ids, output_router_logits=True)
    assert expected.aux_loss is not None and got.aux_loss is not None
    assert relative_error(got.loss, expected.loss) <= 1e-5
    assert (
        relative_error(patched(input_ids=ids, labels=ids).loss, original(input_ids=ids, labels=ids).loss)
        <= 1e-5
    )
