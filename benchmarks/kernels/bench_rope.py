"""RoPE of q and k forward/backward vs eager PyTorch (Hugging Face's), torch.compile and Liger-Kernel.

    python benchmarks/kernels/bench_rope.py --preset gpu|cpu|quick
Shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head dim 128). Floor: forward reads q, k
and writes them rotated; backward reads and writes their gradients (cos/sin are shared by the heads and
left out).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bandwidth_suite import BandwidthBenchmark, run
from fastalign.ops import apply_rotary_pos_emb
from fastalign.ops.rope import rope_reference

HEADS_Q, HEADS_K, HEAD_DIM = 32, 8, 128


def make_inputs(size, dtype, device):
    batch, seq = size
    q = (
        torch.randn(batch, seq, HEADS_Q, HEAD_DIM, device=device, dtype=dtype)
        .transpose(1, 2)
        .requires_grad_()
    )
    k = (
        torch.randn(batch, seq, HEADS_K, HEAD_DIM, device=device, dtype=dtype)
        .transpose(1, 2)
        .requires_grad_()
    )
    angles = torch.arange(seq, device=device)[:, None] * torch.rand(HEAD_DIM // 2, device=device)
    angles = torch.cat((angles, angles), dim=-1)[None].expand(batch, -1, -1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _liger(q, k, cos, sin):
    from liger_kernel.ops.rope import LigerRopeFunction

    return LigerRopeFunction.apply(q, k, cos, sin)


def _bytes(size, dtype):
    elements = size[0] * size[1] * (HEADS_Q + HEADS_K) * HEAD_DIM
    return 2 * elements * dtype.itemsize, 2 * elements * dtype.itemsize


BENCH = BandwidthBenchmark(
    kernel="rope",
    shapes={
        "gpu": [(1, 2048), (1, 16384), (4, 8192), (1, 32768)],
        "cpu": [(1, 1024), (1, 2048)],
        "quick": [(1, 128)],
    },
    make_inputs=make_inputs,
    bytes_moved=_bytes,
    describe=lambda size: f"batch={size[0]} seq={size[1]} heads={HEADS_Q}/{HEADS_K} dim={HEAD_DIM}",
    providers={
        "fastalign-triton": lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos, sin, backend="triton"),
        "fastalign-torch": lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos, sin, backend="torch"),
        "torch-eager": rope_reference,
        "torch-compile": rope_reference,
        "liger-kernel": _liger,
    },
    requires={"fastalign-triton": "cuda", "liger-kernel": "liger_kernel"},
)

if __name__ == "__main__":
    run(BENCH)
