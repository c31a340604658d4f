"""``fastalign train <objective> [--config FILE] [--key value ...]``.

Keys are ``TrainConfig`` fields (TRL / ``TrainingArguments`` names); flags override the file, and with no
file the defaults are the built-in tiny run, so ``fastalign train sft`` works offline as is.
"""

from __future__ import annotations

import argparse
import sys

from fastalign.errors import one_line


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a model (YAML config + --key value overrides, TRL option names)",
        description="Keys are TrainConfig fields (TRL / TrainingArguments names); flags override the file.",
        epilog="examples: fastalign train sft --config examples/sft_tiny.yaml --max_steps 20; "
        "fastalign train dpo --config examples/dpo_tiny.yaml",
        allow_abbrev=False,  # else an override such as --c would be taken for --config
    )
    from fastalign.train.objectives import OBJECTIVES

    parser.add_argument("objective", choices=OBJECTIVES)
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in tiny run)")
    parser.set_defaults(run=run, allow_extra=True)  # the extra --key value pairs are the overrides


def run(args: argparse.Namespace) -> int:
    from fastalign.train.config import load_config

    try:
        config = load_config(args.config, getattr(args, "extra", ()))
        from fastalign.train.run import run_training  # imported only when used: it pulls in the models

        output = run_training(config, args.objective)
    except (ValueError, OSError) as error:  # ConfigError, bad data, an unwritable output_dir: one line
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    print(f"saved to {output}")
    return 0
