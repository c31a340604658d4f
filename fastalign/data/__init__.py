"""Datasets in TRL's formats → token ids and loss masks → padded or packed micro-batches."""

from fastalign.data.collate import PackedCollator, PaddingCollator
from fastalign.data.formats import DatasetFormat, detect_format
from fastalign.data.packing import pack_best_fit_decreasing
from fastalign.data.sft import TokenizedExample, tokenize_sft_dataset, tokenize_sft_row
from fastalign.data.sources import load_rows

__all__ = [
    "DatasetFormat",
    "PackedCollator",
    "PaddingCollator",
    "TokenizedExample",
    "detect_format",
    "load_rows",
    "pack_best_fit_decreasing",
    "tokenize_sft_dataset",
    "tokenize_sft_row",
]
