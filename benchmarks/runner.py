"""What ``fastalign bench`` does: run the selected benchmarks, gate their results on noise, report.

Each benchmark runs as its own script in a fresh process (as it would by hand) and writes its result to
a staging folder; a result whose rows are too noisy (``noise.SPREAD_LIMIT``) is refused there, unless
``allow_noisy``, so that only results whose differences stand out of their spreads reach the results
folder. The report (RESULTS.md and plots) is then regenerated from that folder. A benchmark that fails
or has none of the requested providers is reported and the others still run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import noise, report, runs
from benchmarks.suites import Suite

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    name: str
    status: str  # "recorded", "refused" (noisy), "failed", "nothing measured"
    detail: str
    seconds: float
    interrupted: bool = False  # Ctrl-C: the rows it had are recorded, no further benchmark runs


@dataclass
class Options:
    preset: str | None = None  # None: gpu where CUDA is available, else cpu
    quick: bool = False
    providers: list[str] | None = None
    out_dir: Path | None = None  # None: benchmarks/results (a new temporary folder for quick runs)
    allow_noisy: bool = False
    spread_limit: float = noise.SPREAD_LIMIT
    timeout_s: float | None = None  # per benchmark; then it is stopped and its rows so far are kept
    threads: int | None = None  # CPU threads of each benchmark (OMP_NUM_THREADS); None: torch's default
    report: bool = True


def _command(suite: Suite, options: Options, staging: Path) -> list[str]:
    command = [sys.executable, str(ROOT / suite.script), *suite.preset_args(options.preset, options.quick)]
    command += ["--out", str(staging)]
    return command + (["--providers", *options.providers] if options.providers else [])


def _run_script(command: list[str], timeout_s: float | None, env: dict) -> tuple[int, str, bool]:
    """(exit status, the tail of its stderr, whether it was interrupted). Progress (stdout) passes
    through. A timeout, or Ctrl-C or SIGTERM to this process, stops the script (Ctrl-C reaches it
    directly; otherwise SIGTERM is sent), which then records the rows it has."""
    interrupted = False
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(command, cwd=ROOT, stderr=errors, text=True, env=env)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        except KeyboardInterrupt:
            interrupted = True
            try:
                proc.wait(timeout=10)  # Ctrl-C in a terminal reached the script too: it records its rows
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()
        errors.seek(0)
        return proc.returncode, "".join(errors.readlines()[-20:]), interrupted


def _environment(options: Options) -> dict:
    """The scripts' environment: one thread count for OpenMP and MKL where ``threads`` is given (with
    more threads than free cores, a small CPU op can wait a scheduler tick for each of its threads)."""
    env = dict(os.environ)
    if options.threads:
        env |= {"OMP_NUM_THREADS": str(options.threads), "MKL_NUM_THREADS": str(options.threads)}
    return env


def _gate(staged: Path, options: Options, out_dir: Path) -> tuple[str, str]:
    """Move one staged result to ``out_dir`` unless it is too noisy: (status, detail)."""
    result = json.loads(staged.read_text())
    noisy = noise.noisy_rows(result, options.spread_limit)
    if noisy and not options.allow_noisy:
        message = (
            f"refused {result['kernel']}: spread above {options.spread_limit:.0%} in {'; '.join(noisy)}. "
            "Run it again on a quieter machine, or pass --allow-noisy to record it marked as noisy."
        )
        print(message, file=sys.stderr, flush=True)
        return "refused", f"{len(noisy)} noisy rows"
    if noisy:
        result |= {"noisy": noisy, "spread_limit": options.spread_limit}
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / staged.name
    target.write_text(json.dumps(result, indent=1) + "\n")
    return "recorded", str(target)


def run_one(suite: Suite, options: Options, out_dir: Path) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"bench_{suite.name}_") as staging:
        command = _command(suite, options, Path(staging))
        print(f"== {suite.name}: {' '.join(command[1:])}", flush=True)
        status, stderr_tail, interrupted = _run_script(command, options.timeout_s, _environment(options))
        staged = sorted(Path(staging).glob("*.json"))
        outcomes = [_gate(path, options, out_dir) for path in staged]
    seconds = time.monotonic() - start
    if outcomes:
        return Outcome(suite.name, outcomes[-1][0], outcomes[-1][1], seconds, interrupted)
    if status != 0:
        print(stderr_tail, file=sys.stderr, end="", flush=True)
        reason = stderr_tail.strip().splitlines()[-1] if stderr_tail.strip() else f"exit status {status}"
        return Outcome(suite.name, "failed", reason, seconds, interrupted)
    return Outcome(suite.name, "nothing measured", "none of the requested providers", seconds, interrupted)


def default_preset() -> str:
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def run(selected: list[Suite], options: Options) -> int:
    """Run ``selected``; 0 when every result was recorded (or had nothing to measure), else 1."""
    if not options.quick and options.preset is None:
        options.preset = default_preset()
    out_dir = options.out_dir or (
        Path(tempfile.mkdtemp(prefix="fastalign_bench_quick_")) if options.quick else runs.RESULTS_DIR
    )
    env_note = "" if options.quick else f" preset {options.preset},"
    print(f"fastalign bench: {len(selected)} benchmark(s),{env_note} results to {out_dir}", flush=True)
    outcomes = []
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: as Ctrl-C
    try:
        for suite in selected:
            outcomes.append(run_one(suite, options, out_dir))
            if outcomes[-1].interrupted:
                print("interrupted: no further benchmarks", file=sys.stderr)
                break
    finally:
        signal.signal(signal.SIGTERM, previous)
    if options.report and any(outcome.status == "recorded" for outcome in outcomes):
        md_path = report.RESULTS_MD if out_dir.resolve() == runs.RESULTS_DIR else out_dir / "RESULTS.md"
        print(f"wrote {report.write(out_dir, md_path)}", flush=True)
    for outcome in outcomes:
        print(f"{outcome.name:22} {outcome.status:16} {outcome.seconds:6.0f} s  {outcome.detail}")
    ok = {"recorded", "nothing measured"}
    return 0 if outcomes and all(outcome.status in ok for outcome in outcomes) else 1
