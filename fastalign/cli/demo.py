"""``fastalign demo``: the fused linear cross-entropy against plain PyTorch on one batch.

Same loss and gradients, time and peak memory side by side, on CUDA where present, else CPU. Built-in
sizes, random inputs: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from rich.table import Table

from fastalign.bench import measure
from fastalign.cli.console import console as make_console
from fastalign.ops import linear_cross_entropy

#: (tokens, hidden, vocab, dtype) per device: a Llama-3-8B head on CUDA, a small head on a CPU.
DEFAULT_SIZES = {"cuda": (16384, 4096, 128256, "bfloat16"), "cpu": (4096, 256, 32000, "float32")}


def add_parser(commands) -> None:
    parser = commands.add_parser("demo", help="fused linear cross-entropy vs plain PyTorch (no downloads)")
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA where present, else CPU"
    )
    parser.add_argument("--tokens", type=_positive, help="N, tokens in the batch")
    parser.add_argument("--hidden", type=_positive, help="D, hidden size")
    parser.add_argument("--vocab", type=_positive, help="V, vocabulary size")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=_positive, default=3, help="timed repeats (median)")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)  # argparse turns a ValueError into "invalid _positive value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def resolve_device(name: str) -> torch.device:
    """``--device``: auto is CUDA where present, else CPU; cuda without a CUDA device is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (--device cpu, or leave it out)")
    return torch.device(name)


def _plain_pytorch(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def run(args: argparse.Namespace) -> int:
    console = make_console(width=120)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    n, d, v, dtype_name = DEFAULT_SIZES[device.type]
    n, d, v = args.tokens or n, args.hidden or d, args.vocab or v
    dtype = getattr(torch, args.dtype or dtype_name)
    if device.type == "cpu":
        measure.release_freed_memory_promptly()  # so that peak memory follows live tensors

    torch.manual_seed(0)
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device) / d**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device)
    targets[::8] = -100  # some ignored tokens, as padding would be

    console.print(
        f"[bold]fastalign demo[/]: loss of hidden [{n}, {d}] through an LM head [{v}, {d}], "
        f"{str(dtype).removeprefix('torch.')}, on {measure.device_name(device)}"
    )
    console.print("workspace: peak memory of one forward+backward above the inputs and their gradients")
    table = Table("implementation", "loss", "fwd+bwd (median)", "workspace", "logits held")
    results = {}
    for name, loss_fn, logits_held in (
        ("fastalign linear_cross_entropy", linear_cross_entropy, "none (chunks)"),
        ("PyTorch linear + cross_entropy", _plain_pytorch, f"[{n}, {v}]"),
    ):

        def step(loss_fn=loss_fn):
            hidden.grad = weight.grad = None
            loss = loss_fn(hidden, weight, targets)
            loss.backward()
            return loss

        loss = step()  # warm-up
        peak = measure.peak_extra_bytes(step, device)
        ms, spread = measure.time_ms(step, device, args.repeats)
        results[name] = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
        memory = "n/a" if peak is None else f"{peak / 2**20:,.0f} MiB"
        table.add_row(name, f"{loss.item():.6f}", f"{ms:,.1f} ms (±{spread:.0%})", memory, logits_held)
    console.print(table)

    (ours, plain) = results.values()
    for label, a, b in zip(("loss", "grad hidden", "grad weight"), ours, plain, strict=True):
        diff = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        console.print(f"relative difference in {label}: {diff:.2e}")
    return 0
