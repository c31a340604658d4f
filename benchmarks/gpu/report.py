"""The GPU check's section of RESULTS.md: its phases' tables and the open issues' GPU goals, met or missed.

A check's phases may come from several runs on one device (a phase rerun alone with ``--phases``): for
each phase the latest run that has rows for it is shown, with that run's commit and date.
"""

from __future__ import annotations

from benchmarks.gpu.check import KERNEL

GiB = 2**30


def _phases(runs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """phase → (its latest outcome with rows, or else its latest outcome; the run it came from)."""
    chosen: dict[str, tuple[dict, dict]] = {}
    for run in sorted(runs, key=lambda run: run["env"]["date"]):
        for name, outcome in run["phases"].items():
            if (
                outcome.get("rows")
                or outcome.get("files")
                or name not in chosen
                or not chosen[name][0].get("rows")
            ):
                chosen[name] = (outcome, run)
    return chosen


def _gib(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def _lora_table(rows: list[dict]) -> list[str]:
    baseline = {
        (r["tokens"], r["checkpointing"]): r for r in rows if r["provider"] == "peft" and "error" not in r
    }
    liger = {
        (r["tokens"], r["checkpointing"]): r for r in rows if r["provider"] == "liger" and "error" not in r
    }
    lines = [
        "| provider | tokens | checkpointing | offloading | tokens/s | MFU | peak GiB | planner GiB "
        "| first loss "
        "| vs peft (speed / memory) | vs Liger |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['provider']} | {row['tokens']:,} | {row['checkpointing']} | "
                         f"{row.get('offloading', False)} | {row['error']} |||||||")  # fmt: skip
            continue
        key = (row["tokens"], row["checkpointing"])
        versus = []
        for other in (baseline.get(key), liger.get(key)):
            if other is None or other is row or row["provider"] in ("peft",):
                versus.append("–")
            else:
                versus.append(f"{row['tokens_per_s'] / other['tokens_per_s']:.2f}× / "
                              f"{row['peak_gib'] / other['peak_gib']:.2f}×")  # fmt: skip
        lines.append(
            f"| {row['provider']} | {row['tokens']:,} | {row['checkpointing']} "
            f"| {row.get('offloading', False)} "
            f"| {row['tokens_per_s']:,.0f} | {row.get('mfu', 0):.0%} | {_gib(row.get('peak_gib'))} "
            f"| {_gib(row.get('planned_gib'))} | {row.get('first_loss')} | {versus[0]} | {versus[1]} |"
        )
    return lines


def _qlora_table(rows: list[dict]) -> list[str]:
    lines = [
        "| tokens | offloading | goal | step s | tokens/s | MFU | peak GiB | planner GiB | host peak GiB "
        "| offloaded GiB/step | first loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['tokens']:,} | {row.get('offloading', False)} | {row.get('goal', '')} "
                         f"| {row['error']} |||||||")  # fmt: skip
            continue
        lines.append(
            f"| {row['tokens']:,} | {row.get('offloading', False)} | {row.get('goal', '')} "
            f"| {row['step_s']:.2f} "
            f"| {row['tokens_per_s']:,.0f} | {row.get('mfu', 0):.0%} | {_gib(row.get('peak_gib'))} "
            f"| {_gib(row.get('planned_gib'))} | {_gib(row.get('host_peak_gib'))} "
            f"| {_gib(row.get('offloaded_gib'))} | {row.get('first_loss')} |"
        )
    return lines


def goals(phases: dict[str, tuple[dict, dict]], generation: list[dict] = ()) -> list[str]:
    """The open issues' GPU goals with the measured figure, met / missed / not measured (``generation``:
    the rows of the device's latest rollout-generation run, ``bench_generation.py --preset gpu``)."""
    lora = phases.get("lora_8b", ({}, {}))[0].get("rows", [])
    qlora = phases.get("qlora_70b", ({}, {}))[0].get("rows", [])
    ok = [row for row in qlora if "error" not in row]
    long_70b, long_8b = (
        [row for row in phases.get(name, ({}, {}))[0].get("rows", []) if "error" not in row]
        for name in ("long_70b", "long_8b")
    )
    lines = []

    def verdict(met: bool) -> str:
        return "**met**" if met else "**missed**"

    # A "48 GB" or "80 GB" card holds that many GiB or a little less (an H100's 79.6): compared in GiB.
    within_48 = [row for row in ok if row["peak_gib"] <= 48]
    longest_48 = max((row["tokens"] for row in within_48), default=None)
    at_12106 = next((row for row in ok if row["tokens"] == 12106), None)
    if at_12106 is not None:
        met = at_12106["peak_gib"] <= 48
        lines.append(f"- 70B QLoRA ≥ 12,106 tokens within 48 GB: {verdict(met)} — 12,106 tokens "
                     "(offloaded) peak "
                     f"{at_12106['peak_gib']:.1f} GiB; longest measured within 48 GiB: "
                     f"{f'{longest_48:,}' if longest_48 else 'none'}")  # fmt: skip
    else:
        lines.append("- 70B QLoRA ≥ 12,106 tokens within 48 GB: not measured on GPU")
    longest = phases.get("qlora_70b", ({}, {}))[0].get("planner_longest_tokens", {})
    planned = longest.get("80gb_offload")
    lines.append(_long_goal("70B QLoRA", 89389, [*ok, *long_70b], f"the planner's longest: {planned or 0:,}"))
    lines.append(_long_goal("8B LoRA", 342733, long_8b, "not run: `--phases long_8b`"))
    plain = next((row for row in ok if row["tokens"] == 8192 and not row.get("offloading")), None)
    offloaded = next((row for row in ok if row["tokens"] == 8192 and row.get("offloading")), None)
    if plain and offloaded:
        ratio = offloaded["step_s"] / plain["step_s"]
        host_met = verdict(offloaded["host_peak_gib"] <= 12)
        lines.append(f"- 70B / 8,192 tokens host memory ≤ 12 GiB: {host_met} — "
                     f"{offloaded['host_peak_gib']:.1f} GiB (the process's peak resident set)")  # fmt: skip
        lines.append(f"- offloaded step ≤ 1.15× the step without: {verdict(ratio <= 1.15)} — {ratio:.2f}× "
                     f"({offloaded['step_s']:.2f} s vs {plain['step_s']:.2f} s)")  # fmt: skip
    planned = [row for row in ok if row.get("planned_gib")]
    if planned:
        errors = [abs(row["planned_gib"] / row["peak_gib"] - 1) for row in planned]
        lines.append(f"- the planner within 10% of each 70B row: {verdict(max(errors) <= 0.10)} — worst "
                     f"{max(errors):.1%}")  # fmt: skip
    by = {(r["provider"], r["tokens"], r["checkpointing"], bool(r.get("offloading"))): r
          for r in lora if "error" not in r}  # fmt: skip
    trl, trl_liger, trl_fast = (
        by.get((name, 4096, False, False)) for name in ("trl", "trl-liger", "trl-fastalign")
    )
    if trl_fast and trl_liger:
        ahead = trl_fast["tokens_per_s"] > trl_liger["tokens_per_s"]
        lines.append(f"- TRL + fastalign ahead of TRL + Liger on the H100: {verdict(ahead)} — "
                     f"{trl_fast['tokens_per_s']:,.0f} vs {trl_liger['tokens_per_s']:,.0f} "
                     "tokens/s")  # fmt: skip
    else:
        lines.append("- TRL + fastalign ahead of TRL + Liger: not measured on GPU"
                     + (f" (TRL alone: {trl['tokens_per_s']:,.0f} tokens/s)" if trl else ""))  # fmt: skip
    lines.append(_generation_goal(generation))
    return lines


def _generation_goal(rows: list[dict]) -> str:
    """Issue 37's: the rollout engine ≥ 3× ``generate``'s tokens/s on the Llama-3.2-1B shape."""
    goal = "- rollout generation ≥ 3× `generate`'s tokens/s on the 1B shape"
    base = next((row for row in rows if row["provider"] == "generate"), None)
    ours = next((row for row in rows if row["provider"] == "fastalign"), None)
    if base is None or ours is None:
        return f"{goal}: not measured on GPU"
    ratio = ours["tokens_per_s"] / base["tokens_per_s"]
    eager = next((row for row in rows if row["provider"] == "fastalign-eager"), None)
    without = f"; without graphs {eager['tokens_per_s'] / base['tokens_per_s']:.2f}×" if eager else ""
    return (f"{goal}: {'**met**' if ratio >= 3 else '**missed**'} — {ratio:.2f}× "
            f"({ours['tokens_per_s']:,.0f} vs {base['tokens_per_s']:,.0f} tokens/s, decode "
            f"{ours.get('decode', 'eager')}{without})")  # fmt: skip


def _long_goal(what: str, anchor: int, rows: list[dict], otherwise: str) -> str:
    """'<what> > <anchor> tokens on 80 GB': met by the longest row that trained past it within 80 GiB (a
    row of a larger card does not count)."""
    rows = [row for row in rows if row["peak_gib"] <= 80]
    reached = max((row["tokens"] for row in rows), default=0)
    goal = f"- {what} > {anchor:,} tokens on 80 GB"
    if reached > anchor:
        row = max(rows, key=lambda row: row["tokens"])
        return (f"{goal}: **met** — {reached:,} tokens, peak {row['peak_gib']:.1f} GiB (planner "
                f"{_gib(row.get('planned_gib'))}), host {_gib(row.get('host_peak_gib'))} GiB, "
                f"{row['step_s']:.0f} s a step")  # fmt: skip
    measured = f"longest measured: {reached:,}; " if reached else ""
    return f"{goal}: not measured on GPU ({measured}{otherwise})"


def render(runs: list[dict], generation: list[dict] = ()) -> str:
    """The section of every GPU check run of one device (``generation``: see ``goals``)."""
    phases = _phases(runs)
    env = max(runs, key=lambda run: run["env"]["date"])["env"]
    lines = [
        f"## GPU check — {env['device']}",
        "",
        "`fastalign bench gpu` (benchmarks/gpu/check.py): bf16 autocast, random weights of the published "
        "shapes, LoRA r 16 α 32 dropout 0.05 on every linear layer, batch 1, AdamW; a row's time is the "
        "median step after the first; MFU = model FLOPs (frozen matmuls 4·P·T, adapters 6·P·T, causal "
        "attention; recomputation not counted) per second over the device's measured bf16 matmul ceiling; "
        "peak = `torch.cuda.max_memory_allocated` over the process; host peak = its peak resident set.",
        "",
        "### Goals of the open issues",
        "",
        *goals(phases, generation),
    ]
    for name, (outcome, run) in phases.items():
        renv = run["env"]
        lines += [
            "",
            f"### {name}",
            "",
            f"{renv['device']} · driver {renv.get('driver')} · torch {renv['torch']} · "
            f"triton {renv['triton']} · transformers {renv['transformers']} · commit {renv['git_commit']} · "
            f"{renv['date']} · matmul ceiling "
            f"{run.get('matmul_tflops')} TFLOP/s · {outcome.get('seconds')} s",
        ]
        if name == "tests":
            counts = ", ".join(f"{count} {what}" for what, count in sorted(outcome.get("counts", {}).items()))
            stopped = " (stopped at the phase's time cap)" if outcome.get("exit") == "timeout" else ""
            lines += ["", f"{counts or 'nothing ran'}{stopped}."]
            lines += [f"- failed: `{node}`" for node in outcome.get("failed", [])]
        elif name == "lora_8b" and outcome.get("rows"):
            lines += ["", *_lora_table(outcome["rows"])]
        elif name in ("long_70b", "long_8b") and outcome.get("rows"):
            lines += ["", *_qlora_table(outcome["rows"])]
        elif name == "qlora_70b" and outcome.get("rows"):
            longest = outcome.get("planner_longest_tokens", {})
            lines += ["", *_qlora_table(outcome["rows"]), "",
                      "The planner's longest: "
                      + ", ".join(f"{key} {value:,}" for key, value in longest.items())]  # fmt: skip
        elif outcome.get("files"):
            lines += [
                "",
                "Results: "
                + ", ".join(f"`{file}`" for file in outcome["files"])
                + " (their sections below).",
            ]
        if outcome.get("error"):
            lines += ["", f"Failed: {outcome['error']}"]
        if outcome.get("skipped"):
            lines += [
                "",
                "Skipped: " + "; ".join(f"{key} ({why})" for key, why in outcome["skipped"].items()),
            ]
    return "\n".join(lines) + "\n"


def sections(all_runs: list[dict]) -> list[str]:
    """One section per device that ran the check."""
    checks = [run for run in all_runs if run["kernel"] == KERNEL and run["preset"] == "gpu"]
    devices = sorted({run["env"]["device"] for run in checks})
    return [
        render(
            [run for run in checks if run["env"]["device"] == device], _latest_generation(all_runs, device)
        )
        for device in devices
    ]


def _latest_generation(all_runs: list[dict], device: str) -> list[dict]:
    """The rows of the device's latest rollout-generation run that has any."""
    found = [
        run for run in all_runs
        if run["kernel"] == "e2e_generation" and run["preset"] == "gpu" and run["env"]["device"] == device
        and run.get("rows")
    ]  # fmt: skip
    return max(found, key=lambda run: run["env"]["date"])["rows"] if found else []
