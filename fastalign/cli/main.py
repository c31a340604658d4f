"""Entry point of the ``fastalign`` command."""

from __future__ import annotations

import argparse
import sys

from fastalign.cli import bench, demo, merge, plan, train


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and not getattr(args, "allow_extra", False):
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
