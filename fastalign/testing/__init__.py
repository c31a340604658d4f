"""Tiny offline models, tokenizers and data sets for tests, demos and benchmarks: no hub access, ever."""

from fastalign.testing.datasets import (
    BUILTIN_DATASETS,
    digit_ratio,
    tiny_kto_rows,
    tiny_preference_rows,
    tiny_prompt_rows,
    tiny_sft_rows,
)
from fastalign.testing.models import TINY_MODEL_TYPES, tiny_config, tiny_model
from fastalign.testing.tokenizer import tiny_tokenizer

__all__ = [
    "BUILTIN_DATASETS",
    "TINY_MODEL_TYPES",
    "digit_ratio",
    "tiny_config",
    "tiny_kto_rows",
    "tiny_model",
    "tiny_preference_rows",
    "tiny_prompt_rows",
    "tiny_sft_rows",
    "tiny_tokenizer",
]
