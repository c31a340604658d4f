"""Shared benchmark plumbing: the device's measured ceilings, run metadata and result files.

Timing and memory come from ``fastalign.bench.measure``; CPU rows each run in fresh processes so that
their peak resident memory is their own.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fastalign.bench import measure
from fastalign.bench.measure import device_name, peak_extra_bytes, time_ms, times_ms

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: How the spreads of ``step_figures`` rows are computed (``record(spread=...)``).
SPREAD = measure.SPREAD


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """The device's measured matmul ceiling in TFLOP/s: a square product large enough to be compute
    bound (8192 on CUDA, 2048 on CPU), random data, in the benchmark's dtype. A ceiling is the fastest
    repeat, not the median: other work on a shared machine only ever slows a repeat down."""
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = min(times_ms(lambda: a @ b, device, repeats))
    return 2 * size**3 / (ms * 1e-3) / 1e12


def copy_bandwidth_gbps(device: torch.device, repeats: int = 10) -> float:
    """The device's measured memory bandwidth in GB/s: a large copy, bytes read plus bytes written (the
    fastest repeat, as for ``matmul_tflops``)."""
    size = 2**30 if device.type == "cuda" else 2**28
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = min(times_ms(lambda: dst.copy_(src), device, repeats))
    return 2 * size / (ms * 1e-3) / 1e9


def step_figures(
    forward: Callable[[], object],
    forward_backward: Callable[[], object],
    device: torch.device,
    repeats: int,
    parts: tuple[str, ...] = ("time", "memory"),
) -> dict:
    """The figures of one benchmark row: after a warm-up step, the workspace of forward+backward and
    the median time (and spread) of forward alone and of forward+backward."""
    forward_backward()  # warm-up: compiles, autotunes, allocates the gradients
    row = {}
    if "memory" in parts:
        row["peak_extra_mib"] = round((peak_extra_bytes(forward_backward, device) or 0) / 2**20, 2)
    if "time" in parts:
        for key, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
            ms, spread = time_ms(fn, device, repeats)
            row[f"{key}_ms"], row[f"{key}_spread"] = round(ms, 4), round(spread, 3)
    return row


@contextlib.contextmanager
def keep_rows_on_termination(skipped: dict):
    """Turn SIGTERM (a ``timeout`` or a scheduler) or Ctrl-C inside the block into a normal exit that
    notes the interruption in ``skipped``, so the rows measured so far are still recorded."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    except KeyboardInterrupt:
        skipped["interrupted"] = "the run was stopped before every shape was measured"
        print("interrupted: recording the rows measured so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_floor(row: dict, floor_ms: float) -> dict:
    """Record the floor and forward+backward's ratio to it in ``row``; returns it."""
    row["floor_ms"] = round(floor_ms, 4)
    row["fwd_bwd_over_floor"] = round(row["fwd_bwd_ms"] / floor_ms, 3)
    return row


def arguments(
    description: str, presets: Iterable[str], default_preset: str, default_providers: str = "all"
) -> argparse.ArgumentParser:
    """The parser of the arguments ``fastalign bench`` hands every benchmark script: ``--preset``,
    ``--providers`` and ``--out``; a script with more adds them to it."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(presets), default=default_preset)
    parser.add_argument("--providers", nargs="*", help=f"subset of providers (default: {default_providers})")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser


def select_providers(
    kernel: str, known: Iterable[str], requested: list[str] | None, default: Iterable[str] | None = None
) -> list[str]:
    """The requested providers this benchmark has, in the order given (``default``, else every known one,
    when none are requested). ``fastalign bench --providers`` hands one list to every benchmark, so names
    a benchmark lacks are passed over; where none is left the run ends here, writing nothing."""
    known = list(known)
    if not requested:
        return list(default if default is not None else known)
    names = [name for name in requested if name in known]
    if names and len(names) < len(requested):
        lacking = [name for name in requested if name not in known]
        print(f"{kernel}: passing over {lacking} (not its providers)")
    if not names:
        print(f"{kernel}: none of the providers {requested} (it has {known}): nothing measured", flush=True)
        raise SystemExit(0)
    return names


def git_commit() -> str:
    """The checkout's commit (``-dirty`` with local changes); ``FASTALIGN_GIT_COMMIT`` names it where the
    tree was copied without its git directory (a remote benchmark machine)."""
    if os.environ.get("FASTALIGN_GIT_COMMIT"):
        return os.environ["FASTALIGN_GIT_COMMIT"]
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


def error_line(output: str, default: str) -> str:
    """The line of a failed child process's output that says why, for a row or a report: its last line
    naming an exception type before any colon (a traceback ends with ``SomeError: message``; warnings
    and log lines do not), else its last non-blank line, else ``default``; at most 300 characters."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0]]
    return (errors or lines or [default])[-1][:300]


def run_worker(script: str, spec: dict, timeout: float, cwd: Path | None = None) -> dict:
    """Run ``python script --worker <spec as JSON>`` in a fresh process (its peak memory is its own) and
    return the JSON the worker wrote to ``spec["result"]``; a failed worker raises ``RuntimeError`` with
    its ``error_line``."""
    proc = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(spec)], capture_output=True, text=True,
        timeout=timeout, cwd=cwd,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(error_line(proc.stderr, "the worker failed"))
    return json.loads(Path(spec["result"]).read_text())


def _host_memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)  # MemTotal, in KiB
    except (OSError, ValueError, IndexError):
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device: torch.device) -> dict:
    """Device, memory, driver, versions, commit and date recorded with every result file."""
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
        "host_memory_gib": _host_memory_gib(),
        "threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
        env["driver"] = _driver_version()
    return env


def record(
    *, suite: str, kernel: str, preset: str, floor: str, ceiling: dict, device: torch.device, rows: list,
    skipped: dict, out_dir: Path = RESULTS_DIR, spread: str | None = None,
) -> Path:  # fmt: skip
    """Write one run (its rows, the environment, the floor and the measured ceiling) as a JSON file.
    ``spread`` says how the rows' ``*_spread`` figures were computed (``measure.SPREAD`` for the rows of
    ``step_figures``); a run without it used (max − min) / median."""
    result = {
        "suite": suite, "kernel": kernel, "preset": preset, "floor": floor, **ceiling,
        "env": environment(device), "rows": rows, "skipped": skipped,
    }  # fmt: skip
    if spread:
        result["spread"] = spread
    path = write_result(result, out_dir)
    print(f"wrote {path}")
    return path


def slug(device: str) -> str:
    """A device's name as result file names carry it (``nvidia-h100-80gb-hbm3``)."""
    return "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()


def write_json_atomically(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` through a temporary file: a reader never sees half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def write_result(result: dict, out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = result["env"]["date"].replace(":", "").replace("-", "")
    path = out_dir / f"{result['kernel']}-{slug(result['env']['device'])}-{stamp}.json"
    write_json_atomically(path, result)
    return path
