"""Measuring speed and memory the same way in the demo, the benchmark suites and ``fastalign bench``."""

from fastalign.bench.measure import device_name, peak_extra_bytes, time_ms

__all__ = ["device_name", "peak_extra_bytes", "time_ms"]
