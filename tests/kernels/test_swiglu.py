"""fastalign.ops.swiglu / geglu, both backends, against float64."""

from __future__ import annotations

import math

import pytest
import torch

from fastalign.ops import geglu, swiglu
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference


def _reference(gate, up, gelu):
    if gelu:
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + torch.tanh(inner)) * up
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_and_backward_match_float64(backend, dtype, gelu):
    gate = (torch.randn(3, 5, 37, device=DEVICE) * 3).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 37, device=DEVICE).to(dtype).requires_grad_()
    out = (geglu if gelu else swiglu)(gate, up, backend=backend)
    assert out.dtype == dtype
    gate64, up64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = _reference(gate64, up64, gelu)
    assert_close_to_reference("out", out.detach(), ref.detach(), dtype)
    upstream = torch.randn(out.shape, device=DEVICE)
    (out.float() * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert_close_to_reference("grad gate", gate.grad, gate64.grad, dtype)
    assert_close_to_reference("grad up", up.grad, up64.grad, dtype)


def test_extreme_gate_values_stay_finite(backend):
    gate = torch.tensor([-1e4, -80.0, 0.0, 80.0, 1e4], device=DEVICE).requires_grad_()
    up = torch.ones(5, device=DEVICE).requires_grad_()
    for fn in (swiglu, geglu):
        out = fn(gate, up, backend=backend)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(gate.grad).all()
        gate.grad = up.grad = None


def test_mismatched_inputs():
    with pytest.raises(ValueError, match="gate and up must match"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
