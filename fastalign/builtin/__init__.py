"""The built-in models and data sets: what the ``tiny-<family>`` model names and the ``tiny-*`` data set
names of ``fastalign train`` (and so ``make demo``) resolve to — tiny random-weight models of every
supported family, an offline tokenizer, small generated data sets and a toy reward. Built in process, no
hub access, ever; the tests and benchmarks use them for the same reason."""

from fastalign.builtin.datasets import (
    BUILTIN_DATASETS,
    digit_ratio,
    tiny_kto_rows,
    tiny_preference_rows,
    tiny_prompt_rows,
    tiny_sft_rows,
)
from fastalign.builtin.models import TINY_MODEL_TYPES, tiny_config, tiny_model
from fastalign.builtin.tokenizer import tiny_tokenizer

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
