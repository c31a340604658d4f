"""The shared fixture of the TRL parity tests: a tiny policy and a reference that differs from it."""

from __future__ import annotations

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[str, str]:
    """A tiny Llama (policy) and a perturbed copy of it (reference), saved with the tokenizer."""
    return save_models(tmp_path_factory.mktemp("parity-models"), tiny_tokenizer)


def save_models(root, tokenizer) -> tuple[str, str]:
    """``models``' pair saved in ``root`` with the tokenizer ``tokenizer()`` makes."""
    torch.manual_seed(0)
    policy = tiny_model("llama")
    policy.save_pretrained(root / "policy")
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    policy.save_pretrained(root / "reference")
    for name in ("policy", "reference"):
        tokenizer().save_pretrained(root / name)
    return str(root / "policy"), str(root / "reference")
