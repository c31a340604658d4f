"""A runner for loss-head benchmarks (GRPO, DPO): providers × shapes, one JSON result file.

A benchmark file gives its presets, how to build the inputs of a shape (the first two being the
hidden states and head weight that receive gradients), the FLOPs of its floor, and its providers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import common
from fastalign.bench import measure


@dataclass
class LossHeadBenchmark:
    kernel: str
    description: str
    # name → {"dtype", "shapes", "repeats"[, "ceiling_repeats"]}: "ceiling_repeats" (default 10) timed
    # products make the matmul ceiling; the quick presets (it runs: the GPU check's smoke run) take one
    presets: dict[str, dict]
    make_inputs: Callable[[tuple, torch.dtype, torch.device], tuple]
    floor_flops: Callable[[tuple], float]
    floor_text: str
    describe: Callable[[tuple], str]
    providers: Callable[[torch.device], dict[str, Callable]]
    cuda_only: tuple[str, ...] = ("liger-kernel",)


def steps(fn: Callable, inputs: tuple):
    """(forward, forward+backward) of one provider: the gradients reach the hidden states and the head."""
    hidden, weight = inputs[:2]

    def forward():
        return fn(*inputs)

    def forward_backward():
        hidden.grad = weight.grad = None
        forward().backward()

    return forward, forward_backward


def run(bench: LossHeadBenchmark, argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=bench.description)
    parser.add_argument("--preset", choices=sorted(bench.presets), default="gpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: all)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    preset = bench.presets[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()
    tflops = common.matmul_tflops(device, dtype, preset.get("ceiling_repeats", 10))
    table = bench.providers(device)
    known = dict.fromkeys([*table, *bench.cuda_only])
    names = common.select_providers(bench.kernel, known, args.providers)
    skipped = {name: "needs CUDA and its package" for name in names if name not in table}
    table = {name: table[name] for name in names if name in table}
    rows = []
    with common.keep_rows_on_termination(skipped):
        _measure_shapes(bench, preset, table, skipped, rows, tflops, device, dtype)
    return common.record(
        suite="kernels", kernel=bench.kernel, preset=args.preset, floor=bench.floor_text,
        ceiling={"matmul_tflops": round(tflops, 3)}, device=device, rows=rows, skipped=skipped,
        out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip


def _measure_shapes(bench, preset, table, skipped, rows, tflops, device, dtype) -> None:
    for shape in preset["shapes"]:
        torch._dynamo.reset()  # compile each shape afresh: no dynamic-shape recompiles across shapes
        torch.manual_seed(0)
        inputs = bench.make_inputs(shape, dtype, device)
        floor_ms = bench.floor_flops(shape) / (tflops * 1e12) * 1e3
        for name, fn in table.items():
            try:
                row = {"provider": name} | common.step_figures(*steps(fn, inputs), device, preset["repeats"])
            except torch.OutOfMemoryError as error:
                skipped[f"{name} {bench.describe(shape)}"] = f"out of memory: {str(error)[:120]}"
                continue
            except Exception as error:  # a provider's own failure (e.g. a torch.compile bug) is a row lost
                skipped[f"{name} {bench.describe(shape)}"] = f"{type(error).__name__}: {str(error)[:200]}"
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row |= {"shape": bench.describe(shape), "dtype": preset["dtype"]}
            rows.append(common.add_floor(row, floor_ms))
            print(json.dumps(rows[-1]), flush=True)
