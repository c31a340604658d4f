"""``fastalign bench [kernels|e2e|all] [--only NAME] [--quick] [--preset P] [--providers ...] [--out DIR]``.

Runs the benchmark suites of a fastalign checkout (``benchmarks/``: the scripts, their results and the
generated RESULTS.md live in the repository, not in the installed package), each benchmark in a fresh
process; see ``benchmarks/runner.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fastalign


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="run the benchmark suites (kernels, end to end), record their results, regenerate RESULTS.md",
        description="Runs the benchmarks of a fastalign checkout, each in a fresh process; a missing "
        "provider is skipped and reported. Results go to benchmarks/results/ (JSON, one file per run), "
        "then benchmarks/RESULTS.md and benchmarks/plots/ are regenerated. A result with a row whose "
        "spread exceeds --max-spread is refused unless --allow-noisy.",
        epilog="examples: fastalign bench kernels --quick; fastalign bench all --preset cpu; "
        "fastalign bench kernels --only linear_cross_entropy,rms_norm --providers fastalign-triton "
        "liger-kernel; fastalign bench --list",
    )
    parser.add_argument(
        "suite",
        nargs="?",
        choices=["kernels", "e2e", "all", "gpu"],
        default="all",
        help="which suite (default: all); gpu: the one-call GPU check (benchmarks/gpu/check.py), phase by "
        "phase, each capped in time, then RESULTS.md",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="gpu: every phase on tiny shapes, on any device (a temp dir)"
    )
    parser.add_argument("--phases", nargs="+", metavar="PHASE", help="gpu: these phases only")
    parser.add_argument(
        "--cap", type=float, metavar="SECONDS", help="gpu: seconds each phase may take (default: its own cap)"
    )
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]", help="these benchmarks only")
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, seconds each (results to a temp dir)"
    )
    parser.add_argument(
        "--preset", help="cpu, gpu or quick (some benchmarks have more); default: gpu on CUDA"
    )
    parser.add_argument(
        "--providers", nargs="+", metavar="NAME", help="only these providers, where a benchmark has them"
    )
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument("--allow-noisy", action="store_true", help="record noisy results, marked as such")
    parser.add_argument(
        "--max-spread", type=float, help="largest spread of a row's time recorded (default 0.25)"
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds per benchmark; then its rows so far are recorded"
    )
    parser.add_argument("--threads", type=int, help="CPU threads per benchmark (default: torch's, all cores)")
    parser.add_argument("--no-report", action="store_true", help="do not regenerate RESULTS.md and the plots")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.set_defaults(run=run)


def _checkout() -> Path | None:
    """The repository root holding ``benchmarks/`` next to this ``fastalign`` package, if any."""
    root = Path(fastalign.__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "runner.py").is_file() else None


def run(args: argparse.Namespace) -> int:
    root = _checkout()
    if root is None:
        print(
            "error: fastalign bench runs the benchmark suites of a fastalign checkout (benchmarks/ beside "
            "the fastalign package); this fastalign is installed without them. Clone the repository and "
            "pip install -e . there.",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import noise, runner, suites

    if args.suite == "gpu":
        return _gpu_check(args)
    if args.list:
        for suite in suites.select(args.suite):
            print(f"{suite.name:22} {suite.kind:8} {suite.script:50} {suite.summary}")
        return 0
    only = [name for names in args.only or [] for name in names.split(",") if name]
    try:
        selected = suites.select(args.suite, only)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    options = runner.Options(
        preset=args.preset,
        quick=args.quick,
        providers=args.providers,
        out_dir=args.out,
        allow_noisy=args.allow_noisy,
        spread_limit=args.max_spread or noise.SPREAD_LIMIT,
        timeout_s=args.timeout,
        threads=args.threads,
        report=not args.no_report,
    )
    return runner.run(selected, options)


def _gpu_check(args: argparse.Namespace) -> int:
    """``fastalign bench gpu``: the check's phases, then RESULTS.md where its results went to
    benchmarks/results."""
    from benchmarks import report, runs
    from benchmarks.gpu import check

    unknown = [name for name in args.phases or [] if name not in check.BY_NAME]
    if unknown:
        print(f"error: no GPU check phase {', '.join(unknown)} (there are: {', '.join(check.BY_NAME)})",
              file=sys.stderr)  # fmt: skip
        return 2
    argv = (["--smoke"] if args.smoke else []) + (["--out", str(args.out)] if args.out else [])
    argv += ["--phases", *args.phases] if args.phases else []
    argv += ["--cap", str(args.cap)] if args.cap is not None else []
    status = check.main(argv)
    out = args.out or (None if args.smoke else runs.RESULTS_DIR)
    if status == 0 and out is not None and not args.no_report and out.resolve() == runs.RESULTS_DIR:
        print(f"wrote {report.write(out, report.RESULTS_MD)}")
    return status
