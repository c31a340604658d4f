"""fastalign.ops.swiglu / geglu, both backends, against float64."""

from __future__ import annotations

import math

import pytest
import torch

from fastalign.ops import geglu, glu_linear, swiglu
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


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_glu_linear_matches_float64(backend, dtype, gelu, bias):
    """The activation and down projection keeping only gate and up: value and every gradient."""
    gate = (torch.randn(3, 5, 37, device=DEVICE) * 3).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 37, device=DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(11, 37, device=DEVICE) / 6).to(dtype).requires_grad_()
    b = torch.randn(11, device=DEVICE).to(dtype).requires_grad_() if bias else None
    inputs = [t for t in (gate, up, weight, b) if t is not None]
    out = glu_linear(gate, up, weight, b, gelu=gelu, backend=backend)
    references = [t.detach().double().requires_grad_() for t in inputs]
    ref = torch.nn.functional.linear(_reference(*references[:2], gelu), *references[2:])
    assert out.dtype == dtype
    assert_close_to_reference("out", out.detach(), ref.detach(), dtype)
    upstream = torch.randn(out.shape, device=DEVICE)
    (out.float() * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    for name, got, expected in zip(("gate", "up", "weight", "bias"), inputs, references, strict=False):
        assert_close_to_reference(f"grad {name}", got.grad, expected.grad, dtype)


def test_glu_linear_frozen_weight_and_bad_inputs():
    gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    weight = torch.randn(3, 6)  # frozen (LoRA's base, say): no weight gradient is formed
    out = glu_linear(gate, up, weight, backend="torch")
    out.sum().backward()
    expected = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weight)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"weight must be \[out, 6\] in torch.float32, got \(3, 5\)"):
        glu_linear(gate, up, torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"bias must be \[3\] in torch.float32, got \(3,\) torch.bfloat16"):
        glu_linear(gate, up, weight, torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_glu_linear_under_autocast_is_autocasts_projection(backend, dtype, gelu, bias):
    """Under autocast (low-precision gate and up, fp32 weight): the values and gradients of the
    activation followed by autocast's ``F.linear``, bit for bit, without saving the projection's input
    or a low-precision copy of its weight."""
    device = DEVICE if DEVICE.type == "cuda" else torch.device("cpu")
    glu = geglu if gelu else swiglu
    gate32, up32 = torch.randn(3, 5, 37, device=device) * 3, torch.randn(3, 5, 37, device=device)
    weight32, bias32 = torch.randn(11, 37, device=device) / 6, torch.randn(11, device=device)

    def run(project):
        gate, up = (t.to(dtype).requires_grad_() for t in (gate32, up32))
        weight, b = weight32.clone().requires_grad_(), bias32.clone().requires_grad_() if bias else None
        saved = []

        def keep(tensor):
            saved.append(tensor)
            return tensor

        with (
            torch.autocast(device.type, dtype=dtype),
            torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        ):
            out = project(gate, up, weight, b)
        out.float().pow(2).sum().backward()
        grads = [t.grad for t in (gate, up, weight, b) if t is not None]
        return out, grads, saved

    out, grads, saved = run(lambda g, u, w, b: glu_linear(g, u, w, b, gelu=gelu, backend=backend))
    expected, expected_grads, expected_saved = run(
        lambda g, u, w, b: torch.nn.functional.linear(glu(g, u, backend=backend), w, b)
    )
    assert out.dtype == dtype and torch.equal(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not any(t.numel() == 11 * 37 and t.dtype == dtype for t in saved)  # no weight copy
    assert any(t.numel() == 11 * 37 and t.dtype == dtype for t in expected_saved)  # autocast's copy
    # the projection's input (the activation's output: gate and up are leaves) is recomputed, not saved
    projection_input = [
        any(t.numel() == 3 * 5 * 37 and t.grad_fn is not None for t in found)
        for found in (saved, expected_saved)
    ]
    assert projection_input == [False, True]
