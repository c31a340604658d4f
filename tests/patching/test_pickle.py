"""A patched model pickles and loads patched (``fastalign.patching.bound``): the same pieces, the same
loss and gradients, ``unpatch_model`` and a second ``patch_model`` working on the loaded copy. Before,
it failed to load (a bound method pickles as ``getattr(module, its name)``) or, with ``linear=False``,
loaded silently unpatched."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_model
from fastalign.patching import patched_pieces
from tests.helpers import require

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=128, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def from_config(model_type: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **(TINY | changes))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


MODELS = {
    # every piece: norms, MLPs, RoPE, each nn.Linear, the fused head
    "llama": lambda: tiny_model("llama", vocab_size=128),
    "gemma": lambda: tiny_model("gemma", vocab_size=128),  # gemma norms, GeGLU, tied head
    "phi3": lambda: tiny_model("phi3", vocab_size=128),  # fused gate_up MLP, partial RoPE
    # the experts' ``_apply_gate`` and a head with the router's loss
    "qwen3_moe": lambda: from_config(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True
    ),
    "granite": lambda: from_config("granite", logits_scaling=4.0),  # a head with a logit scale
}


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def round_trip(model):
    return pickle.loads(pickle.dumps(model))


def assert_same(model, loaded) -> None:
    assert patched_pieces(loaded) == patched_pieces(model)
    (loss, grads), (loaded_loss, loaded_grads) = loss_and_grads(model), loss_and_grads(loaded)
    assert torch.equal(loaded_loss, loss)
    assert len(loaded_grads) == len(grads) and all(map(torch.equal, loaded_grads, grads))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("options", [{}, {"linear": False}], ids=["all", "linear-off"])
def test_a_pickled_patched_model_loads_patched(name, options):
    model = MODELS[name]()
    original = copy.deepcopy(model)
    fastalign.patch_model(model, **options)
    loaded = round_trip(model)
    assert_same(model, loaded)
    assert patched_pieces(loaded).get("loss") == 1  # the fused head, not logits built again
    assert "linear" not in patched_pieces(loaded) or not options
    # the loaded copy is an ordinary patched model: it unpatches to the original and patches again
    fastalign.unpatch_model(loaded)
    assert not patched_pieces(loaded)
    assert not any("forward" in module.__dict__ for module in loaded.modules())
    assert torch.equal(loss_and_grads(loaded)[0], loss_and_grads(original)[0])
    fastalign.patch_model(loaded, **options)
    assert patched_pieces(loaded) == patched_pieces(model)


def test_torch_save_of_a_whole_patched_model_loads_patched():
    model = fastalign.patch_model(MODELS["llama"]())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert_same(model, torch.load(buffer, weights_only=False))


def test_a_pickled_peft_model_keeps_its_patched_lora_layers():
    require("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(MODELS["llama"](), LoraConfig(r=4, target_modules="all-linear"))
    fastalign.patch_model(model)
    assert patched_pieces(model)["lora"] > 0
    assert_same(model, round_trip(model))


def test_a_generic_patch_pickles():
    model = from_config("llama")
    model.config.model_type = "fastalign_unknown"  # a family the table does not know: the probe's patch
    fastalign.patch_model(model, generic=True)
    assert patched_pieces(model)
    assert_same(model, round_trip(model))


def test_the_patched_forward_is_still_a_method_to_transformers():
    """``generate`` and ``Trainer`` read the forward's parameters (``inspect.signature``); a deep copy
    binds the copy (TRL's reference model is one)."""
    model = fastalign.patch_model(MODELS["llama"]())
    parameters = list(inspect.signature(model.forward).parameters)
    assert parameters == list(inspect.signature(model.forward.__func__).parameters)[1:]  # less self
    assert "labels" in parameters and "logits_to_keep" in parameters
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and twin.model.norm.forward.__self__ is twin.model.norm
    assert_same(model, twin)
    prompt = torch.tensor([[1, 5, 9]])
    assert torch.equal(
        model.generate(prompt, max_new_tokens=4, do_sample=False),
        twin.generate(prompt, max_new_tokens=4, do_sample=False),
    )
