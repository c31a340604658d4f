"""4-bit weights for QLoRA: ``FourBitLinear`` (FSDP2-shardable NF4/FP4 linear layers), quantizing a
model in place, loading a checkpoint layer by layer in 4 bits, and random 4-bit models of any shape."""

from fastalign.quant.four_bit_linear import (
    FourBitLinear,
    QuantOptions,
    dequantize_model,
    quantize_linear,
    quantize_model,
)
from fastalign.quant.loading import empty_4bit_model, fill_4bit_model, load_4bit_model, random_4bit_model

__all__ = [
    "FourBitLinear",
    "QuantOptions",
    "dequantize_model",
    "empty_4bit_model",
    "fill_4bit_model",
    "load_4bit_model",
    "quantize_linear",
    "quantize_model",
    "random_4bit_model",
]
