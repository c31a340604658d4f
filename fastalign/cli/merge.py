"""``fastalign merge RUN_DIR [--output_dir DIR] [--overwrite_output_dir] [--dtype D]``: a LoRA/QLoRA run's
adapter merged into its base (in fp32, saved in the base checkpoint's dtype or ``--dtype``)."""

from __future__ import annotations

import argparse
import sys

from fastalign.cli.usage import one_line_usage_errors
from fastalign.errors import one_line

#: ``--dtype`` values (torch dtype names).
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "merge",
        help="merge a LoRA/QLoRA run's adapter into its base: a model from_pretrained loads",
        description="Rebuilds the run's base (4-bit, dequantized, for QLoRA) from its fastalign_config.yaml.",
    )
    parser.add_argument("run_dir", help="a training output_dir holding adapter_config.json")
    parser.add_argument("--output_dir", help="where to save the merged model (default: RUN_DIR/merged)")
    parser.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="merge into an --output_dir holding a model or run that no merge wrote (replacing its model)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="dtype of the saved weights (default: the base checkpoint's own; the merge itself is fp32)",
    )
    one_line_usage_errors(parser, "merge")  # e.g. --dtype float8: one line, not the usage text
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fastalign.train.merge import merge_adapter

    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        output = merge_adapter(args.run_dir, args.output_dir, dtype, args.overwrite_output_dir)
    except (ValueError, OSError) as error:  # bad run directory or files; OSError: cannot write the output
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    print(f"saved to {output}")
    return 0
