"""Datasets in TRL's formats (SFT, preference, KTO, prompt-only) → token ids → micro-batches."""

from fastalign.data.collate import PackedCollator, PaddingCollator
from fastalign.data.formats import DatasetFormat, detect_format
from fastalign.data.packing import (
    PACKING_STRATEGIES,
    pack_best_fit_decreasing,
    split_long_examples,
    wrap_examples,
)
from fastalign.data.preference import (
    KTOCollator,
    KTOExample,
    PreferenceCollator,
    PreferenceExample,
    PromptCollator,
    PromptExample,
    tokenize_kto_dataset,
    tokenize_preference_dataset,
    tokenize_prompt_dataset,
)
from fastalign.data.sft import TokenizedExample, tokenize_sft_dataset, tokenize_sft_row
from fastalign.data.sources import load_rows

__all__ = [
    "PACKING_STRATEGIES",
    "DatasetFormat",
    "KTOCollator",
    "KTOExample",
    "PackedCollator",
    "PaddingCollator",
    "PreferenceCollator",
    "PreferenceExample",
    "PromptCollator",
    "PromptExample",
    "TokenizedExample",
    "detect_format",
    "load_rows",
    "pack_best_fit_decreasing",
    "split_long_examples",
    "tokenize_kto_dataset",
    "tokenize_preference_dataset",
    "tokenize_prompt_dataset",
    "tokenize_sft_dataset",
    "tokenize_sft_row",
    "wrap_examples",
]
