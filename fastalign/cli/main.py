"""Entry point of the ``fastalign`` command."""

from __future__ import annotations

import argparse
import sys

from fastalign.cli import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastalign", description="Triton-accelerated post-training for Hugging Face causal LMs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
