"""Timing and peak-memory measurement on CUDA and CPU.

Timing: ``triton.testing.do_bench`` (median) on CUDA; on CPU the median of ``repeats`` wall-clock runs
after a warm-up. The spread is the interquartile range over the median (``SPREAD``): unlike max − min it
does not grow with the number of repeats, so one preempted repeat on a shared machine does not make a
whole series look noisy. Memory: peak bytes allocated above what was allocated before the call (CUDA
allocator statistics), or on CPU the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) above the resident set just before the call. For the CPU figure to follow the
live allocations, call ``release_freed_memory_promptly()`` first: by default glibc keeps freed blocks
of up to 32 MiB resident and a later call reuses them unseen.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

#: How ``time_ms`` computes its spread (recorded with benchmark runs).
SPREAD = "(p75 − p25) / median"


def relative_spread(times: list[float]) -> float:
    """The interquartile range of ``times`` over their median (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    low, median, high = statistics.quantiles(times, n=4, method="inclusive")
    return (high - low) / median


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def times_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> list[float]:
    """Every timed run of ``fn`` in ms, after a warm-up (CUDA: as many as ``do_bench`` makes in 200 ms)."""
    if device.type == "cuda":
        import triton.testing

        return list(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="all"))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """(median ms, relative spread ``SPREAD``) of ``fn``."""
    times = times_ms(fn, device, repeats)
    return statistics.median(times), relative_spread(times)


def release_freed_memory_promptly() -> bool:
    """Make glibc map every block of 64 KiB or more on its own, so that freeing it returns it to the
    system (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``). Returns False where that is not possible."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory that one call of ``fn`` needs above what is allocated before it (None where the
    platform cannot tell)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set (VmHWM) to the current one
    except OSError:
        return None
    before = _resident_bytes()
    fn()
    return max(0, _peak_resident_bytes() - before)
