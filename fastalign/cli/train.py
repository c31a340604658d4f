"""``fastalign train <objective> --config FILE [--key value ...]``."""

from __future__ import annotations

import argparse
import sys

#: Objectives with a trainer; DPO-family and GRPO come next on the same engine.
OBJECTIVES = ("sft",)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a model (YAML config + --key value overrides, TRL option names)",
        description="Keys are TrainConfig fields (TRL / TrainingArguments names); flags override the file.",
    )
    parser.add_argument("objective", choices=OBJECTIVES)
    parser.add_argument("--config", help="YAML config (default: the built-in tiny run)")
    parser.set_defaults(run=run, allow_extra=True)


def run(args: argparse.Namespace) -> int:
    from fastalign.train.config import load_config
    from fastalign.train.sft import run_sft

    try:
        config = load_config(args.config, args.extra)
        output = run_sft(config)
    except ValueError as error:  # ConfigError and bad data: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"saved to {output}")
    return 0
