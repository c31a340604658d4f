"""Shared benchmark plumbing: timing, memory, the device's measured ceilings, and run metadata.

Timing: ``triton.testing.do_bench`` (median) on CUDA; on CPU the median of ``repeats`` wall-clock runs
after a warm-up. Memory: peak bytes allocated above the inputs (CUDA allocator statistics), or on CPU the
rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident
set just before the run, which is why each CPU row runs in a fresh process.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median ms, relative spread = (max − min) / median) of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        times = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all")
    else:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory that one call of ``fn`` needs above what is allocated before it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    before = _resident_bytes()
    fn()
    return max(0, _peak_resident_bytes() - before)


def matmul_tflops(
    device: torch.device, dtype: torch.dtype, m: int, n: int, k: int, repeats: int = 3
) -> float:
    """Measured matmul throughput on this device for an [m, k] @ [k, n] product, in TFLOP/s."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    ms, _ = time_ms(lambda: a @ b, device, repeats)
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=RESULTS_DIR,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=RESULTS_DIR
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    """Device, versions and date recorded with every result file."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "device": device_name(device),
        "device_type": device.type,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
    return env


def write_result(result: dict, out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in result["env"]["device"]).strip("-").lower()
    stamp = result["env"]["date"].replace(":", "").replace("-", "")
    path = out_dir / f"{result['kernel']}-{slug}-{stamp}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    return path
