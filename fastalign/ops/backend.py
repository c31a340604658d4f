"""Which implementation a public op runs: ``backend='auto'|'triton'|'torch'``."""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors (``TRITON_INTERPRET=1`` set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
    return backend  # type: ignore[return-value]
