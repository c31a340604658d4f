"""Speed and memory of linear cross-entropy (hidden [N, D] · weight [V, D] → mean CE) per provider.

    python benchmarks/kernels/bench_linear_cross_entropy.py --preset cpu      # the CPU figure of the issue
    python benchmarks/kernels/bench_linear_cross_entropy.py --preset gpu      # V x N x D sweep, bf16
    python benchmarks/kernels/bench_linear_cross_entropy.py --preset gpu-quick
    python benchmarks/kernels/bench_linear_cross_entropy.py --preset quick    # a tiny head, any device
    python benchmarks/kernels/bench_linear_cross_entropy.py --preset gpu-chunks --providers \
        fastalign-chunk256 fastalign-chunk1024 fastalign-chunk2048 fastalign-chunk4096 fastalign-chunk8192

Each row: median time of the forward (gradients enabled, as in training) and of forward+backward, the
relative spread of the repeats, the workspace (peak memory above the inputs and their gradients, which
the warm-up step leaves allocated), and the floor: 6·N·V·D FLOPs at the
matmul ceiling measured on the same device at the start of the run (``common.matmul_tflops``). A
provider that is not installed or does not run on the device is skipped and
the reason recorded. CPU rows each run in a fresh process so that peak resident memory is their own.
Writes one JSON file per run under benchmarks/results/; ``benchmarks/report.py`` renders RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign import linear_cross_entropy
from fastalign.bench import measure

KERNEL = "linear_cross_entropy"

PRESETS = {
    # The CPU reference point: N=4096, D=256, V=32000, fp32 on a 2-core machine.
    "cpu": {"dtype": "float32", "shapes": [(4096, 256, 32000)], "repeats": 5},
    # quick: it runs (the check's smoke run), so its matmul ceiling is one timed product, not ten
    "quick": {"dtype": "float32", "shapes": [(512, 128, 8192)], "repeats": 5, "ceiling_repeats": 1},
    "gpu-quick": {"dtype": "bfloat16", "shapes": [(4096, 4096, 128256), (16384, 4096, 128256)], "repeats": 0},
    # The reference (16384, 4096, 128256), then tokens, vocabulary and hidden size varied one at
    # a time (Llama-3-8B/70B, Qwen2.5, Gemma-3 vocabularies).
    "gpu": {
        "dtype": "bfloat16",
        "shapes": [
            (16384, 4096, 128256), (4096, 4096, 128256), (32768, 4096, 128256), (16384, 4096, 32000),
            (16384, 4096, 151936), (16384, 4096, 262144), (8192, 2048, 151936), (16384, 8192, 128256),
        ],
        "repeats": 0,
    },
    "gpu-chunks": {"dtype": "bfloat16", "shapes": [(16384, 4096, 128256)], "repeats": 0},
    # The GPU check's two rows (``fastalign bench gpu``): Llama-3's vocabulary and a 256k one (Gemma-3's).
    "gpu-check": {
        "dtype": "bfloat16", "shapes": [(16384, 4096, 128256), (16384, 4096, 256000)], "repeats": 0
    },
}  # fmt: skip

#: The ``fastalign-unbounded`` provider's workspace: the 1 GiB chunks of logits fastalign used before
#: ``fastalign.ops.head_workspace`` (1 GiB over 2 B per logit of the Triton path).
UNBOUNDED_BYTES = 2**30

#: Rows per chunk that the ``fastalign-chunk<rows>`` providers run with (not run unless named).
CHUNK_SWEEP = (256, 1024, 2048, 4096, 8192)

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def low_memory_chunk_size(n: int, d: int, v: int) -> int:
    """Rows whose [rows, V] logits take about half the memory of the [N, D] input: the rule of
    PyTorch's chunked op (``aspect_ratio:2``), to compare the two at equal memory."""
    rows = -(-n // -(-v // d))
    return max(1, (1 << (rows - 1).bit_length()) // 2)


def _fastalign_low_memory(h, w, t):
    n, d = h.shape
    return linear_cross_entropy(h, w, t, chunk_size=low_memory_chunk_size(n, d, w.shape[0]))


def _torch_chunked(h, w, t):
    return F.linear_cross_entropy(h, w, t, options=torch.nn.LinearCrossEntropyOptions())


def _liger() -> Loss:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t: loss(w, h, t)


def _cce() -> Loss:
    from cut_cross_entropy import linear_cross_entropy as cce

    return lambda h, w, t: cce(h, w, t)


def provider_table(device: torch.device) -> dict[str, tuple[Callable[[], Loss] | None, str]]:
    """name → (factory, reason it cannot run here: '' when it can)."""
    cuda_only = "" if device.type == "cuda" else "needs CUDA"

    def installed(module: str) -> str:
        return "" if importlib.util.find_spec(module) else f"{module} not installed"

    return {
        "fastalign-triton": (
            lambda: lambda h, w, t: linear_cross_entropy(h, w, t, backend="triton"),
            cuda_only,
        ),
        "fastalign-torch": (lambda: lambda h, w, t: linear_cross_entropy(h, w, t, backend="torch"), ""),
        # the chunking before the workspace budget: 1 GiB of logits a chunk (4,096 rows of bf16 at
        # V 128,256), to set the budget's cost in time against its saving in memory
        "fastalign-unbounded": (
            lambda: lambda h, w, t: linear_cross_entropy(h, w, t, workspace_bytes=UNBOUNDED_BYTES),
            "",
        ),
        "fastalign-lowmem": (lambda: _fastalign_low_memory, ""),
        "torch-eager": (lambda: _eager, ""),
        "torch-compile": (lambda: torch.compile(_eager), ""),
        "torch-chunked": (
            lambda: _torch_chunked,
            ""
            if hasattr(F, "linear_cross_entropy")
            else f"torch {torch.__version__} has no F.linear_cross_entropy",
        ),
        "liger-kernel": (_liger, cuda_only or installed("liger_kernel")),
        "cut-cross-entropy": (_cce, cuda_only or installed("cut_cross_entropy")),
    } | {f"fastalign-chunk{rows}": (functools.partial(_fixed_chunks, rows), "") for rows in CHUNK_SWEEP}


def _fixed_chunks(rows: int) -> Loss:
    return lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=rows)


def steps(provider: str, n: int, d: int, v: int, dtype: str, device: torch.device):
    """(forward, forward+backward) of one provider on random inputs, every 7th target ignored."""
    factory, reason = provider_table(device)[provider]
    if reason:
        raise RuntimeError(reason)
    loss_fn = factory()
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    hidden = torch.randn(n, d, device=device, dtype=dt, requires_grad=True)
    weight = (torch.randn(v, d, device=device) / d**0.5).to(dt).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device)
    targets[::7] = -100

    def forward():
        return loss_fn(hidden, weight, targets)

    def forward_backward():
        hidden.grad = weight.grad = None
        forward().backward()

    return forward, forward_backward


