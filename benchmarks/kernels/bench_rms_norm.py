"""RMSNorm forward/backward vs eager PyTorch (Hugging Face's arithmetic), torch.compile, Liger-Kernel.

    python benchmarks/kernels/bench_rms_norm.py --preset gpu|cpu|quick
Floor: forward reads x, writes y; backward reads x, dy, writes dx (the weight and rstd are negligible).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bandwidth_suite import BandwidthBenchmark, matrix_passes, run
from fastalign.ops import rms_norm
from fastalign.ops.rms_norm import rms_norm_reference

EPS = 1e-6


def make_inputs(size, dtype, device):
    tokens, hidden = size
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    return x, weight


def _liger(x, weight):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, weight, EPS)


BENCH = BandwidthBenchmark(
    kernel="rms_norm",
    shapes={
        "gpu": [(2048, 4096), (16384, 2048), (16384, 4096), (16384, 8192), (32768, 4096), (65536, 4096)],
        "cpu": [(2048, 1024), (4096, 2048)],
        "quick": [(256, 512)],
    },
    make_inputs=make_inputs,
    bytes_moved=matrix_passes(2, 3),
    describe=lambda size: f"tokens={size[0]} hidden={size[1]}",
    providers={
        "fastalign-triton": lambda x, w: rms_norm(x, w, EPS, backend="triton"),
        "fastalign-torch": lambda x, w: rms_norm(x, w, EPS, backend="torch"),
        "torch-eager": lambda x, w: rms_norm_reference(x, w, EPS),
        "torch-compile": lambda x, w: rms_norm_reference(x, w, EPS),
        "liger-kernel": _liger,
    },
    requires={"fastalign-triton": "cuda", "liger-kernel": "liger_kernel"},
)

if __name__ == "__main__":
    run(BENCH)
