"""``fastalign plan --model NAME|config.json --method full|lora|qlora|ppo|ppo-lora|ppo-qlora|
distill-offline[-lora|-qlora] --gpus N ...``.

Prints the memory a training run needs per GPU and in host RAM, term by term, whether it fits, and the
cheapest flag changes that make it fit (``--json``: the same as one JSON object). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from fastalign.cli.usage import one_line_usage_errors

#: ``plan_memory`` parameter -> the flag that sets it (for error messages).
_FLAGS = {
    "tiled_mlp_mib": "--tiled-mlp",
    "config": "--model",
    "method": "--method",
    "gpus": "--gpus",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "lora_r": "--lora-r",
    "lora_dropout": "--lora-dropout",
    "gpu_memory_bytes": "--gpu-memory",
    "checkpointing": "--checkpointing",
    "host_memory_bytes": "--host-memory",
    "device": "--device",
    "base_dtype": "--base-dtype",
    "top_k": "--top-k",
    "tail_samples": "--tail-samples",
}


class _OptionError(ValueError):
    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="memory needed to train a model: per GPU, host RAM, and settings that fit",
        description="Memory of a training run per GPU and in host RAM, term by term, and the cheapest flag "
        "changes that fit. Sizes are binary: 24GB = 24 GiB.",
        epilog="examples: fastalign plan --model llama-3-8b --method lora --gpu-memory 24GB; "
        "fastalign plan --model path/to/config.json --gpus 8 --json",
        allow_abbrev=False,
    )
    # Values are parsed in run(), so that every bad value is one "error: --flag: ..." line.
    parser.add_argument(
        "--model",
        help="built-in shape name (llama-3-8b, qwen2.5-7b, tiny-llama, ...) or a "
        "local config.json / model directory",
    )
    parser.add_argument(
        "--method",
        default="full",
        help="full, lora or qlora; ppo (policy, critic and reference as separate models), ppo-lora or "
        "ppo-qlora (PPO on one base model: policy and critic adapters); distill-offline, "
        "distill-offline-lora or distill-offline-qlora (train distill --teacher_logprobs_path: no teacher "
        "in memory; the student in full, or LoRA / QLoRA adapters) (default: full)",
    )
    parser.add_argument(
        "--top-k",
        help="distill-offline methods only: the stored teacher top-k, for the disk per token (default: 32)",
    )
    parser.add_argument(
        "--tail-samples",
        help="distill-offline methods only: the stored tail draws per token (teacher-logprobs "
        "--tail_samples), 4 B each on disk (default: 0)",
    )
    parser.add_argument("--gpus", default="1", help="GPUs; more than 1 shards with FSDP2 (default: 1)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 24GB (default: 80GB)")
    parser.add_argument(
        "--host-memory",
        help="host RAM of the machine, e.g. 128GB: a plan whose host share (offloaded activations) would "
        "not fit in it, less a tenth (at least 2 GiB) kept for the rest, does not fit (default: not checked)",
    )
    parser.add_argument("--seq-len", default="4096", help="tokens per sequence (default: 4096)")
    parser.add_argument(
        "--batch-size",
        default="1",
        help="sequences per GPU and micro-batch, as one forward takes them: a preference pair (DPO, reward, "
        "online DPO) is two (default: 1)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    parser.add_argument("--offload-activations", action="store_true", help="offload activations to CPU")
    parser.add_argument("--lora-r", help="LoRA rank, methods with an adapter only (default: 16)")
    parser.add_argument(
        "--lora-dropout", help="LoRA dropout, methods with an adapter only (default: 0.05, as TrainConfig)"
    )
    parser.add_argument(
        "--fp32", action="store_true", help="no bf16 mixed precision (TrainConfig bf16=false)"
    )
    parser.add_argument(
        "--base-dtype",
        default="fp32",
        help="dtype the model is loaded in (TrainConfig dtype): fp32, TRL's default, or bf16 (default: fp32)",
    )
    parser.add_argument(
        "--materialized-logits",
        action="store_true",
        help="the loss head builds [tokens, vocab] logits (SFT without use_liger_kernel)",
    )
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    parser.add_argument(
        "--tiled-mlp",
        nargs="?",
        const="256",
        default="0",
        metavar="MIB",
        help="the MLPs run in token tiles of this working set (train option tiled_mlp; default tile 256 MiB)",
    )
    parser.add_argument(
        "--longest",
        action="store_true",
        help="print the longest --seq-len (a multiple of 256) that fits with these flags, without and with "
        "--offload-activations, instead of the plan",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    # A value that starts with a minus and a digit is a (bad) value, not an option: "--gpu-memory -24GB"
    # reaches parse_memory, which names the problem, instead of argparse's "expected one argument".
    parser._negative_number_matcher = re.compile(r"^-\d")
    one_line_usage_errors(parser, "plan")
    parser.set_defaults(run=run)


def _positive_int(flag: str, text: str, least: int = 1) -> int:
    """``text`` as an integer of at least ``least`` (1: positive; 0: none or more)."""
    what = "a positive integer" if least == 1 else f"an integer of {least} or more"
    try:
        value = int(text)
    except ValueError:
        raise _OptionError(flag, f"expected {what}, got {text!r}") from None
    if value < least:
        raise _OptionError(flag, f"must be {what}, got {text!r}")
    return value


def plan_from_args(args: argparse.Namespace):
    """The ``MemoryPlan`` of parsed arguments; errors as ``ValueError('--flag: message')``."""
    from fastalign.plan import PlanError, plan_memory

    if not args.model:
        raise _OptionError("--model", "required: a built-in shape name or a config.json path")
    for flag, value in (("--lora-r", args.lora_r), ("--lora-dropout", args.lora_dropout)):
        if value is not None and "lora" not in args.method:
            raise _OptionError(flag, f"read only by the methods with an adapter (lora, qlora, ...), not "
                               f"{args.method!r}: remove it")  # fmt: skip
    args.lora_r = "16" if args.lora_r is None else args.lora_r
    args.lora_dropout = "0.05" if args.lora_dropout is None else args.lora_dropout
    try:
        dropout = float(args.lora_dropout)
    except ValueError:
        raise _OptionError(
            "--lora-dropout", f"expected a number in [0, 1), got {args.lora_dropout!r}"
        ) from None
    try:
        return plan_memory(
            args.model,
            seq_len=_positive_int("--seq-len", args.seq_len),
            **_plan_flags(args, dropout),
        )
    except PlanError as error:
        raise _OptionError(_FLAGS.get(error.option, error.option), str(error)) from None


def _plan_flags(args: argparse.Namespace, dropout: float) -> dict:
    """The ``plan_memory`` keyword arguments of the parsed flags, but ``seq_len``."""
    from fastalign.plan import parse_memory

    return dict(
        method=args.method,
        gpus=_positive_int("--gpus", args.gpus),
        batch_size=_positive_int("--batch-size", args.batch_size),
        checkpointing=args.checkpointing,
        offload_activations=args.offload_activations,
        lora_r=_positive_int("--lora-r", args.lora_r),
        lora_dropout=dropout,
        gpu_memory_bytes=parse_memory(args.gpu_memory),
        host_memory_bytes=None
        if args.host_memory is None
        else parse_memory(args.host_memory, "host_memory_bytes"),
        bf16=not args.fp32,
        base_dtype=args.base_dtype,
        device=args.device,
        fused_loss_head=not args.materialized_logits,
        tiled_mlp_mib=_tile_mib(args.tiled_mlp),
        **_stored_logprobs(args),
    )


def _stored_logprobs(args: argparse.Namespace) -> dict:
    """``--top-k`` and ``--tail-samples``, those given: the planner takes its defaults for the others, and
    refuses either one for a method other than the distill-offline ones, which alone read them."""
    stored = {}
    if args.top_k is not None:
        stored["top_k"] = _positive_int("--top-k", args.top_k)
    if args.tail_samples is not None:
        stored["tail_samples"] = _positive_int("--tail-samples", args.tail_samples, least=0)
    return stored


def _tile_mib(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _OptionError("--tiled-mlp", f"expected a working set in MiB, got {text!r}") from None


def longest_from_args(args: argparse.Namespace) -> dict:
    """``--longest``: the longest sequences that fit, without and with offloading (on CUDA)."""
    from fastalign.plan import PlanError, longest_sequence

    plan = plan_from_args(args)  # checks every flag, --seq-len included, in one place
    flags = _plan_flags(args, plan.lora_dropout)
    flags.pop("offload_activations")
    try:
        result = {"longest_seq_len": longest_sequence(args.model, **flags, offload_activations=False)}
        if plan.device == "cuda":
            result["longest_seq_len_offloaded"] = longest_sequence(
                args.model, **flags, offload_activations=True
            )
    except PlanError as error:
        raise _OptionError(_FLAGS.get(error.option, error.option), str(error)) from None
    from fastalign.plan.shapes import resolve_model

    context = getattr(resolve_model(args.model)[1], "max_position_embeddings", None)
    return {"model": plan.model, "method": plan.method, "gpus": plan.gpus, **result, "context": context}


def run(args: argparse.Namespace) -> int:
    try:
        if args.longest:
            longest = longest_from_args(args)
        else:
            plan = plan_from_args(args)
    except ValueError as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr)
        return 2
    if args.longest:
        print(json.dumps(longest) if args.json else _longest_line(args, longest))
    elif args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print_plan(plan)
    return 0


def _longest_line(args: argparse.Namespace, longest: dict) -> str:
    """The longest sequences that fit, in one line: '... 22,528 tokens; with --offload-activations: ...'."""
    batch = f"{args.batch_size} × " if args.batch_size != "1" else ""
    line = (
        f"longest sequence for {longest['model']} ({longest['method']}, {longest['gpus']} GPU × "
        f"{args.gpu_memory}{f', host {args.host_memory}' if args.host_memory else ''}"
        f"{', checkpointing' if args.checkpointing else ''}): "
        f"{batch}{longest['longest_seq_len']:,} tokens"
    )
    if "longest_seq_len_offloaded" in longest:
        line += f"; with --offload-activations: {batch}{longest['longest_seq_len_offloaded']:,} tokens"
    fits = max(longest["longest_seq_len"], longest.get("longest_seq_len_offloaded", 0))
    if longest["context"] is not None and fits > longest["context"]:  # memory is not what limits it
        line += f" (memory's bound: the model's context, max_position_embeddings, is {longest['context']:,})"
    return line


def _precision(plan) -> str:
    """What the plan counts the weights and the compute in, e.g. "loaded in fp32, bf16 autocast"."""
    base = (
        f"NF4 + {'bf16' if plan.bf16 or plan.base_dtype == 'bf16' else 'fp32'}"
        if "qlora" in plan.method
        else plan.base_dtype
    )
    if plan.bf16:
        compute = "bf16 autocast" if plan.gpus == 1 else "bf16 mixed precision (FSDP2)"
    else:
        compute = f"{'bf16' if plan.base_dtype == 'bf16' else 'fp32'} compute"
    return f"loaded in {base}, {compute}"


def print_plan(plan) -> None:
    """The plan as a table, then totals, fit, suggestions and notes."""
    from rich.table import Table

    from fastalign.cli.console import console as make_console
    from fastalign.plan import format_bytes

    console = make_console(width=160, highlight=False)
    flags = [
        flag
        for flag, on in (("checkpointing", plan.checkpointing), ("offloading", plan.offload_activations))
        if on
    ]
    title = (
        f"{plan.model}: {plan.method}, {plan.gpus} GPU{'s' if plan.gpus > 1 else ''} × "
        f"{format_bytes(plan.gpu_memory_bytes)}, {plan.batch_size} × {plan.seq_len} tokens, "
        f"{_precision(plan)}{''.join(', ' + flag for flag in flags)}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("term")
    table.add_column("per GPU", justify="right")
    table.add_column("host", justify="right")
    table.add_column("sharded", justify="center")
    table.add_column("how")
    for term in plan.terms:
        table.add_row(
            term.label,
            format_bytes(term.gpu_bytes),
            format_bytes(term.host_bytes),
            "yes" if term.sharded else "",
            term.how,
        )
    table.add_section()
    table.add_row(
        "[bold]total[/]",
        f"[bold]{format_bytes(plan.total_per_gpu)}[/]",
        f"[bold]{format_bytes(plan.host_per_process)}[/]",
        "",
        f"host: per process, max(load, offload); {format_bytes(plan.host_total)} for {plan.gpus} "
        f"process{'es' if plan.gpus > 1 else ''}",
    )
    console.print(table)
    gpu_fits = plan.total_per_gpu <= plan.gpu_memory_bytes
    line = f"{format_bytes(plan.total_per_gpu)} of {format_bytes(plan.gpu_memory_bytes)} per GPU: "
    line += "[green]fits[/]" if gpu_fits else "[red]does not fit[/]"
    if plan.host_memory_bytes is not None:
        from fastalign.plan.planner import usable_host_bytes

        usable = format_bytes(usable_host_bytes(plan.host_memory_bytes))
        line += (
            f"; host {format_bytes(plan.host_total)} of the {usable} offloading may take of "
            f"{format_bytes(plan.host_memory_bytes)}: "
        )
        line += "[green]fits[/]" if plan.host_fits else "[red]does not fit[/]"
    console.print(line)
    console.print(
        f"params {plan.params:,}, trainable {plan.trainable_params:,}; activations "
        f"{plan.layer_activation_bytes_per_token:,} B/token/layer; loss head with materialized logits: "
        f"{format_bytes(plan.loss_head_materialized)}, fused: {format_bytes(plan.loss_head_fused)}"
    )
    if plan.offload_activations and plan.device == "cuda":
        from fastalign.plan.planner import AUTO_KEEP_SHARE

        auto = f"the most that fit in {AUTO_KEEP_SHARE:.0%} of the GPU, as training's auto keeps"
        console.print(
            f"offloading: keep_on_device {plan.offload_keep_on_device} (the last layers whose saved tensors "
            f"stay on the GPU: {auto if plan.keep_on_device == 'auto' else 'as asked'})"
        )
    if not plan.fits and plan.suggestions:
        console.print(
            f"to fit: {' '.join(plan.suggestions)} ({format_bytes(plan.suggested_total_per_gpu)} per GPU)",
            soft_wrap=True,
        )
    for note in plan.notes:
        console.print(f"note: {note}", soft_wrap=True)