def measure_row(
    provider: str,
    n: int,
    d: int,
    v: int,
    dtype: str,
    device: torch.device,
    repeats: int,
    parts=("time", "memory"),
) -> dict:
    """One row (or the ``parts`` of it): fwd and fwd+bwd time and spread, peak extra memory of fwd+bwd."""
    forward, forward_backward = steps(provider, n, d, v, dtype, device)
    row = {"provider": provider, "N": n, "D": d, "V": v, "dtype": dtype}
    return row | common.step_figures(forward, forward_backward, device, repeats, parts)


def _measure_in_subprocesses(provider, n, d, v, dtype, repeats) -> dict:
    """Time in one fresh process, memory in another (where freed blocks go back to the system at once,
    which would slow the timing down)."""
    row = {}
    for part in ("time", "memory"):
        spec = json.dumps(
            {"provider": provider, "shape": [n, d, v], "dtype": dtype, "repeats": repeats, "part": part}
        )
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", spec], capture_output=True, text=True, timeout=1800
        )
        if proc.returncode != 0:
            raise RuntimeError(
                proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "worker failed"
            )
        row |= json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def run(preset: str, providers: list[str] | None, out_dir: Path) -> Path:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = PRESETS[preset]
    dtype = config["dtype"]
    table = provider_table(device)
    default = [name for name in table if not name.startswith("fastalign-chunk")]
    names = common.select_providers(KERNEL, table, providers, default)
    skipped = {name: table[name][1] for name in names if table[name][1]}
    rows = []
    tflops = common.matmul_tflops(device, getattr(torch, dtype), config.get("ceiling_repeats", 10))
    with common.keep_rows_on_termination(skipped):
        _measure_shapes(config, names, skipped, rows, tflops, device)
    return common.record(
        suite="kernels", kernel=KERNEL, preset=preset, floor="6·N·V·D FLOPs at the measured matmul ceiling",
        ceiling={"matmul_tflops": round(tflops, 3)}, device=device, rows=rows, skipped=skipped,
        out_dir=out_dir, spread=common.SPREAD,
    )  # fmt: skip


def _measure_shapes(config, names, skipped, rows, tflops, device) -> None:
    dtype = config["dtype"]
    for n, d, v in config["shapes"]:
        floor_ms = 6 * n * v * d / (tflops * 1e12) * 1e3
        for name in names:
            if name in skipped:
                continue
            try:
                if device.type == "cpu":
                    row = _measure_in_subprocesses(name, n, d, v, dtype, config["repeats"])
                else:
                    row = measure_row(name, n, d, v, dtype, device, config["repeats"])
            except (RuntimeError, torch.OutOfMemoryError, subprocess.TimeoutExpired) as error:
                skipped[f"{name} N={n} D={d} V={v}"] = str(error)[:300]
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(common.add_floor(row, floor_ms))
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: all)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        n, d, v = spec["shape"]
        if spec["part"] == "memory":
            measure.release_freed_memory_promptly()
        device = torch.device("cpu")
        row = measure_row(spec["provider"], n, d, v, spec["dtype"], device, spec["repeats"], (spec["part"],))
        print(json.dumps(row))
        return
    run(args.preset, args.providers, args.out)


if __name__ == "__main__":
    main()
