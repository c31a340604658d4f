"""Micro-batches for causal-LM training: dynamic padding, or packing without padding.

Labels are the token ids where the loss mask is 1 and -100 elsewhere, unshifted (the model shifts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastalign.data.sft import TokenizedExample
from fastalign.models.structure import IGNORE_INDEX


def _labels(example: TokenizedExample) -> list[int]:
    return [
        token if keep else IGNORE_INDEX
        for token, keep in zip(example.input_ids, example.loss_mask, strict=True)
    ]


class PaddingCollator:
    """Right-pads to the longest example of the micro-batch: input_ids, attention_mask, labels."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[TokenizedExample]) -> dict[str, torch.Tensor]:
        width = max(len(example) for example in examples)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, example in enumerate(examples):
            length = len(example)
            input_ids[row, :length] = torch.tensor(example.input_ids)
            labels[row, :length] = torch.tensor(_labels(example))
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PackedCollator:
    """Concatenates the examples into one row with ``position_ids`` restarting at every example, and
    no padding. transformers derives a block-diagonal causal mask from such position_ids (when there
    is no attention mask and no KV cache: the batch carries ``use_cache=False``), so no token attends
    across examples; the first label of every example is -100 so that no example's last token is
    trained to predict the next example's first."""

    def __call__(self, examples: Sequence[TokenizedExample]) -> dict:
        input_ids, labels, positions = [], [], []
        for example in examples:
            input_ids += example.input_ids
            labels += [IGNORE_INDEX, *_labels(example)[1:]]
            positions += list(range(len(example)))
        return {
            "input_ids": torch.tensor([input_ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "use_cache": False,
        }
