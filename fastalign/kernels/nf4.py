"""Triton dequantization of bitsandbytes' 4-bit weights (NF4 and FP4 codebooks).

The format (bitsandbytes' ``quantize_4bit``, verified against bitsandbytes 0.50 on CPU):

    packed[j] = (q[2j] << 4) | q[2j + 1]       two 4-bit codes per byte, the HIGH nibble first
    w[i]      = code[q[i]] · absmax[i // blocksize]

with ``w`` the row-major flattened weight, ``code`` the 16-entry fp32 codebook and ``absmax`` one fp32
scale per block of ``blocksize`` consecutive elements (the last block may be partial; an odd element
count leaves the last low nibble as padding). The product is taken in fp32 and rounded once to the
output dtype, as bitsandbytes does, so the result has the same bits.

Each program reads a tile of BLOCK_BYTES bytes, their absmax (both nibbles of a byte share a block:
blocksize is even) and the codebook (16 entries, cache resident), and writes the tile's
2·BLOCK_BYTES outputs as a [BLOCK_BYTES, 2] tile, contiguous in memory. Floor: memory traffic, n/2
bytes read plus n·itemsize written (plus n/blocksize · 4 bytes of absmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round_to_bf16_bits(x):
    """fp32 → the nearest bf16 value (ties to even), still held in fp32.

    Done on the bits so that the later ``.to(tl.bfloat16)`` is exact: the GPU rounds to nearest even
    anyway, but the interpreter truncates, and the kernel must give bitsandbytes' bits on both.
    Values past bf16's largest finite round to Inf, as they should; NaN is passed through."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = (bits >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _dequantize_4bit_kernel(
    packed_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    n_bytes,
    n_out,
    BLOCKSIZE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    byte = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    byte_mask = byte < n_bytes
    packed = tl.load(packed_ptr + byte, mask=byte_mask, other=0).to(tl.int32)
    # One scale per byte: elements 2j and 2j+1 lie in one block since BLOCKSIZE is even.
    absmax = tl.load(absmax_ptr + (byte * 2) // BLOCKSIZE, mask=byte_mask, other=0.0).to(tl.float32)

    nibble = tl.arange(0, 2)  # 0: high nibble (element 2j), 1: low nibble (element 2j + 1)
    q = (packed[:, None] >> (4 - 4 * nibble[None, :])) & 0xF
    value = tl.load(code_ptr + q).to(tl.float32) * absmax[:, None]
    if ROUND_BF16:
        value = _round_to_bf16_bits(value)

    out = byte[:, None] * 2 + nibble[None, :]
    tl.store(out_ptr + out, value.to(out_ptr.dtype.element_ty), mask=out < n_out)


def _block_bytes(n_bytes: int) -> int:
    return max(16, min(2048, triton.next_power_of_2(n_bytes)))


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    numel: int,
    blocksize: int,
    dtype: torch.dtype,
    block_bytes: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``numel`` weights (1-D, ``dtype``) held by contiguous uint8 ``packed`` (``ceil(numel/2)``
    bytes), fp32 ``absmax`` (``ceil(numel/blocksize)``) and the 16-entry fp32 ``code``.

    ``block_bytes`` (a power of two) sets the tile; ``out`` (contiguous, ``numel`` of ``dtype``) receives
    the result if given.
    """
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    if blocksize <= 0 or blocksize % 2:
        raise ValueError(f"blocksize must be a positive even number, got {blocksize}")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed.device)
    elif out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of {numel} elements")
    if numel == 0:
        return out
    n_bytes = packed.numel()
    block = block_bytes or _block_bytes(n_bytes)
    _dequantize_4bit_kernel[(triton.cdiv(n_bytes, block),)](
        packed,
        absmax,
        code,
        out,
        n_bytes,
        numel,
        BLOCKSIZE=blocksize,
        BLOCK_BYTES=block,
        ROUND_BF16=dtype == torch.bfloat16,
    )
    return out
