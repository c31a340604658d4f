"""4-bit weights in bitsandbytes' format (NF4 and FP4): dequantization and the QLoRA linear layer.

The format stays bitsandbytes' (``bitsandbytes.functional.quantize_4bit``), so checkpoints and
``Linear4bit`` layers are used as they are. For a weight ``w`` of ``shape``, flattened row-major::

    packed[j] = (q[2j] << 4) | q[2j + 1]              uint8, two 4-bit codes, the HIGH nibble first
    w[i]      = code[q[i]] · absmax[i // blocksize]   the product in fp32, rounded once to ``dtype``

``code`` is the 16-entry fp32 codebook (NF4: normal-float quantiles; FP4: a 1-sign 2-exponent 1-mantissa
float), ``absmax`` one fp32 scale per ``blocksize`` (64) elements. With double quantization
(``compress_statistics``) bitsandbytes stores ``absmax`` itself 8-bit: ``absmax`` is then uint8 codes and
``NestedAbsmax`` (bitsandbytes' ``QuantState.state2`` and ``QuantState.offset``) turns them back::

    absmax[b] = code2[absmax_q[b]] · absmax2[b // 256] + offset      (fp32, two roundings)

The Triton kernel is in ``fastalign/kernels/nf4.py``; ``dequantize_4bit_reference`` below is the
readable PyTorch implementation (and the CPU backend). Both give bitsandbytes' bits. (bitsandbytes
0.50's native CPU kernel is the exception: it takes absmax per row and goes wrong when a row is not a
whole number of blocks, e.g. 7×192 in blocks of 128; its CUDA kernel and portable path agree with this.)

``linear_4bit`` is ``x @ W^T + bias + scaling · (x @ A^T) @ B^T`` (a frozen 4-bit base weight and a LoRA
adapter). Its autograd.Function saves the packed bytes, never the dequantized weight: a saved dense
copy would keep every layer's full-size weight alive from forward to backward, which is the memory
4-bit training exists to avoid. Backward dequantizes again (a bandwidth-bound pass, cheap next to the
matmuls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from fastalign.ops.backend import Backend, resolve_backend

#: bitsandbytes' NF4 codebook (``get_4bit_type("nf4")``): quantiles of N(0, 1) scaled to [-1, 1].
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
#: bitsandbytes' FP4 codebook before normalization: bit 3 is the sign, then 2 exponent and 1 mantissa
#: bits (code 1 is the subnormal 0.0625; code 8, "-0", is +0.0 as in bitsandbytes' table); divided by the
#: largest, 12, in fp32 as ``get_4bit_type("fp4")`` does.
FP4_VALUES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)

QUANT_TYPES = ("nf4", "fp4")
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def code_table(quant_type: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16-entry fp32 codebook of ``quant_type`` ('nf4' or 'fp4'), bit-equal to bitsandbytes'."""
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    if quant_type == "fp4":
        values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
        return values / values.abs().max()
    raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")


@dataclass(frozen=True, eq=False)  # tensors inside: compare by identity
class NestedAbsmax:
    """Double quantization of the absmax (bitsandbytes' ``QuantState.state2`` plus ``.offset``).

    The 8-bit absmax codes themselves are the ``absmax`` passed beside this (bitsandbytes'
    ``QuantState.absmax``); this holds what turns them back into fp32 scales."""

    absmax: torch.Tensor  # fp32, one per `blocksize` absmax codes (state2.absmax)
    code: torch.Tensor  # fp32, 256 entries (state2.code: bitsandbytes' dynamic 8-bit map)
    offset: torch.Tensor  # fp32 scalar added after (QuantState.offset: the mean of the original absmax)
    blocksize: int = 256

    def to(self, device: torch.device | str) -> NestedAbsmax:
        return replace(
            self, absmax=self.absmax.to(device), code=self.code.to(device), offset=self.offset.to(device)
        )


@dataclass(frozen=True, eq=False)  # tensors inside: compare by identity
class FourBitState:
    """Everything besides the packed bytes that a 4-bit weight needs (bitsandbytes' ``QuantState``).

    ``absmax`` is fp32 per block, or uint8 codes when ``nested`` is set (double quantization)."""

    absmax: torch.Tensor
    code: torch.Tensor  # fp32, 16 entries
    shape: tuple[int, ...]  # the weight's shape: (out_features, in_features) for a linear layer
    dtype: torch.dtype  # the dtype the weight had when quantized (the default for dequantization)
    blocksize: int = 64
    quant_type: str = "nf4"
    nested: NestedAbsmax | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to(self, device: torch.device | str) -> FourBitState:
        nested = self.nested.to(device) if self.nested is not None else None
        return replace(self, absmax=self.absmax.to(device), code=self.code.to(device), nested=nested)

    def dequantize(
        self, packed: torch.Tensor, dtype: torch.dtype | None = None, *, backend: Backend = "auto"
    ) -> torch.Tensor:
        """The dense weight (``shape``, ``dtype`` or the original dtype)."""
        return dequantize_4bit(
            packed, self.absmax, self.code, self.shape, dtype or self.dtype, self.blocksize,
            nested=self.nested, backend=backend,
        )  # fmt: skip


