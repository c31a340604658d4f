"""``fastalign train <objective> [--config FILE] [--key value ...]``.

Keys are ``TrainConfig`` fields (TRL / ``TrainingArguments`` names); flags override the file, and with no
file the defaults are the built-in tiny run, so ``fastalign train sft`` works offline as is.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from fastalign.errors import one_line


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a model (YAML config + --key value overrides, TRL option names)",
        description="Keys are TrainConfig fields (TRL / TrainingArguments names); flags override the file. "
        "fastalign train OBJECTIVE --help lists the objective's keys.",
        epilog="examples: fastalign train sft --config examples/sft_tiny.yaml --max_steps 20; "
        "fastalign train dpo --config examples/dpo_tiny.yaml",
        allow_abbrev=False,  # else an override such as --c would be taken for --config
        add_help=False,  # --help after an objective lists its keys (run)
    )
    from fastalign.train.objectives import OBJECTIVES

    parser.add_argument("-h", "--help", action="store_true", help="this help, or with OBJECTIVE its keys")
    parser.add_argument("objective", nargs="?", metavar=f"{{{','.join(OBJECTIVES)}}}")
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in tiny run)")
    parser.set_defaults(run=run, allow_extra=True, parser=parser)  # extra --key value pairs: overrides


def run(args: argparse.Namespace) -> int:
    from fastalign.train.objectives import OBJECTIVES

    if args.objective is not None and args.objective not in OBJECTIVES:  # a typo, or a flag's value where
        # no objective came first
        close = difflib.get_close_matches(args.objective, list(OBJECTIVES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        args.parser.error(
            f"{args.objective!r} is not an objective{hint} (fastalign train OBJECTIVE [--config FILE] "
            f"[--key value ...], OBJECTIVE one of {', '.join(OBJECTIVES)})"
        )
    if args.help:
        from fastalign.cli.usage import objective_help

        print(objective_help(args.objective) if args.objective else args.parser.format_help(), end="")
        return 0
    if args.objective is None:
        args.parser.error(
            f"the objective comes first: fastalign train OBJECTIVE [--config FILE] [--key value ...], one of "
            f"{', '.join(OBJECTIVES)}"
        )
    from fastalign.train.config import ConfigError, load_config

    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun: what every rank says, said once
    try:
        config = load_config(args.config, getattr(args, "extra", ()))
        from fastalign.train.run import run_training  # imported only when used: it pulls in the models

        output = run_training(config, args.objective)
    except (ValueError, OSError, MemoryError) as error:
        # ConfigError, bad data, an unwritable output_dir, offloading's HostMemoryError: one line (a config
        # error, every rank's alike, from the first; another may be one rank's own)
        if first or not isinstance(error, ConfigError):
            print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    if first:
        print(f"saved to {output}")
    return 0
