"""TRL's preference format as a reward model reads it (``RewardTrainer``) → token ids → micro-batches.

A reward model scores whole sequences, so a row's prompt and completion are not kept apart as for DPO:
each of chosen and rejected becomes one sequence, the prompt (explicit, or implicit: part of both) then
the completion, tokenized as TRL's ``RewardTrainer`` tokenizes it:

- standard text: ``prompt + chosen`` as one text, the EOS text appended to the completion unless it
  already ends with it, through the tokenizer's own call (special tokens added, e.g. a BOS);
- conversational: the chat template's rendering of ``prompt + chosen`` (no generation prompt), with the
  row's ``tools`` and ``chat_template_kwargs`` columns over the config's ``chat_template_kwargs``.

An optional ``margin`` column (a number per row; all rows or none) is the Bradley–Terry margin the
loss subtracts. ``max_length`` filters, as TRL does: a pair whose chosen or rejected sequence is longer
is left out (and counted in a warning), never cut.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedTokenizerBase

from fastalign.data.chat import render_chat, template_arguments
from fastalign.data.preference import _is_conversational, _nonempty

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardExample:
    chosen_ids: list[int]  # the whole chosen sequence (prompt and completion)
    rejected_ids: list[int]
    margin: float | None = None  # the row's ``margin`` column, if the data set has one


def _sequence_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list | None, completion: str | list, template: dict
) -> list[int]:
    """One side of a pair as TRL's RewardTrainer tokenizes it (see the module's docstring)."""
    if isinstance(completion, list):
        return list(render_chat(tokenizer, (prompt or []) + completion, **template)["input_ids"])
    eos = tokenizer.eos_token
    if eos is not None and not completion.endswith(eos):
        completion += eos
    return list(tokenizer((prompt or "") + completion)["input_ids"])


def _margin(row: dict, where: str) -> float | None:
    margin = row.get("margin")
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"{where}: 'margin' must be a finite number, got {margin!r}")
    return float(margin)


def tokenize_reward_dataset(
    rows: Iterable[dict],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int | None,
    chat_template_kwargs: dict | None = None,
) -> list[RewardExample]:
    """Every row of a preference dataset (explicit or implicit prompt, standard or conversational) as a
    chosen and a rejected sequence; pairs with a side over ``max_length`` tokens are left out. A
    ValueError names the row for a malformed one, and is raised when no pair is left."""
    examples = []
    named = _nonempty(rows, ("prompt", "chosen", "rejected"), chat_template_kwargs)
    with_margin = [row.get("margin") is not None for row, _ in named]
    if any(with_margin) and not all(with_margin):
        where = named[with_margin.index(False)][1]
        raise ValueError(f"{where}: missing 'margin' (other rows have one: all rows need one, or none)")
    for row, where in named:
        explicit = row.get("prompt") is not None
        fields = ("prompt", "chosen", "rejected") if explicit else ("chosen", "rejected")
        conversational = _is_conversational(row, where, fields)
        template = template_arguments(row, where, chat_template_kwargs) if conversational else {}
        prompt = row.get("prompt")
        chosen, rejected = (
            _sequence_ids(tokenizer, prompt, row[field], template) for field in ("chosen", "rejected")
        )
        if max_length is not None and max(len(chosen), len(rejected)) > max_length:
            continue
        examples.append(RewardExample(chosen, rejected, _margin(row, where)))
    dropped = len(named) - len(examples)
    if not examples:
        raise ValueError(
            f"every one of the {len(named)} pairs has a chosen or rejected sequence over "
            f"max_length={max_length} tokens (left out, as TRL's RewardTrainer filters them): "
            "raise max_length"
        )
    if dropped:
        logger.warning(
            "fastalign: %d of %d pairs left out: a chosen or rejected sequence over max_length=%d tokens",
            dropped,
            len(named),
            max_length,
        )
    return examples


class RewardCollator:
    """P pairs → 2P right-padded rows: the chosen sequences in rows 0..P-1, the rejected in P..2P-1
    (``input_ids``, ``attention_mask``); plus ``margin`` [P] when the examples have one."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[RewardExample]) -> dict[str, torch.Tensor]:
        rows = [torch.tensor(e.chosen_ids) for e in examples] + [
            torch.tensor(e.rejected_ids) for e in examples
        ]
        batch = {
            "input_ids": pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id),
            "attention_mask": pad_sequence([torch.ones_like(row) for row in rows], batch_first=True),
        }
        if examples[0].margin is not None:
            batch["margin"] = torch.tensor([e.margin for e in examples], dtype=torch.float32)
        return batch
