"""Which implementation a public op runs: ``backend='auto'|'triton'|'torch'``."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors (``TRITON_INTERPRET=1`` set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def check_triton_interpreter() -> None:
    """Refuses the one known-broken pairing of the interpreter: Triton before 3.7 turns a runtime scalar
    into a Python int with ``int(array)``, which NumPy 2.4 made an error (triton-lang/triton#9171), so
    every kernel with a loop over a runtime bound failed deep inside the interpreter with "only
    0-dimensional arrays can be converted to Python scalars". Compiled kernels (CUDA) are unaffected."""
    import numpy
    import triton

    if _major_minor(triton.__version__) < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        raise RuntimeError(
            f"the Triton interpreter of triton {triton.__version__} fails on numpy {numpy.__version__} "
            "(triton-lang/triton#9171): install numpy<2.4 or triton>=3.7"
        )


def resolve_backend(backend: str, tensor: torch.Tensor) -> Literal["triton", "torch"]:
    """'auto' is Triton on CUDA tensors and PyTorch elsewhere; an impossible request is a ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        return "triton" if tensor.is_cuda and has_triton else "torch"
    if backend == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs the triton package, which is not installed")
        if not tensor.is_cuda and not triton_interpreter_enabled():
            raise ValueError(
                f"backend='triton' got tensors on {tensor.device}: Triton runs on CUDA, or on CPU under "
                "the interpreter (set TRITON_INTERPRET=1 before fastalign is imported)"
            )
        if not tensor.is_cuda:
            check_triton_interpreter()
    return backend  # type: ignore[return-value]
