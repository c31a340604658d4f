"""fastalign.ops.dequantize_4bit / linear_4bit: bit-equal to bitsandbytes, gradients against float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fastalign.ops import FourBitState, dequantize_4bit, linear_4bit, quantize_4bit, state_from_bitsandbytes
from fastalign.ops.nf4 import code_table
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, require

bnb = require("bitsandbytes.functional")

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, but for the sign of zero: FP4's code 8 is a "negative zero", which bitsandbytes' native
    CPU kernel (where the CPU has it) returns as -0.0 and its portable path, like ours, as +0.0. Adding
    +0.0 maps -0.0 to +0.0 and changes nothing else."""
    a, b = a + 0.0, b + 0.0
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))
    )


def _bnb_dequantize(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit, asked for the flattened weight and reshaped.

    The format indexes absmax by the flat element index (bitsandbytes' CUDA kernel and its portable
    PyTorch path do). bitsandbytes 0.50's native CPU kernel takes absmax per row instead and returns wrong
    values when a row is not a whole number of blocks (e.g. 7×192 in blocks of 128); on one flat row the
    two agree. Dynamo is off: odd element counts take bitsandbytes' torch.compile'd path, slow to compile.
    """
    flat = copy.copy(quant_state)
    flat.shape = torch.Size([math.prod(quant_state.shape)])
    with torch._dynamo.config.patch(disable=True):
        return bnb.dequantize_4bit(packed, flat).reshape(quant_state.shape)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_code_tables_match_bitsandbytes(quant_type):
    assert _same_bits(code_table(quant_type), bnb.get_4bit_type(quant_type, device="cpu"))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_high_nibble_is_the_first_element(quant_type, backend):
    # byte j = (j << 4) | (15 - j): the 32 weights are code[0], code[15], code[1], code[14], ...
    packed = torch.tensor([(j << 4) | (15 - j) for j in range(16)], dtype=torch.uint8, device=DEVICE)
    absmax = torch.tensor([2.0], device=DEVICE)
    out = dequantize_4bit(packed, absmax, quant_type, (32,), torch.float32, 32, backend=backend)
    code = code_table(quant_type, DEVICE)
    j = torch.arange(16, device=DEVICE)
    assert torch.equal(out, 2.0 * torch.stack((code[j], code[15 - j]), dim=1).reshape(-1))
    quant_state = bnb.QuantState(
        absmax=absmax.cpu(),
        shape=(32,),
        dtype=torch.float32,
        blocksize=32,
        code=code.cpu(),
        quant_type=quant_type,
    )
    assert _same_bits(out.cpu(), _bnb_dequantize(packed.cpu().view(-1, 1), quant_state))


SHAPES = [((3, 64), 64), ((7, 192), 128), ((64, 100), 64), ((64, 100), 128), ((5, 37), 64)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize(
    ("shape", "blocksize"), SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"b{v}"
)
def test_dequantize_equals_bitsandbytes(backend, quant_type, double_quant, shape, blocksize, dtype):
    weight = (torch.randn(shape) * 0.05).to(dtype)
    weight[0, :3] = torch.tensor([0.0, 40.0, -1e-3])  # a zero, a block with a large absmax, a tiny value
    packed, quant_state = bnb.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    assert quant_state.nested == double_quant
    expected = _bnb_dequantize(packed, quant_state)

    state = state_from_bitsandbytes(quant_state).to(DEVICE)
    out = dequantize_4bit(
        packed.to(DEVICE),
        state.absmax,
        state.code,
        shape,
        dtype,
        blocksize,
        nested=state.nested,
        backend=backend,
    )
    assert _same_bits(out.cpu(), expected)
    if dtype == torch.float32:  # into another dtype: the fp32 product rounded once
        bf16 = dequantize_4bit(
            packed.to(DEVICE),
            state.absmax,
            quant_type,
            shape,
            torch.bfloat16,
            blocksize,
            nested=state.nested,
            backend=backend,
        )
        assert _same_bits(bf16.cpu(), expected.to(torch.bfloat16))


def test_kernel_writes_every_element():
    from fastalign.kernels import nf4 as kernels

    packed = torch.randint(0, 256, (1001,), dtype=torch.uint8, device=DEVICE)  # 2001 weights: odd
    absmax = torch.rand(-(-2001 // 64), device=DEVICE) + 0.5
    code = code_table("nf4", DEVICE)
    out = torch.full((2001,), float("nan"), device=DEVICE)
    kernels.dequantize_4bit(packed, absmax, code, 2001, 64, torch.float32, block_bytes=256, out=out)
    with torch._dynamo.config.patch(disable=True):
        expected = torch.ops.bitsandbytes.dequantize_4bit(
            packed.cpu(), absmax.cpu(), 64, "nf4", (2001,), torch.float32
        )
    assert _same_bits(out.cpu(), expected)


def test_quantize_4bit_returns_flat_bytes_and_state():
    weight = torch.randn(48, 96)
    packed, state = quantize_4bit(weight)
    assert packed.shape == (48 * 96 // 2,) and packed.dtype == torch.uint8
    assert isinstance(state, FourBitState) and state.nested is not None and state.quant_type == "nf4"
    assert state.shape == (48, 96) and state.dtype == torch.float32 and state.blocksize == 64
    error = (state.dequantize(packed, backend="torch") - weight).norm() / weight.norm()
    assert error < 0.15  # 4-bit: about 10% relative error on a Gaussian


def test_dequantize_rejects_inconsistent_inputs():
    packed = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed bytes"):
        dequantize_4bit(packed, torch.ones(1), "nf4", (3, 64), torch.float32)
    with pytest.raises(ValueError, match="absmax"):
        dequantize_4bit(packed, torch.ones(2), "nf4", (64,), torch.float32)
    with pytest.raises(ValueError, match="nested"):
        dequantize_4bit(packed, torch.ones(1, dtype=torch.uint8), "nf4", (64,), torch.float32)
    with pytest.raises(ValueError, match="quant_type"):
        dequantize_4bit(packed, torch.ones(1), "int4", (64,), torch.float32)


def _layer(out_features, in_features, rank, dtype, lora_dtype):
    packed, state = quantize_4bit(torch.randn(out_features, in_features) / in_features**0.5)
    packed, state = packed.to(DEVICE), state.to(DEVICE)
    bias = torch.randn(out_features, device=DEVICE).to(dtype).requires_grad_()
    lora = None
    if lora_dtype is not None:
        lora_A = (torch.randn(rank, in_features, device=DEVICE) / in_features**0.5).to(lora_dtype)
        lora_B = (torch.randn(out_features, rank, device=DEVICE) / rank**0.5).to(lora_dtype)
        lora = (lora_A.requires_grad_(), lora_B.requires_grad_())
    return packed, state, bias, lora


@pytest.mark.parametrize("lora_dtype", [None, torch.float32, "x"], ids=["base", "lora-fp32", "lora-x-dtype"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_4bit_forward_and_backward_match_float64(backend, dtype, lora_dtype):
    lora_dtype = dtype if lora_dtype == "x" else lora_dtype
    scaling = 2.0
    packed, state, bias, lora = _layer(96, 160, 8, dtype, lora_dtype)
    x = torch.randn(2, 5, 160, device=DEVICE).to(dtype).requires_grad_()
    lora_A, lora_B = lora if lora else (None, None)
    out = linear_4bit(x, packed, state, bias, lora_A, lora_B, scaling, backend=backend)
    assert out.shape == (2, 5, 96) and out.dtype == dtype

    weight64 = state.dequantize(packed, torch.float32, backend="torch").double()
    leaves = [x, bias, *(lora or ())]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, bias64 = leaves64[:2]
    ref = x64 @ weight64.t() + bias64
    if lora:
        ref = ref + scaling * (x64 @ leaves64[2].t()) @ leaves64[3].t()
    assert_close_to_reference("out", out.detach(), ref.detach(), dtype)

    upstream = torch.randn(out.shape, device=DEVICE)
    (out.float() * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    for name, leaf, leaf64 in zip(["x", "bias", "lora_A", "lora_B"], leaves, leaves64, strict=False):
        assert leaf.grad.dtype == leaf.dtype, name
        assert_close_to_reference(f"grad {name}", leaf.grad, leaf64.grad, dtype)  # dy is in x's dtype


def test_linear_4bit_saves_packed_bytes_not_the_weight(backend):
    out_features, in_features = 256, 384
    packed, state, bias, (lora_A, lora_B) = _layer(
        out_features, in_features, 8, torch.bfloat16, torch.float32
    )
    x = torch.randn(4, in_features, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = linear_4bit(x, packed, state, bias, lora_A, lora_B, backend=backend)
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    dense_bytes = out_features * in_features * 2
    assert any(t.data_ptr() == packed.data_ptr() for t in saved), "the packed bytes are saved"
    assert all(t.numel() < out_features * in_features for t in saved), [tuple(t.shape) for t in saved]
    assert saved_bytes < 0.4 * dense_bytes, (saved_bytes, dense_bytes)
    out.float().sum().backward()
    assert (
        x.grad is not None and lora_A.grad is not None and lora_B.grad is not None and bias.grad is not None
    )


def test_linear_4bit_frozen_input_and_no_lora(backend):
    packed, state, _, _ = _layer(64, 128, 4, torch.float32, None)
    x = torch.randn(3, 128, device=DEVICE)
    out = linear_4bit(x, packed, state, backend=backend)
    assert not out.requires_grad
    torch.testing.assert_close(out, x @ state.dequantize(packed, backend="torch").t())


def test_linear_4bit_rejects_bad_shapes():
    packed, state, _, (lora_A, lora_B) = _layer(64, 128, 4, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="features"):
        linear_4bit(torch.randn(3, 64, device=DEVICE), packed, state)
    with pytest.raises(ValueError, match="both lora_A and lora_B"):
        linear_4bit(torch.randn(3, 128, device=DEVICE), packed, state, lora_A=lora_A)
    with pytest.raises(ValueError, match="LoRA shapes"):
        linear_4bit(torch.randn(3, 128, device=DEVICE), packed, state, lora_A=lora_A, lora_B=lora_B.t())


def test_other_quant_storage_and_bitsandbytes_packed_shape(backend):
    weight = torch.randn(32, 128)
    packed, quant_state = bnb.quantize_4bit(weight, quant_type="nf4", quant_storage=torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.shape[1] == 1  # FSDP-QLoRA's storage: viewed as bytes
    state = state_from_bitsandbytes(quant_state).to(DEVICE)
    out = state.dequantize(packed.to(DEVICE), backend=backend)
    with torch._dynamo.config.patch(disable=True):
        expected = bnb.dequantize_4bit(packed, quant_state)
    assert _same_bits(out.cpu(), expected)
