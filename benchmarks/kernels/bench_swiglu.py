"""SwiGLU ``silu(gate) * up`` forward/backward vs eager PyTorch, torch.compile and Liger-Kernel.

    python benchmarks/kernels/bench_swiglu.py --preset gpu|cpu|quick
Floor: forward reads gate, up and writes h; backward reads gate, up, dh and writes dgate, dup.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bandwidth_suite import BandwidthBenchmark, matrix_passes, run
from fastalign.ops import swiglu
from fastalign.ops.swiglu import glu_reference


def make_inputs(size, dtype, device):
    tokens, intermediate = size
    gate = torch.randn(tokens, intermediate, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn(tokens, intermediate, device=device, dtype=dtype, requires_grad=True)
    return gate, up


def _liger(gate, up):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply(gate, up)


BENCH = BandwidthBenchmark(
    kernel="swiglu",
    shapes={
        "gpu": [(2048, 14336), (16384, 14336), (16384, 28672), (32768, 14336)],
        "cpu": [(2048, 2816), (4096, 2816)],
        "quick": [(256, 1024)],
    },
    make_inputs=make_inputs,
    bytes_moved=matrix_passes(3, 5),
    describe=lambda size: f"tokens={size[0]} intermediate={size[1]}",
    providers={
        "fastalign-triton": lambda gate, up: swiglu(gate, up, backend="triton"),
        "fastalign-torch": lambda gate, up: swiglu(gate, up, backend="torch"),
        "torch-eager": lambda gate, up: glu_reference(gate, up, gelu=False),
        "torch-compile": lambda gate, up: glu_reference(gate, up, gelu=False),
        "liger-kernel": _liger,
    },
    requires={"fastalign-triton": "cuda", "liger-kernel": "liger_kernel"},
)

if __name__ == "__main__":
    run(BENCH)
