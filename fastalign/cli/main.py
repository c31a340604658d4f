"""Entry point of the ``fastalign`` command."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from fastalign.cli import bench, demo, merge, plan, teacher_logprobs, train
from fastalign.cli.usage import one_line_usage_errors

#: Exit status of a command whose reader closed the pipe: 128 + SIGPIPE, what the shell reports for a
#: process that SIGPIPE ended (``yes | head``).
BROKEN_PIPE_STATUS = 141
#: Exit status after Ctrl-C: 128 + SIGINT, as the shell reports it.
INTERRUPTED_STATUS = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastalign", description="Triton-accelerated post-training for Hugging Face causal LMs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(commands)
    train.add_parser(commands)
    plan.add_parser(commands)
    merge.add_parser(commands)
    bench.add_parser(commands)
    teacher_logprobs.add_parser(commands)
    one_line_usage_errors(parser, None)  # e.g. no command: one line, not the usage text
    for name, command in commands.choices.items():
        one_line_usage_errors(command, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Every way it can end is one line at most: a usage or input
    error (each command's own), Ctrl-C, or a reader that stopped reading (``fastalign plan --json |
    head``), which ends quietly as a process that SIGPIPE stops would.

    A process of a torchrun job running the command line (``argv`` None) exits here, its output flushed,
    without the interpreter's teardown: there gloo's and FSDP2's threads sometimes abort a rank whose run
    had finished ("terminate called without an active exception", SIGABRT; 1 run in 45 of 2 processes on
    a 2-core CPU), and torchrun then reports a finished run as failed."""
    status = _main(argv)
    if argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _main(argv: list[str] | None) -> int:
    try:
        try:
            with warnings.catch_warnings():  # the caller's warning display restored on return
                warnings.showwarning = _one_line_warning
                return _run(argv)
        finally:
            sys.stdout.flush()  # here (after --help too), so that a closed pipe is caught below, not at exit
    except BrokenPipeError:
        # Python would flush stdout again at exit and report the same error there: point it at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one ``warning:`` line, printed above a progress bar rather than glued onto it (not
    Python's ``file:line: Category: message`` and the source line)."""
    from tqdm import tqdm

    name = "" if category is UserWarning else f" ({category.__name__})"
    tqdm.write(f"warning: {message}{name}", file=file or sys.stderr)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "allow_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
