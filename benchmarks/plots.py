"""PNG plots of the recorded runs: time and memory against size, one line per provider.

One figure per benchmark, device and preset (the runs RESULTS.md shows), in ``benchmarks/plots/``,
named by ``runs.plot_name``. A sweep varies one dimension at a time, so there is no single numeric size
axis: the cases are placed in the order of their floor (the work they must do) where the run states one,
else in the order measured. The time and memory axes are logarithmic.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import runs


def render(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(runs.case(row) for row in run["rows"]))
    floors = {runs.case(row): row.get("floor_ms") for row in run["rows"]}
    if all(floors.values()):
        cases.sort(key=floors.get)
    labels = {runs.case(row): runs.case_label(row) for row in run["rows"]}
    providers = list(dict.fromkeys(row["provider"] for row in run["rows"]))
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    time_names = {runs.time_key(row) for row in run["rows"]} - {None}
    time_label = "step ms" if time_names == {"step_ms"} else "forward+backward ms"
    for axis, figure_of, label in (
        (time_axis, lambda row: (runs.timing(row) or (None,))[0], f"{time_label} (median)"),
        (memory_axis, runs.memory_mib, "peak memory MiB"),
    ):
        for provider in providers:
            points = [
                (cases.index(runs.case(row)), value)
                for row in run["rows"]
                if row["provider"] == provider and (value := figure_of(row))
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", label=provider)
        axis.set_yscale("log")
        axis.set_ylabel(label)
        axis.set_xticks(range(len(cases)), [labels[case] for case in cases], rotation=30, ha="right",
                        fontsize=7)  # fmt: skip
        axis.set_xlabel("case, by floor" if all(floors.values()) else "case")
        axis.grid(True, which="both", alpha=0.3)
    time_axis.legend(fontsize=7)
    figure.suptitle(f"{run['kernel']} — {run['env']['device']} · {run['preset']} · {run['env']['date']}")
    figure.savefig(path, dpi=100)
    plt.close(figure)


def render_all(latest: list[dict], plots_dir: Path) -> list[Path]:
    """A plot per run with rows; plots of runs no longer shown are removed (the folder is generated)."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for run in latest:
        if run["rows"]:
            paths.append(plots_dir / runs.plot_name(run))
            render(run, paths[-1])
    for stale in set(plots_dir.glob("*.png")) - set(paths):
        stale.unlink()
    return paths
