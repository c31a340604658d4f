"""The shared fixture of the TRL parity tests: a tiny policy and a reference that differs from it."""

from __future__ import annotations

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama (policy) and a perturbed copy of it (reference), saved with the tokenizer."""
    return save_models(tmp_path_factory.mktemp("parity-models"), tiny_tokenizer)


@pytest.fixture(scope="session")
def softcap_models(tmp_path_factory) -> tuple[str, str]:
    """``models``' pair as a tiny Gemma-2 whose final-logit softcap, 0.2, bends its logits (a random tiny
    model's head gives logits of a few tenths): 0.2·tanh(lm_head(hidden)/0.2)."""
    root = tmp_path_factory.mktemp("parity-softcap-models")
    return save_models(root, tiny_tokenizer, "gemma2", final_logit_softcapping=0.2)


def save_models(root, tokenizer, model_type: str = "llama", **overrides) -> tuple[str, str]:
    """``models``' pair saved in ``root`` with the tokenizer ``tokenizer()`` makes (a tiny ``model_type``
    with the config ``overrides``)."""
    torch.manual_seed(0)
    policy = tiny_model(model_type, **overrides)
    policy.save_pretrained(root / "policy")
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    policy.save_pretrained(root / "reference")
    for name in ("policy", "reference"):
        tokenizer().save_pretrained(root / name)
    return str(root / "policy"), str(root / "reference")
