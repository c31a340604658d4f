"""bf16 and fp16 matrix products on a CPU that has no low-precision matrix units, run as fp32 GEMMs.

On an x86 CPU without AVX512-BF16 or AMX, PyTorch's bf16 GEMM is emulated, and slowly: on a 2-core AVX2
machine a [256, 1536] × [1536, 576] product takes 18–580 ms in bf16, depending on which operand is
transposed, and 4 ms in fp32. bf16 autocast there makes a training step of a real model 20–30× slower
than fp32 (TRL's default, ``bf16=True``, does exactly that on such a CPU).

``Fp32CpuGemms`` computes those products as fp32 GEMMs of the same bf16 operands and rounds the result
to bf16. That is the arithmetic of a bf16 GEMM (exact products of bf16 inputs, fp32 accumulation, one
rounding of the output): the two differ only in the order of the fp32 sums, by at most one bf16 unit
in the last place per output. Everything else autocast does (which ops run in bf16, the bf16
activations kept for backward, their memory) is unchanged. The backward of the CPU's flash attention,
4.5× slower in bf16 than in fp32 there, is computed the same way (its inputs widened, its gradients
rounded once).

It is a ``TorchDispatchMode``: below autograd, so it also catches the GEMMs of the backward pass, of
recomputation (gradient checkpointing) and of the fused heads. Whether a CPU needs it is measured, not
guessed (``low_precision_gemm_is_slow``): on a CPU with bf16 matrix units the native GEMM is faster
and is kept.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

LOW_PRECISION = (torch.bfloat16, torch.float16)
#: The GEMMs autocast and the fused heads issue (``linear`` and ``matmul`` decompose to these); the
#: in-place forms are computed out of place and copied back.
_FUNCTIONAL = {aten.mm: aten.mm, aten.addmm: aten.addmm, aten.bmm: aten.bmm, aten.baddbmm: aten.baddbmm}
_IN_PLACE = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}
_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
#: The most bytes one widened (fp32) operand piece may take: a larger operand, the LM head's [V, D]
#: weight say, is widened block by block, so the mode adds no [V, D] fp32 copy to the peak.
BLOCK_BYTES = 16 * 2**20
#: Emulation is used when the native GEMMs take this many times as long (a margin over timing noise).
SLOW_FACTOR = 1.5


def _low_precision_dtype(args, kwargs) -> torch.dtype | None:
    """The one low-precision dtype of every CPU tensor operand, or None (mixed, fp32, not on CPU)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or any(t.device.type != "cpu" for t in tensors):
        return None
    (dtype,) = dtypes
    return dtype if dtype in LOW_PRECISION else None


def _up(value):
    return value.float() if isinstance(value, torch.Tensor) else value


class Fp32CpuGemms(TorchDispatchMode):
    """Inside this mode, every bf16/fp16 ``mm``/``addmm``/``bmm``/``baddbmm`` on CPU tensors (their
    ``out=`` and in-place forms too) runs as an fp32 GEMM of the same operands, rounded once to the
    operands' dtype; so does the backward of the CPU's flash attention. Every other op, and every GEMM
    with fp32, mixed-dtype or non-CPU operands, runs as it would without the mode. ``count``: how many
    ops it widened."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ATTENTION_BACKWARD:
            return self._attention_backward(func, args, kwargs)
        packet = func.overloadpacket
        functional = _FUNCTIONAL.get(packet) or _IN_PLACE.get(packet)
        if functional is None or func._overloadname not in ("default", "out"):
            return func(*args, **kwargs)
        out = kwargs.get("out")
        inputs = {key: value for key, value in kwargs.items() if key != "out"}
        dtype = _low_precision_dtype(args, kwargs)
        if dtype is None:
            return func(*args, **kwargs)
        self.count += 1
        if packet is aten.mm:
            return _blocked_mm(*args, dtype, out)
        result = functional.default(*map(_up, args), **{k: _up(v) for k, v in inputs.items()}).to(dtype)
        if out is not None:
            return out.copy_(result)
        if packet in _IN_PLACE:
            return args[0].copy_(result)
        return result

    def _attention_backward(self, func, args, kwargs):
        """(grad_out, query, key, value, out, logsumexp, ...): the low-precision tensors widened (the
        logsumexp is fp32 already), the three gradients rounded to the query's dtype."""
        dtype = args[1].dtype
        if args[1].device.type != "cpu" or dtype not in LOW_PRECISION:
            return func(*args, **kwargs)

        def up(value):
            return value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype else value

        self.count += 1
        grads = func(*map(up, args), **{key: up(value) for key, value in kwargs.items()})
        return tuple(grad.to(dtype) for grad in grads)


