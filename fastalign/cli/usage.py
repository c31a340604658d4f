"""argparse's usage errors (an unknown choice, a flag without its value) as fastalign's one line."""

from __future__ import annotations

import argparse
import sys
import typing


def one_line_usage_errors(parser: argparse.ArgumentParser, command: str | None) -> None:
    """Make ``parser`` report a usage error as one ``error: fastalign <command>: ...`` line (exit 2),
    not argparse's usage text; ``command`` None is the top-level ``fastalign`` parser."""
    prefix = "fastalign" if command is None else f"fastalign {command}"

    def error(message: str) -> typing.NoReturn:
        print(f"error: {prefix}: {message} (see {prefix} --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = error
