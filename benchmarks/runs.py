"""The recorded runs (``benchmarks/results/*.json``) and the figures of their rows.

Kernel rows time a forward+backward (``fwd_bwd_ms``), end-to-end alignment rows a training step
(``step_ms``); their memory is a workspace in MiB or a peak in GiB. The report, the plots and the goals
read rows through these helpers so that every kind of row renders, compares and plots the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: The provider other rows of a run are compared with: the first of these that the run has.
BASELINES = ("torch-eager", "trl", "fastalign-unpatched", "generate")
#: A row's time: the first of these it has (its spread is the same name with ``_spread``).
TIME_KEYS = ("fwd_bwd_ms", "step_ms")
#: A row's memory: the first of these it has, with its unit's size in MiB.
MEMORY_KEYS = {"peak_extra_mib": 1.0, "peak_memory_gib": 1024.0, "peak_cuda_mib": 1.0, "peak_rss_mib": 1.0}
#: How the ``*_spread`` figures of a run that does not say were computed.
LEGACY_SPREAD = "(max − min) / median"


def load_runs(results_dir: Path = RESULTS_DIR) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(results_dir.glob("*.json"))]


def latest_per_device(runs: list[dict]) -> list[dict]:
    """The latest run of each (benchmark, device, preset), sorted by those."""
    latest: dict[tuple[str, str, str], dict] = {}
    for run in runs:
        key = (run["kernel"], run["env"]["device"], run["preset"])
        if key not in latest or run["env"]["date"] > latest[key]["env"]["date"]:
            latest[key] = run
    return [latest[key] for key in sorted(latest)]


def on_gpu(run: dict) -> bool:
    return run["env"].get("device_type") == "cuda"


def shape(row: dict) -> str:
    return row.get("shape") or f"N={row['N']} D={row['D']} V={row['V']}"


def case(row: dict) -> tuple:
    """What a row measured besides its provider: rows of one case are compared with each other."""
    return (shape(row), row.get("dtype"), row.get("objective"))


def case_label(row: dict) -> str:
    return " ".join(str(part) for part in (row.get("objective"), shape(row)) if part)


def time_key(row: dict) -> str | None:
    return next((key for key in TIME_KEYS if row.get(key) is not None), None)


def timing(row: dict) -> tuple[float, float] | None:
    """(median ms, relative spread) of the row's time, or None."""
    key = time_key(row)
    if key is None:
        return None
    return row[key], row.get(key.removesuffix("_ms") + "_spread") or 0.0


def memory_mib(row: dict) -> float | None:
    key = next((key for key in MEMORY_KEYS if row.get(key) is not None), None)
    return None if key is None else row[key] * MEMORY_KEYS[key]


def baseline(run: dict) -> str | None:
    providers = {row["provider"] for row in run["rows"]}
    return next((name for name in BASELINES if name in providers), None)


def is_fastalign(provider: str) -> bool:
    return provider.startswith("fastalign")


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def plot_name(run: dict) -> str:
    """The file name of a run's plot (one per benchmark, device and preset)."""
    return f"{run['kernel']}-{slug(run['env']['device'])}-{slug(run['preset'])}.png"
