"""argparse's usage errors (an unknown choice, a flag without its value) as fastalign's one line."""

from __future__ import annotations

import argparse
import sys
import typing


def one_line_usage_errors(parser: argparse.ArgumentParser, command: str) -> None:
    """Make ``parser`` report a usage error as one ``error: fastalign <command>: ...`` line (exit 2),
    not argparse's usage text."""

    def error(message: str) -> typing.NoReturn:
        print(f"error: fastalign {command}: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = error
