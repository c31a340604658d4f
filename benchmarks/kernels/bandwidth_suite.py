"""A benchmark harness for memory-bound ops (RMSNorm, RoPE, gated activations).

An op file gives: how to build inputs for a size, its providers (each a function of those inputs
returning the output tensors), and the bytes a forward and a backward must move at least. This
harness times forward and forward+backward (upstream gradient of ones), measures the workspace, and
states the floor: those bytes over the copy bandwidth measured on the same device at the start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import common


@dataclass
class BandwidthBenchmark:
    kernel: str
    shapes: dict[str, Sequence[tuple]]  # preset → sizes passed to make_inputs
    make_inputs: Callable[[tuple, torch.dtype, torch.device], tuple[torch.Tensor, ...]]
    bytes_moved: Callable[[tuple, torch.dtype], tuple[int, int]]  # (forward, backward) minimum bytes
    describe: Callable[[tuple], str]
    providers: dict[str, Callable] = field(default_factory=dict)
    requires: dict[str, str] = field(default_factory=dict)  # CUDA-only provider → module it needs, or 'cuda'


def matrix_passes(forward: int, backward: int) -> Callable[[tuple, torch.dtype], tuple[int, int]]:
    """``bytes_moved`` of an op whose size is (tokens, width) and whose every tensor worth counting is
    [tokens, width]: ``forward`` such tensors read or written by the forward, ``backward`` by the
    backward (each op's docstring names them)."""

    def bytes_moved(size: tuple, dtype: torch.dtype) -> tuple[int, int]:
        one = size[0] * size[1] * dtype.itemsize
        return forward * one, backward * one

    return bytes_moved


def _unavailable(bench: BandwidthBenchmark, name: str, device: torch.device) -> str:
    """Why a provider cannot run here ('' when it can). Every required provider is CUDA-only."""
    need = bench.requires.get(name)
    if need is None:
        return ""
    if device.type != "cuda":
        return "needs CUDA"
    if need != "cuda" and importlib.util.find_spec(need) is None:
        return f"{need} not installed"
    return ""


def steps(bench: BandwidthBenchmark, name: str, size: tuple, dtype: torch.dtype, device: torch.device):
    """(forward, forward+backward with an upstream gradient of ones) of one provider on fresh inputs."""
    fn = bench.providers[name]
    if name == "torch-compile":
        fn = torch.compile(fn)
    inputs = bench.make_inputs(size, dtype, device)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def forward():
        return fn(*inputs)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        outputs = forward()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    return forward, forward_backward


def _measure_row(bench, name, size, dtype, device, repeats) -> dict:
    forward, forward_backward = steps(bench, name, size, dtype, device)
    row = {"provider": name, "shape": bench.describe(size), "dtype": str(dtype).removeprefix("torch.")}
    return row | common.step_figures(forward, forward_backward, device, repeats)


def run(bench: BandwidthBenchmark, argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=f"{bench.kernel}: speed and memory per provider")
    parser.add_argument("--preset", choices=sorted(bench.shapes), default="gpu")
    parser.add_argument("--providers", nargs="*")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    names = common.select_providers(bench.kernel, bench.providers, args.providers)
    skipped = {name: why for name in names if (why := _unavailable(bench, name, device))}
    bandwidth = common.copy_bandwidth_gbps(device)
    rows = []
    with common.keep_rows_on_termination(skipped):
        for size in bench.shapes[args.preset]:
            forward_bytes, backward_bytes = bench.bytes_moved(size, dtype)
            floor_ms = (forward_bytes + backward_bytes) / (bandwidth * 1e9) * 1e3
            for name in names:
                if name in skipped:
                    continue
                torch._dynamo.reset()
                row = _measure_row(bench, name, size, dtype, device, args.repeats)
                rows.append(common.add_floor(row, floor_ms))
                print(json.dumps(rows[-1]), flush=True)
    return common.record(
        suite="kernels", kernel=bench.kernel, preset=args.preset,
        floor="minimum bytes of forward + backward at the measured copy bandwidth",
        ceiling={"copy_bandwidth_gbps": round(bandwidth, 1)}, device=device, rows=rows, skipped=skipped,
        out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip
