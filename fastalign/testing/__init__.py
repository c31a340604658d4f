"""Tiny offline models and tokenizers for tests, demos and benchmarks: no hub access, ever."""

from fastalign.testing.models import TINY_MODEL_TYPES, tiny_config, tiny_model
from fastalign.testing.tokenizer import tiny_tokenizer

__all__ = ["TINY_MODEL_TYPES", "tiny_config", "tiny_model", "tiny_tokenizer"]
