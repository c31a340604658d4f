"""Noise control: which measured differences are real, and which runs are too noisy to record.

A row's time is a median with a relative spread. Two medians are told apart only where they differ by
more than their spreads (half of each on either side of its median); otherwise the report writes "≈"
instead of a speed-up. A run in which some row's own spread exceeds ``SPREAD_LIMIT``, or a row beats its
floor (so the ceiling was measured low), is not recorded by ``fastalign bench`` unless it is told to
(``--allow-noisy``), and is then marked as noisy.
"""

from __future__ import annotations

from benchmarks import runs

#: The largest relative spread of a row's time that ``fastalign bench`` records without --allow-noisy.
SPREAD_LIMIT = 0.25


def within_noise(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether medians ``a`` and ``b``, each (ms, relative spread), differ by less than their spreads:
    the intervals median ± spread · median / 2 overlap."""
    (time_a, spread_a), (time_b, spread_b) = a, b
    return abs(time_a - time_b) <= (time_a * spread_a + time_b * spread_b) / 2


def speedup(row: dict, other: dict) -> tuple[float, bool] | None:
    """(``other``'s time over ``row``'s, whether that difference is real), or None without both times."""
    mine, theirs = runs.timing(row), runs.timing(other)
    if mine is None or theirs is None or not mine[0]:
        return None
    return theirs[0] / mine[0], not within_noise(mine, theirs)


def noisy_rows(run: dict, limit: float = SPREAD_LIMIT) -> list[str]:
    """The rows of ``run`` whose time spread exceeds ``limit``, or that ran faster than their floor (the
    ceiling behind the floor was measured while something else slowed it down), described for a message."""
    noisy = []
    for row in run["rows"]:
        figures = runs.timing(row)
        name = f"{row['provider']} {runs.case_label(row)}"
        if figures and figures[1] > limit:
            noisy.append(f"{name}: spread {figures[1]:.0%}")
        if row.get("fwd_bwd_over_floor") is not None and row["fwd_bwd_over_floor"] < 1:
            noisy.append(f"{name}: {row['fwd_bwd_over_floor']:.2f}× its floor, below it")
    return noisy
