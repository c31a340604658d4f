"""Each kernel's goal as its own issue states it, and how the latest GPU runs compare with it.

A goal either bounds the forward+backward time over the run's floor (``max_over_floor``) or asks for a
ratio to be stated (the loss heads' ratio to their floor and to Liger-Kernel, the patched model's
speed-up over eager). Goals are for GPU runs: CPU runs only show that the code runs and how it scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks import noise, runs


@dataclass(frozen=True)
class Goal:
    kernel: str
    provider: str  # the row that is held to the goal
    text: str
    max_over_floor: float | None = None  # None: the ratios are stated, not judged
    versus: tuple[str, ...] = ()  # providers whose speed-up and memory ratio are stated


BANDWIDTH = "≥ 85% of the measured copy bandwidth: ≤ 1.18× the bandwidth floor"
GOALS = (
    Goal("linear_cross_entropy", "fastalign-triton", "fwd+bwd ≤ 1.15× the matmul floor", 1.15,
         ("liger-kernel",)),
    Goal("rms_norm", "fastalign-triton", BANDWIDTH, 1 / 0.85, ("liger-kernel",)),
    Goal("rope", "fastalign-triton", BANDWIDTH, 1 / 0.85, ("liger-kernel",)),
    Goal("swiglu", "fastalign-triton", BANDWIDTH, 1 / 0.85, ("liger-kernel",)),
    Goal("grpo", "fastalign", "GRPO head: its ratio to the matmul floor and to Liger-Kernel", None,
         ("liger-kernel",)),
    Goal("preference", "fastalign", "DPO head: its ratio to the matmul floor and to Liger-Kernel", None,
         ("liger-kernel",)),
    Goal("e2e_patch_model", "fastalign-patched", "patch_model: speed-up and memory vs the eager model", None,
         ("torch-eager",)),
)  # fmt: skip


@dataclass(frozen=True)
class Assessment:
    goal: Goal
    device: str
    verdict: str  # "met", "missed" or "stated"
    figures: list[str]  # one line per shape
    misses: list[str]


def versus(row: dict, other: dict) -> str:
    """``row``'s speed-up over ``other`` ("≈ time" within noise) and its memory ratio."""
    found = noise.speedup(row, other)
    if found is None:
        speed = "time –"
    elif not found[1]:
        speed = "≈ time"
    else:
        speed = f"{found[0]:.2f}× {'faster' if found[0] > 1 else 'slower'}"
    memory_mine, memory_theirs = runs.memory_mib(row), runs.memory_mib(other)
    memory = f", memory {memory_mine / memory_theirs:.2f}×" if memory_mine and memory_theirs else ""
    return f"{speed}{memory} vs {other['provider']}"


def assess(goal: Goal, run: dict) -> Assessment | None:
    """How ``run`` (a GPU run of the goal's kernel) compares with the goal; None without the goal's row."""
    rows = [row for row in run["rows"] if row["provider"] == goal.provider]
    if not rows:
        return None
    figures, misses = [], []
    for row in rows:
        others = {r["provider"]: r for r in run["rows"] if runs.case(r) == runs.case(row)}
        parts = []
        if row.get("fwd_bwd_over_floor") is not None:
            spread = runs.timing(row)[1]
            noisy = f" (spread {spread:.0%})" if spread > noise.SPREAD_LIMIT else ""
            parts.append(f"{row['fwd_bwd_over_floor']:.2f}× floor{noisy}")
            if goal.max_over_floor and row["fwd_bwd_over_floor"] > goal.max_over_floor:
                misses.append(f"{runs.case_label(row)}: {row['fwd_bwd_over_floor']:.2f}× floor{noisy}")
        parts += [versus(row, others[name]) for name in goal.versus if name in others]
        figures.append(f"{runs.case_label(row)}: {'; '.join(parts)}")
    verdict = "stated" if goal.max_over_floor is None else ("missed" if misses else "met")
    return Assessment(goal, run["env"]["device"], verdict, figures, misses)


def assessments(latest: list[dict]) -> dict[str, list[Assessment]]:
    """Per goal kernel, the assessments of its latest GPU runs (empty: not measured on GPU)."""
    return {
        goal.kernel: [
            found
            for run in latest
            if run["kernel"] == goal.kernel and runs.on_gpu(run) and (found := assess(goal, run))
        ]
        for goal in GOALS
    }
