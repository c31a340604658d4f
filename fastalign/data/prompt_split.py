"""A prompt and its completions as token ids, split where TRL 1.16's SFT, DPO and KTO trainers split them.

Tokenizing the prompt and the completion apart is not tokenizing their concatenation: a byte-level BPE
merges a prompt's trailing space into the completion's first word, and some chat templates render a
prompt alone (with the generation prompt) otherwise than inside the whole conversation. TRL tokenizes the
prompt alone and the prompt + completion together, and the completion starts where the two first differ
(``common_prefix_length``). So the training sequence is always the whole row's own tokenization, and
where the prompt alone had more tokens, its end is left out of the sequence (a warning says so once per
data set, with what to change).

Plain text is tokenized as TRL's ``tokenizer(text)``: with the special tokens a tokenizer puts before a
text of its own accord (a Llama-style BOS, ``special_prefix``), and each completion ends with EOS.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from fastalign.data.chat import conversation_prompt_ids, render_chat

logger = logging.getLogger(__name__)


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a plain text of its own accord: the BOS of Llama, Mistral and
    Gemma tokenizers, nothing for GPT-2-like ones. TRL's SFT, DPO and KTO trainers tokenize plain text
    as ``tokenizer(text)``, so their sequences start with it (chat templates write their own)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    return list(full[: starts[0]]) if starts else []


def with_prefix(prefix: list[int], ids: list[int]) -> list[int]:
    """``ids`` starting with ``prefix`` (added unless already there)."""
    return ids if ids[: len(prefix)] == prefix else [*prefix, *ids]


def with_eos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """``ids`` ending with the tokenizer's EOS: appended unless already last (TRL appends the EOS text
    unless the text ends with it), nothing for a tokenizer without one."""
    eos = tokenizer.eos_token_id
    return ids if eos is None or ids[-1:] == [eos] else [*ids, eos]


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A text's own tokens, no special tokens added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def common_prefix_length(ids: Sequence, other: Sequence) -> int:
    """How many leading items ``ids`` and ``other`` share."""
    length = 0
    while length < min(len(ids), len(other)) and ids[length] == other[length]:
        length += 1
    return length


@dataclass(frozen=True)
class Split:
    """A row's prompt tokens and each completion's, ``prompt_ids + completions[field]`` being the
    tokenization of prompt + that completion; ``left_out``: the end of the prompt's own tokenization that
    the sequences do not have (empty where the prompt's tokens are a prefix of every sequence's).
    ``shared``: how many of each completion's first tokens are still the prompt's own (0 but where the
    completions diverge from the prompt at different places; TRL's CPO trainer does not score them)."""

    prompt_ids: list[int]
    completions: dict[str, list[int]]
    left_out: list[int]
    shared: dict[str, int]


def split_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict],
    completions: dict[str, str | list[dict]],
    where: str,
    *,
    template: dict | None = None,
    prefix: list[int] | None = None,
) -> Split:
    """TRL's split of one row: the prompt's own tokens, then each prompt + completion tokenized whole;
    the completions start where the prompt's tokens and the one that diverges earliest first differ (DPO's
    chosen and rejected share their prompt). Plain text starts with ``prefix`` (``special_prefix``) and
    its completions end with EOS; messages are rendered by the chat template with ``template`` (the row's
    ``template_arguments``), the prompt with the generation prompt. A ValueError names the row for an
    empty completion."""
    for name, completion in completions.items():
        if not completion:
            raise ValueError(f"{where}: {name!r} is empty")
    if isinstance(prompt, str):
        prefix = prefix or []
        prompt_ids = with_prefix(prefix, text_ids(tokenizer, prompt))
        whole = {
            name: with_eos(tokenizer, with_prefix(prefix, text_ids(tokenizer, prompt + completion)))
            for name, completion in completions.items()
        }
    else:
        prompt_ids = conversation_prompt_ids(tokenizer, prompt, template)
        whole = {
            name: list(render_chat(tokenizer, prompt + completion, **(template or {}))["input_ids"])
            for name, completion in completions.items()
        }
    own = {name: common_prefix_length(prompt_ids, ids) for name, ids in whole.items()}
    length = min(own.values())
    for name, ids in whole.items():
        if len(ids) == own[name]:
            raise ValueError(f"{where}: prompt + {name!r} has no tokens after the prompt's")
    return Split(
        prompt_ids[:length],
        {name: ids[length:] for name, ids in whole.items()},
        prompt_ids[length:],
        {name: own[name] - length for name in whole},
    )


@dataclass
class BoundaryNotes:
    """The rows of one data set whose prompt tokens are not a prefix of their sequences: counted while
    tokenizing, said once at the end (``warn``), with the first row's left-out tokens."""

    rows: int = 0
    first: tuple[str, list[int]] | None = None
    seen: int = 0

    def note(self, split: Split, where: str) -> Split:
        self.seen += 1
        if split.left_out:
            self.rows += 1
            self.first = self.first or (where, split.left_out)
        return split

    def warn(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if self.first is None:
            return
        where, left_out = self.first
        logger.warning(
            f"fastalign: in {self.rows} of {self.seen} rows the prompt's own tokens are not a prefix of "
            f"prompt + completion's (first {where}, whose sequence lacks the prompt's end "
            f"{tokenizer.decode(left_out)!r}): a token spans the boundary (a prompt ending in a space) or "
            "the chat template renders the prompt alone otherwise. As TRL does, each completion starts where "
            "the two differ, so the model trains on a context it does not see at inference: end prompts on "
            "a token boundary, or use a template that renders the prompt alike in both"
        )