def state_from_bitsandbytes(quant_state) -> FourBitState:
    """A ``FourBitState`` sharing the tensors of bitsandbytes' ``QuantState`` (``Params4bit.quant_state``)."""
    nested = None
    if quant_state.nested:
        state2 = quant_state.state2
        offset = torch.as_tensor(quant_state.offset, dtype=torch.float32, device=state2.absmax.device)
        nested = NestedAbsmax(
            absmax=state2.absmax, code=state2.code, offset=offset, blocksize=state2.blocksize
        )
    code = quant_state.code
    if code is None:
        code = code_table(quant_state.quant_type, quant_state.absmax.device)
    return FourBitState(
        absmax=quant_state.absmax, code=code, shape=tuple(quant_state.shape), dtype=quant_state.dtype,
        blocksize=quant_state.blocksize, quant_type=quant_state.quant_type, nested=nested,
    )  # fmt: skip


def quantize_4bit(
    weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = True
) -> tuple[torch.Tensor, FourBitState]:
    """(packed uint8 bytes, 1-D; state) of ``weight``, by ``bitsandbytes.functional.quantize_4bit``
    (``double_quant`` is its ``compress_statistics``). Needs the bitsandbytes package."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as error:
        raise ImportError(
            "fastalign.ops.quantize_4bit uses bitsandbytes to quantize (pip install bitsandbytes); "
            "dequantize_4bit and linear_4bit work without it"
        ) from error
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")
    packed, quant_state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    return packed.reshape(-1), state_from_bitsandbytes(quant_state)


def dequantize_absmax(absmax: torch.Tensor, nested: NestedAbsmax | None) -> torch.Tensor:
    """The fp32 per-block scales: ``absmax`` itself, or its double quantization undone (in PyTorch: it
    is 1/blocksize of the weight's size, and 8-bit blockwise like bitsandbytes' ``dequantize_blockwise``)."""
    if nested is None:
        return absmax.float()
    n = absmax.numel()
    blocks = nested.absmax.numel()
    if blocks != -(-n // nested.blocksize):
        raise ValueError(
            f"nested absmax: {n} codes in blocks of {nested.blocksize} need {-(-n // nested.blocksize)} "
            f"scales, got {blocks}"
        )
    values = nested.code.float()[absmax.reshape(-1).long()]
    values = F.pad(values, (0, blocks * nested.blocksize - n)).view(blocks, nested.blocksize)
    scaled = (values * nested.absmax.float().view(-1, 1)).reshape(-1)[:n]
    return scaled + nested.offset.float()


def dequantize_4bit_reference(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    blocksize: int = 64,
) -> torch.Tensor:
    """The PyTorch implementation (and the CPU backend): uint8 ``packed`` and fp32 ``absmax``."""
    n = math.prod(shape)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((code.float()[byte >> 4], code.float()[byte & 0xF]), dim=1)  # high nibble first
    values = pairs.index_select(0, packed.int()).view(-1)[:n]  # code[q[i]], i < n (drops a padding nibble)
    blocks = absmax.numel()
    if blocks * blocksize != n:  # a partial last block
        values = F.pad(values, (0, blocks * blocksize - n))
    values = values.view(blocks, blocksize) * absmax.view(-1, 1)
    return values.view(-1)[:n].to(dtype).view(shape)


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | str,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    blocksize: int = 64,
    *,
    nested: NestedAbsmax | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The dense ``shape`` weight in ``dtype`` (fp32, bf16 or fp16) from bitsandbytes' 4-bit format.

    ``packed``: the bytes, any shape (bitsandbytes keeps ``(n/2, 1)``) and any storage dtype (viewed as
    uint8). ``absmax``: fp32 per block of ``blocksize``; with ``nested``, its uint8 codes. ``code``: the
    16-entry codebook, or 'nf4' / 'fp4'. Equal, bit for bit, to ``bitsandbytes.functional.dequantize_4bit``.
    """
    shape = tuple(shape)
    n = math.prod(shape)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    if blocksize <= 0 or blocksize % 2:
        raise ValueError(f"blocksize must be a positive even number, got {blocksize}")
    packed = packed.reshape(-1)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)  # bitsandbytes' quant_storage may be another dtype
    if packed.numel() != -(-n // 2):
        raise ValueError(f"shape {shape} ({n} weights) needs {-(-n // 2)} packed bytes, got {packed.numel()}")
    if absmax.numel() != -(-n // blocksize):
        raise ValueError(
            f"shape {shape} in blocks of {blocksize} needs {-(-n // blocksize)} absmax, got {absmax.numel()}"
        )
    if nested is None and not absmax.is_floating_point():
        raise ValueError(f"absmax is {absmax.dtype}: pass `nested` to use double-quantized absmax codes")
    code = code_table(code, packed.device) if isinstance(code, str) else code.to(packed.device, torch.float32)
    if code.numel() != 16:
        raise ValueError(f"a 4-bit code table has 16 entries, got {code.numel()}")
    scales = dequantize_absmax(absmax, nested).reshape(-1).contiguous()
    if resolve_backend(backend, packed) == "torch":
        return dequantize_4bit_reference(packed, scales, code, shape, dtype, blocksize)
    from fastalign.kernels import nf4 as kernels

    return kernels.dequantize_4bit(packed.contiguous(), scales, code.contiguous(), n, blocksize, dtype).view(
        shape
    )


class _Linear4bitFunction(torch.autograd.Function):
    """y = x W^T + b + s · (x A^T) B^T with W = dequant(packed). Saved: the packed bytes, x (for the
    adapters' gradients), A, B and x A^T (rank r): never W, which backward dequantizes again.

        dx = dy W + s · (dy B) A         dA = s · (dy B)^T x
        dB = s · dy^T (x A^T)            db = Σ_tokens dy
    """

    @staticmethod
    def forward(ctx, x, packed, bias, lora_A, lora_B, state: FourBitState, scaling: float, backend: str):
        out_features, in_features = state.shape
        x2 = x.reshape(-1, in_features)
        weight = state.dequantize(packed, x.dtype, backend=backend)
        y = F.linear(x2, weight, None if bias is None else bias.to(x.dtype))
        del weight
        xa = None
        if lora_A is not None:
            xa = x2.to(lora_A.dtype) @ lora_A.t()
            y = y + (scaling * (xa @ lora_B.t())).to(y.dtype)
        ctx.state, ctx.scaling, ctx.backend = state, scaling, backend
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        need_x = lora_A is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        ctx.save_for_backward(packed, x if need_x else None, lora_A, lora_B, xa)
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy):
        packed, x, lora_A, lora_B, xa = ctx.saved_tensors
        state, scaling = ctx.state, ctx.scaling
        out_features, in_features = state.shape
        dy2 = dy.reshape(-1, out_features)
        dx = d_bias = d_A = d_B = None
        if ctx.needs_input_grad[0]:
            dx = dy2 @ state.dequantize(packed, dy.dtype, backend=ctx.backend)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            d_bias = dy2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if lora_A is not None:
            dy_lora = dy2.to(lora_B.dtype)
            d_xa = scaling * (dy_lora @ lora_B)  # [tokens, r]
            if ctx.needs_input_grad[0]:
                dx = dx + (d_xa @ lora_A).to(dx.dtype)
            if ctx.needs_input_grad[3]:
                d_A = d_xa.t() @ x.reshape(-1, in_features).to(lora_A.dtype)
            if ctx.needs_input_grad[4]:
                d_B = scaling * (dy_lora.t() @ xa.to(lora_B.dtype))  # xa is bf16 under autocast
        if dx is not None:
            dx = dx.view(*dy.shape[:-1], in_features)
        return dx, None, d_bias, d_A, d_B, None, None, None


def linear_4bit(
    x: torch.Tensor,
    packed: torch.Tensor,
    state: FourBitState,
    bias: torch.Tensor | None = None,
    lora_A: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    lora_scaling: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ lora_scaling · (x @ lora_A^T) @ lora_B^T)`` with W (out, in) held 4-bit.

    Computed in x's dtype (W dequantized straight into it, bias cast to it). The low-rank term is
    computed in the adapters' dtype (x cast to it) and cast back to x's dtype before the sum, as peft's
    ``Linear4bit`` LoRA does: fp32 adapters on bf16 activations keep an fp32 low-rank product. Gradients
    flow to x, bias, lora_A (r, in) and lora_B (out, r); never to the 4-bit weight. ``backend`` picks the
    dequantization (Triton kernel or PyTorch); the matmuls are PyTorch's. No LoRA dropout: apply it to x
    in a separate adapter call if needed.
    """
    if len(state.shape) != 2:
        raise ValueError(f"linear_4bit needs a 2-D (out, in) weight, got shape {state.shape}")
    out_features, in_features = state.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {tuple(state.shape)} takes {in_features}")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    if (lora_A is None) != (lora_B is None):
        raise ValueError("pass both lora_A and lora_B, or neither")
    if lora_A is not None:
        rank = lora_A.shape[0]
        if lora_A.shape != (rank, in_features) or lora_B.shape != (out_features, rank):
            raise ValueError(
                f"LoRA shapes must be A (r, {in_features}) and B ({out_features}, r), got "
                f"{tuple(lora_A.shape)} and {tuple(lora_B.shape)}"
            )
        if lora_A.dtype != lora_B.dtype:
            raise ValueError(f"lora_A and lora_B must share a dtype, got {lora_A.dtype} and {lora_B.dtype}")
    backend = resolve_backend(backend, x)
    return _Linear4bitFunction.apply(x, packed, bias, lora_A, lora_B, state, float(lora_scaling), backend)
