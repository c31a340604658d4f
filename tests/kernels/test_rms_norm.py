"""fastalign.ops.rms_norm, both backends, against float64 (Llama and Gemma casting)."""

from __future__ import annotations

import pytest
import torch

from fastalign.ops import rms_norm
from fastalign.ops.rms_norm import rms_norm_reference
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference

EPS = 1e-6


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 7, 37), (45, 8)], ids=["odd", "many-rows"])
def test_forward_and_backward_match_float64(backend, dtype, gemma, shape):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    weight = (
        (torch.randn(shape[-1], device=DEVICE) * 0.2 + (0.0 if gemma else 1.0)).to(dtype).requires_grad_()
    )
    y = rms_norm(x, weight, EPS, gemma=gemma, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape

    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    x_hat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    ref = x_hat * (1 + w64) if gemma else x_hat * w64
    assert_close_to_reference("y", y.detach(), ref.detach(), dtype)

    upstream = torch.randn(shape, device=DEVICE)
    (y.float() * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert_close_to_reference("grad x", x.grad, x64.grad, dtype)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, dtype)
    assert weight.grad.dtype == weight.dtype


def test_mixed_dtypes_follow_hugging_face(backend):
    """Llama casting with a bf16 input and an fp32 weight returns fp32, as transformers does."""
    x = torch.randn(5, 24, device=DEVICE).bfloat16()
    weight = torch.randn(24, device=DEVICE)
    y = rms_norm(x, weight, EPS, backend=backend)
    ref = rms_norm_reference(x, weight, EPS)
    assert y.dtype == ref.dtype == torch.float32
    # x̂ is rounded to bf16 before the fp32 weight multiplies it: allow that one bf16 ulp (the
    # interpreter rounds toward zero where PyTorch rounds to nearest).
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-5)
    gemma = rms_norm(x, weight, EPS, gemma=True, backend=backend)
    assert gemma.dtype == torch.bfloat16


def test_bad_weight_shape():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(torch.randn(3, 8), torch.ones(7))