def _blocked_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None):
    """``a @ b`` (a [M, K], b [K, N]) into ``out`` (or a new tensor) in ``dtype``, from fp32 pieces of
    at most ``BLOCK_BYTES``: the larger operand is cut along its other dimension (rows of ``a``,
    columns of ``b``; each output element is then the same fp32 dot product) or, when that dimension is
    the shorter one, along K, the pieces' products summed in fp32."""
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty(m, n, dtype=dtype) if out is None else out
    if max(a.numel(), b.numel()) * 4 <= BLOCK_BYTES:
        return out.copy_(torch.mm(a.float(), b.float()))
    if a.numel() >= b.numel() and m >= k:
        step, whole = max(1, BLOCK_BYTES // (4 * k)), b.float()
        for start in range(0, m, step):
            out[start : start + step] = torch.mm(a[start : start + step].float(), whole)
    elif a.numel() < b.numel() and n >= k:
        step, whole = max(1, BLOCK_BYTES // (4 * k)), a.float()
        for start in range(0, n, step):
            out[:, start : start + step] = torch.mm(whole, b[:, start : start + step].float())
    else:
        step, total = max(1, BLOCK_BYTES // (4 * max(m, n))), torch.zeros(m, n)
        for start in range(0, k, step):
            total.addmm_(a[:, start : start + step].float(), b[start : start + step].float())
        out.copy_(total)
    return out


def _best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


#: Decisions of ``low_precision_gemm_is_slow`` made elsewhere (``pin_low_precision_gemm``), by dtype.
_PINNED: dict[torch.dtype, bool] = {}


def pin_low_precision_gemm(dtype: torch.dtype, slow: bool) -> None:
    """Take ``slow`` as ``low_precision_gemm_is_slow(dtype)`` in this process from now on: the decision a
    resumed run's checkpoint recorded, or the one every process of a run agreed on. The native and the
    fp32 GEMMs round differently (by a bf16 unit at most), so a timing that came out otherwise in another
    process would part a resumed run, or the ranks, from the run as it began."""
    _PINNED[dtype] = slow


def low_precision_gemm_is_slow(dtype: torch.dtype) -> bool:
    """Whether this CPU's native ``dtype`` GEMMs take over ``SLOW_FACTOR`` times as long as fp32 GEMMs
    of the same operands (the three layouts of a linear layer's training step: forward, input
    gradient, weight gradient): pinned (``pin_low_precision_gemm``), else measured once per process, in
    about 0.1 s where they are slow."""
    return _PINNED[dtype] if dtype in _PINNED else _measured_slow(dtype)


@functools.cache
def _measured_slow(dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 512, generator=generator).to(dtype)
    w = torch.randn(384, 512, generator=generator).to(dtype)
    g = torch.randn(128, 384, generator=generator).to(dtype)

    def native():
        return x @ w.t(), g @ w, g.t() @ x

    def emulated():
        with Fp32CpuGemms():
            return native()

    native(), emulated()  # warm-up
    return _best_seconds(native) > SLOW_FACTOR * _best_seconds(emulated)


def cpu_gemms(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``Fp32CpuGemms`` where it is needed: on a CPU whose native ``dtype`` (bf16/fp16) GEMMs are slow
    (measured); otherwise, and for fp32 (``dtype`` None or float32), nothing."""
    if device.type != "cpu" or dtype not in LOW_PRECISION or not low_precision_gemm_is_slow(dtype):
        return contextlib.nullcontext()
    return Fp32CpuGemms()
