"""``patch_model`` on a peft LoRA model: each LoRA linear adds its update into the base output in place
(``fastalign.patching.lora``), with peft's values and gradients, and peft's own forward wherever the
plain case does not hold."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import fastalign
from fastalign.builtin import tiny_model
from fastalign.patching import patched_pieces, unpatch_model


def lora_model(seed: int = 0, **options) -> peft.PeftModel:
    model = tiny_model("llama", seed=seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, **options)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # lora_B starts at zero: make the update matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_lora_layers_equal_peft(dtype):
    original = lora_model().to(dtype)
    patched = fastalign.patch_model(copy.deepcopy(original), backend="torch")
    assert patched_pieces(patched)["lora"] == 7 * 2  # q k v o gate up down, two layers
    batch = torch.randint(3, 500, (2, 13))
    expected, expected_grads = loss_and_grads(original, batch)
    got, grads = loss_and_grads(patched, batch)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert grads.keys() == expected_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp_min(1e-6)
        assert (grad - expected_grads[name]).abs().max() / scale < 10 * tolerance, name
    unpatch_model(patched)
    assert "lora" not in patched_pieces(patched)


def test_outside_the_plain_case_peft_runs_its_own_forward():
    model = fastalign.patch_model(lora_model(), backend="torch")
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, layer.in_features)
    with model.disable_adapter():  # adapters off: the base layer alone
        torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)
    plain = layer(x)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules="all-linear"))
    layer.set_adapter(["default", "second"])  # two active adapters: peft's loop
    assert torch.equal(layer(x), type(layer).forward(layer, x))
    layer.set_adapter("default")
    layer.merge()
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)  # merged: the base layer
    layer.unmerge()  # the base weight back up to the rounding of adding and subtracting B·A
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-6)


def test_dora_and_lora_bias_keep_pefts_forward():
    for options in ({"use_dora": True}, {"lora_bias": True}):
        model = fastalign.patch_model(lora_model(**options), backend="torch")
        layer = model.base_model.model.model.layers[0].mlp.up_proj
        x = torch.randn(3, layer.in_features)
        assert torch.equal(layer(x), type(layer).forward(layer, x)), options
