"""fp32 GEMMs for bf16/fp16 on a CPU without low-precision matrix units (``fastalign.ops.cpu_gemm``):
the same numbers as the native low-precision ops (up to the order of the fp32 sums), in every form the
training step issues them, and nothing else touched."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import fastalign.ops.cpu_gemm as cpu_gemm
from fastalign.ops.cpu_gemm import Fp32CpuGemms, cpu_gemms


def _operands(dtype, *shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]


def _assert_one_rounding(out, native, exact, dtype):
    """``out`` is ``exact`` rounded once to ``dtype``: within half a unit in the last place of it, and
    within one unit of the native op's result (whose fp32 sums run in another order)."""
    assert out.dtype == native.dtype == dtype
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.double() - exact).abs() <= 0.5 * ulp * 1.01 + 1e-6).all()
    assert ((out.double() - native.double()).abs() <= 2 * ulp + 1e-6).all()


CASES = {
    "mm": (lambda a, b, c: torch.mm(a, b), [(37, 129), (129, 23), (37, 23)]),
    "mm transposed": (lambda a, b, c: torch.mm(b.t(), a.t()), [(37, 129), (129, 23), (37, 23)]),
    "addmm": (lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(37, 129), (129, 23), (37, 23)]),
    "bmm": (lambda a, b, c: torch.bmm(a, b), [(3, 17, 65), (3, 65, 9), (3, 17, 9)]),
    "baddbmm": (lambda a, b, c: torch.baddbmm(c, a, b), [(3, 17, 65), (3, 65, 9), (3, 17, 9)]),
    "linear 3-d": (lambda a, b, c: F.linear(a, b.t()), [(2, 17, 65), (65, 9), (9,)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gemms_are_the_exact_product_rounded_once(case, dtype):
    op, shapes = CASES[case]
    a, b, c = _operands(dtype, *shapes)
    native = op(a, b, c)
    exact = op(a.double(), b.double(), c.double())
    with Fp32CpuGemms() as mode:
        out = op(a, b, c)
    assert mode.count >= 1
    _assert_one_rounding(out, native, exact, dtype)


def test_out_and_in_place_forms_write_their_target():
    a, b, c = _operands(torch.bfloat16, (33, 70), (70, 21), (33, 21))
    exact = a.double() @ b.double()
    out = torch.empty(40, 21, dtype=torch.bfloat16)
    with Fp32CpuGemms() as mode:
        written = torch.mm(a, b, out=out[:33])  # a view, as the fused heads write a chunk's rows
        accumulated = c.clone()
        returned = accumulated.addmm_(a, b)
    assert mode.count == 2
    assert written.data_ptr() == out.data_ptr() and returned is accumulated
    _assert_one_rounding(out[:33], a @ b, exact, torch.bfloat16)
    _assert_one_rounding(accumulated, c.clone().addmm_(a, b), exact + c.double(), torch.bfloat16)


def test_other_ops_and_dtypes_run_as_without_the_mode():
    a, b = _operands(torch.float32, (19, 40), (40, 7))
    low = a.bfloat16()
    acc = torch.zeros(19, 7)
    with Fp32CpuGemms() as mode:
        fp32 = a @ b
        mixed = acc.clone().addmm_(low.float(), b)  # fp32 operands: untouched
        elementwise = low * 3
    assert mode.count == 0
    assert torch.equal(fp32, a @ b) and torch.equal(mixed, acc.clone().addmm_(low.float(), b))
    assert torch.equal(elementwise, low * 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_backward_matches_a_float64_reference(dtype):
    q, k, v = _operands(dtype, (2, 6, 33, 16), (2, 2, 33, 16), (2, 2, 33, 16))
    grad = _operands(dtype, (2, 6, 33, 16), seed=1)[0]

    def grads(precision, mode=None):
        leaves = [t.detach().to(precision).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        if mode is None:
            out.backward(grad.to(precision))
        else:
            with mode:
                out.backward(grad.to(precision))
        return [leaf.grad for leaf in leaves]

    mode = Fp32CpuGemms()
    widened, native, exact = grads(dtype, mode), grads(dtype), grads(torch.float64)
    assert mode.count == 1
    for ours, theirs, reference in zip(widened, native, exact, strict=True):
        assert ours.dtype == dtype
        # the native backward's error is the bar: widening must not be worse
        error, bar = ((grad.double() - reference).abs().max() for grad in (ours, theirs))
        assert error <= bar + 1e-3 * reference.abs().max()


def test_backward_pass_of_a_model_under_autocast_goes_through_the_mode():
    """A linear stack under bf16 autocast: the backward's GEMMs (input and weight gradients) are
    widened too, and the loss and gradients agree with the native bf16 ones to bf16 precision."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    x = torch.randn(5, 7, 48)

    def run(forward_mode, backward_mode):
        model.zero_grad()
        with forward_mode, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        with backward_mode:
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    forward_mode, backward_mode = Fp32CpuGemms(), Fp32CpuGemms()
    widened_loss, widened = run(forward_mode, backward_mode)
    native_loss, native = run(contextlib.nullcontext(), contextlib.nullcontext())
    assert forward_mode.count == 2  # one per layer
    assert backward_mode.count == 3  # the second layer's input and weight gradients, the first's weight
    torch.testing.assert_close(widened_loss, native_loss, rtol=2e-2, atol=0)
    for ours, theirs in zip(widened, native, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=3e-2, atol=3e-2 * theirs.abs().max().item())


def test_cpu_gemms_only_where_the_native_ones_are_slow(monkeypatch):
    cpu = torch.device("cpu")
    for slow in (True, False):
        monkeypatch.setattr(cpu_gemm, "low_precision_gemm_is_slow", lambda dtype, slow=slow: slow)
        assert isinstance(cpu_gemms(cpu, torch.bfloat16), Fp32CpuGemms) == slow
        assert not isinstance(cpu_gemms(cpu, torch.float32), Fp32CpuGemms)
        assert not isinstance(cpu_gemms(cpu, None), Fp32CpuGemms)
        assert not isinstance(cpu_gemms(torch.device("cuda"), torch.bfloat16), Fp32CpuGemms)


def test_the_probe_measures_once_and_a_pin_overrides_it():
    cpu_gemm._measured_slow.cache_clear()
    first = cpu_gemm.low_precision_gemm_is_slow(torch.bfloat16)
    assert isinstance(first, bool)
    assert cpu_gemm.low_precision_gemm_is_slow(torch.bfloat16) is first
    assert cpu_gemm._measured_slow.cache_info().hits == 1
    cpu_gemm.pin_low_precision_gemm(torch.bfloat16, not first)  # cleared after the test (conftest)
    assert cpu_gemm.low_precision_gemm_is_slow(torch.bfloat16) is (not first)
    assert isinstance(cpu_gemms(torch.device("cpu"), torch.bfloat16), Fp32CpuGemms) is (not first)
