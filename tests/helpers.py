"""Helpers shared by the tests: the kernel tests' assertions (numerics per ../shared/KERNELS.md),
optional packages, batches moved to a device."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
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


def require(package: str) -> ModuleType:
    """``package`` (a module name) imported, for tests that need a package fastalign itself does not
    (trl, the parity oracle; bitsandbytes, which quantizes): the dev extra installs them. Where one is
    missing, the test (or, called at import, the module) skips saying so; on CI (``CI`` set), where the
    dev extra is installed, a missing package fails instead, so a broken install never passes as skips."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        if os.environ.get("CI"):
            pytest.fail(f"{package} must be installed on CI (the dev extra): {error}", pytrace=False)
        pytest.skip(f"needs {package}, not installed here ({error})", allow_module_level=True)


def to_device(value, device: torch.device):
    """A batch's value on ``device``: tensors moved, anything else (``use_cache=False``) as it is."""
    return value.to(device) if isinstance(value, torch.Tensor) else value
