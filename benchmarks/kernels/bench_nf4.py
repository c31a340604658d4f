"""NF4 4-bit weights: dequantization, and the QLoRA linear layer ``linear_4bit`` forward+backward.

    python benchmarks/kernels/bench_nf4.py --preset gpu   # Llama-3-8B and 70B linear shapes, bf16
    python benchmarks/kernels/bench_nf4.py --preset cpu   # small shapes (quick: tiny ones)

Weights are NF4 with double quantization, blocksize 64, as QLoRA stores them (bitsandbytes' format).

Dequantization rows ("dequant out×in", into bf16; no backward, so fwd+bwd is the forward again):
fastalign-triton (the kernel, CUDA), torch-eager (fastalign's PyTorch implementation), bitsandbytes
(``bitsandbytes.functional.dequantize_4bit``). Floor: the bytes a dequantization must move, n/2 packed
read + n·2 written + n/64 absmax codes, at the copy bandwidth measured on the device.

Linear rows ("linear N×in→out r=16"): y = x W^T + 2·(x A^T) B^T with fp32 LoRA A, B and backward to x,
A and B: fastalign-triton / fastalign-torch (``linear_4bit``: saves the packed bytes, dequantizes again
in backward), bitsandbytes (``bitsandbytes.matmul_4bit`` plus the adapters as peft adds them: the same
recompute strategy), torch-eager (bitsandbytes' dequantization, then ``F.linear`` under autograd, which
keeps the dense W alive until backward). ``saved_mib`` is what autograd holds between forward and
backward through saved tensors (bitsandbytes keeps its packed weight on the context instead, which this
figure leaves out). Floor: the larger of 4·N·in·out + 6·N·r·(in + out) FLOPs (forward, dx, and the
adapters; no weight gradient) at the measured matmul peak and two dequantizations' bytes at the copy
bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign.bench import measure
from fastalign.ops import linear_4bit, state_from_bitsandbytes

RANK, SCALING = 16, 2.0
PRESETS = {
    # Llama-3-8B: q/o 4096², gate/up 14336×4096, down 4096×14336; Llama-3-70B: gate/up 28672×8192, down.
    "gpu": {
        "dtype": "bfloat16",
        "dequant": [(4096, 4096), (14336, 4096), (28672, 8192)],
        "linear": [(8192, 4096, 14336), (8192, 14336, 4096), (4096, 8192, 28672), (4096, 28672, 8192)],
        "repeats": 0,
    },
    "cpu": {
        "dtype": "bfloat16",
        "dequant": [(1024, 1024), (2816, 1024)],
        "linear": [(256, 1024, 2816)],
        "repeats": 5,
    },
    "quick": {"dtype": "bfloat16", "dequant": [(256, 256)], "linear": [(64, 256, 512)], "repeats": 5},
}
CUDA_ONLY = ("fastalign-triton",)


def _quantized(out_features: int, in_features: int, device: torch.device):
    """(packed bytes, bitsandbytes' QuantState, fastalign's FourBitState sharing its tensors)."""
    import bitsandbytes.functional as bnb_functional

    weight = torch.randn(out_features, in_features, device=device) / in_features**0.5
    packed, quant_state = bnb_functional.quantize_4bit(
        weight, blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    return packed, quant_state, state_from_bitsandbytes(quant_state)


def dequant_providers() -> dict:
    import bitsandbytes.functional as bnb_functional

    def fastalign(backend):
        return lambda packed, quant_state, state, dtype: state.dequantize(packed, dtype, backend=backend)

    return {
        "fastalign-triton": fastalign("triton"),
        "torch-eager": fastalign("torch"),
        "bitsandbytes": lambda packed, quant_state, state, dtype: bnb_functional.dequantize_4bit(
            packed, quant_state
        ).to(dtype),
    }


def linear_providers() -> dict:
    import bitsandbytes
    import bitsandbytes.functional as bnb_functional

    def lora(x, lora_A, lora_B):  # as peft adds an adapter to a 4-bit layer: in the adapters' dtype
        return (SCALING * (x.to(lora_A.dtype) @ lora_A.t()) @ lora_B.t()).to(x.dtype)

    def fastalign(backend):
        def run(x, packed, quant_state, state, lora_A, lora_B):
            return linear_4bit(x, packed, state, None, lora_A, lora_B, SCALING, backend=backend)

        return run

    def bnb_matmul(x, packed, quant_state, state, lora_A, lora_B):
        return bitsandbytes.matmul_4bit(x, packed.t(), quant_state) + lora(x, lora_A, lora_B)

    def dequant_then_linear(x, packed, quant_state, state, lora_A, lora_B):
        weight = bnb_functional.dequantize_4bit(packed, quant_state).to(x.dtype)
        return F.linear(x, weight) + lora(x, lora_A, lora_B)

    return {
        "fastalign-triton": fastalign("triton"),
        "fastalign-torch": fastalign("torch"),
        "bitsandbytes": bnb_matmul,
        "torch-eager": dequant_then_linear,
    }


def _saved_mib(fn) -> float:
    """MiB autograd holds for backward after one forward of ``fn``."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    del out
    return round(sum(sizes) / 2**20, 2)


