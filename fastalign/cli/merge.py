"""``fastalign merge RUN_DIR [--output_dir DIR]``: a LoRA/QLoRA run's adapter merged into a bf16 model."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "merge",
        help="merge a LoRA/QLoRA run's adapter into its base: a bf16 model from_pretrained loads",
        description="Rebuilds the run's base (4-bit, dequantized, for QLoRA) from its fastalign_config.yaml.",
    )
    parser.add_argument("run_dir", help="a training output_dir holding adapter_config.json")
    parser.add_argument("--output_dir", help="where to save the merged model (default: RUN_DIR/merged)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fastalign.train.export import merge_adapter

    try:
        output = merge_adapter(args.run_dir, args.output_dir)
    except ValueError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(f"saved to {output}")
    return 0
