"""Small built-in data sets, generated (no download): the default of ``fastalign train``."""

from __future__ import annotations

import random

_OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def tiny_sft_rows(count: int = 1024, seed: int = 0) -> list[dict]:
    """Prompt-completion rows of small arithmetic ("What is 3 plus 4?" → " The answer is 7."): the
    answer follows from the prompt, so a tiny model's loss visibly falls within a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(40), rng.randrange(1, 40)
        word = rng.choice(sorted(_OPERATIONS))
        rows.append(
            {"prompt": f"What is {a} {word} {b}?", "completion": f" The answer is {_OPERATIONS[word](a, b)}."}
        )
    return rows


#: Built-in data set names accepted as ``dataset_name``.
BUILTIN_DATASETS = {"tiny-sft": tiny_sft_rows}