def _dequant_rows(preset, providers, skipped, rows, bandwidth, device, dtype):
    for out_features, in_features in preset["dequant"]:
        torch.manual_seed(0)
        packed, quant_state, state = _quantized(out_features, in_features, device)
        n = out_features * in_features
        floor_ms = (n // 2 + n * dtype.itemsize + n // 64) / (bandwidth * 1e9) * 1e3
        shape = f"dequant {out_features}×{in_features}"
        for name, fn in providers.items():
            if name in skipped:
                continue

            def forward(fn=fn, inputs=(packed, quant_state, state, dtype)):
                return fn(*inputs)

            row = {"provider": name, "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
            row |= common.step_figures(forward, forward, device, preset["repeats"])
            rows.append(common.add_floor(row, floor_ms))
            print(json.dumps(rows[-1]), flush=True)


def _linear_step(fn, inputs):
    """(forward, forward+backward with an upstream gradient of ones) of a linear provider."""
    x, _, _, _, lora_A, lora_B = inputs

    def forward():
        return fn(*inputs)

    def forward_backward():
        x.grad = lora_A.grad = lora_B.grad = None
        out = forward()
        out.backward(torch.ones_like(out))

    return forward, forward_backward


def _linear_rows(preset, providers, skipped, rows, bandwidth, tflops, device, dtype):
    for tokens, in_features, out_features in preset["linear"]:
        torch.manual_seed(0)
        packed, quant_state, state = _quantized(out_features, in_features, device)
        x = torch.randn(tokens, in_features, device=device, dtype=dtype, requires_grad=True)
        lora_A = (torch.randn(RANK, in_features, device=device) / in_features**0.5).requires_grad_()
        lora_B = (torch.randn(out_features, RANK, device=device) / RANK**0.5).requires_grad_()
        n = out_features * in_features
        flops = 4 * tokens * n + 6 * tokens * RANK * (in_features + out_features)
        dequant_bytes = 2 * (n // 2 + n * dtype.itemsize + n // 64)
        floor_ms = max(flops / (tflops * 1e12), dequant_bytes / (bandwidth * 1e9)) * 1e3
        shape = f"linear {tokens}×{in_features}→{out_features} r={RANK}"
        for name, fn in providers.items():
            if name in skipped:
                continue

            forward, forward_backward = _linear_step(fn, (x, packed, quant_state, state, lora_A, lora_B))
            try:
                row = {"provider": name, "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
                row |= common.step_figures(forward, forward_backward, device, preset["repeats"])
                row["saved_mib"] = _saved_mib(forward)
            except torch.OutOfMemoryError as error:
                skipped[f"{name} {shape}"] = f"out of memory: {str(error)[:120]}"
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(common.add_floor(row, floor_ms))
            print(json.dumps(rows[-1]), flush=True)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--only", choices=["dequant", "linear"], help="one of the two row kinds")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: all)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, preset["dtype"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()
    bandwidth = common.copy_bandwidth_gbps(device)
    tflops = common.matmul_tflops(device, dtype)
    dequant, linear = dequant_providers(), linear_providers()
    names = common.select_providers("nf4", dict.fromkeys([*dequant, *linear]), args.providers)
    dequant = {name: fn for name, fn in dequant.items() if name in names}
    linear = {name: fn for name, fn in linear.items() if name in names}
    skipped = {name: "needs CUDA" for name in CUDA_ONLY if device.type != "cuda" and name in names}
    rows: list[dict] = []
    with common.keep_rows_on_termination(skipped):
        if args.only in (None, "dequant"):
            _dequant_rows(preset, dequant, skipped, rows, bandwidth, device, dtype)
        if args.only in (None, "linear"):
            _linear_rows(preset, linear, skipped, rows, bandwidth, tflops, device, dtype)
    return common.record(
        suite="kernels", kernel="nf4", preset=args.preset,
        floor="dequant rows: n/2 + 2n + n/64 bytes at the copy bandwidth (no backward: fwd+bwd = fwd); "
        "linear rows: max(4·N·in·out + 6·N·r·(in+out) FLOPs at the matmul peak, two dequantizations' bytes)",
        ceiling={"matmul_tflops": round(tflops, 3), "copy_bandwidth_gbps": round(bandwidth, 1)},
        device=device, rows=rows, skipped=skipped, out_dir=args.out, spread=common.SPREAD,
    )  # fmt: skip


if __name__ == "__main__":
    main()
