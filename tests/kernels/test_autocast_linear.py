"""``autocast_linear``: autocast's linear layer, bit for bit, without a low-precision weight copy saved
for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from fastalign.ops.autocast_linear import autocast_linear


def _run(linear, x, weight, bias, dtype):
    """Output and gradients of ``linear`` under ``dtype`` autocast, and the storages it saved."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    leaves = [
        t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None
        for t in (x, weight, bias)
    ]
    with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=dtype):
        out = linear(*leaves)
    out.float().square().sum().backward()
    grads = [leaf.grad if leaf is not None and leaf.requires_grad else None for leaf in leaves]
    return out, grads, saved, leaves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "frozen, bias_trained",
    [(False, True), (True, False), (True, True)],
    ids=["trained", "frozen", "bias-only"],
)
def test_same_numbers_as_autocast_and_no_weight_copy_saved(dtype, with_bias, frozen, bias_trained):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 40, generator=generator).requires_grad_()
    weight = torch.randn(24, 40, generator=generator).requires_grad_(not frozen)
    bias = torch.randn(24, generator=generator).requires_grad_(bias_trained) if with_bias else None
    out, grads, saved, leaves = _run(autocast_linear, x, weight, bias, dtype)
    ref_out, ref_grads, ref_saved, _ = _run(F.linear, x, weight, bias, dtype)
    assert out.dtype == dtype and torch.equal(out, ref_out)
    for got, expected in zip(grads, ref_grads, strict=True):
        assert (got is None) == (expected is None)
        if got is not None:
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # autocast saves a low-precision copy of the weight (as its [40, 24] transpose); here the weight
    # itself is saved
    assert any(t.numel() == weight.numel() and t.dtype == dtype for t in ref_saved)
    assert not any(t.numel() == weight.numel() and t.dtype == dtype for t in saved)
    assert any(t is leaves[1] or t.untyped_storage().data_ptr() == leaves[1].data_ptr() for t in saved)
    # the input's cast feeds only the weight's gradient: like autocast, a frozen weight (LoRA's base
    # layer) keeps none
    keeps_input = [any(t.numel() == x.numel() for t in tensors) for tensors in (saved, ref_saved)]
    assert keeps_input == [not frozen, not frozen]


def test_outside_autocast_and_without_gradients_it_is_f_linear():
    x, weight = torch.randn(5, 8), torch.randn(3, 8, requires_grad=True)
    assert torch.equal(autocast_linear(x, weight), F.linear(x, weight))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = autocast_linear(x, weight)
    assert got.dtype == torch.bfloat16 and got.grad_fn is None


def test_projections_of_one_input_share_its_cast():
    """q, k and v of one normalized tensor: autocast's numbers, one low-precision copy of the input saved
    (autocast saves three); a tensor modified in place between calls is cast again."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 40, generator=generator).requires_grad_()
    weights = [torch.randn(24, 40, generator=generator).requires_grad_() for _ in range(3)]

    def projections(linear):
        leaves = [t.detach().clone().requires_grad_() for t in (x, *weights)]
        saved = []

        def pack(tensor):
            saved.append(tensor)
            return tensor

        with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            normed = leaves[0] * 2
            outs = [linear(normed, weight) for weight in leaves[1:]]
        sum(out.float().square().sum() for out in outs).backward()
        copies = {
            t.untyped_storage().data_ptr()
            for t in saved
            if t.dtype == torch.bfloat16 and t.numel() == x.numel()
        }
        return outs, [leaf.grad for leaf in leaves], len(copies)

    outs, grads, copies = projections(autocast_linear)
    ref_outs, ref_grads, ref_copies = projections(F.linear)
    for got, expected in zip(outs + grads, ref_outs + ref_grads, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert (copies, ref_copies) == (1, 3)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        normed = x.detach().clone()
        first = autocast_linear(normed, weights[0])
        normed.mul_(3)  # a new version: not the tensor the first call cast
        second = autocast_linear(normed, weights[0])
    assert torch.equal(second, F.linear(normed.bfloat16(), weights[0].bfloat16()))
    assert not torch.equal(first, second)
