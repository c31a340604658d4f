"""Assertions shared by the kernel tests (numerics per ../shared/KERNELS.md)."""

from __future__ import annotations

import torch

#: ‖out − ref‖ / ‖ref‖ bounds against a float64 reference, by input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    scale = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / scale if scale > 0 else diff


def assert_close_to_reference(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = relative_error(out, ref)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"
