"""TRL's dataset formats for SFT: which one a dataset is, and whether a row is well formed.

- language modeling: ``text`` (standard) or ``messages`` (conversational);
- prompt-completion: ``prompt`` and ``completion``, both strings (standard) or both lists of
  messages (conversational).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class DatasetFormat:
    kind: Literal["language_modeling", "prompt_completion"]
    conversational: bool

    @property
    def columns(self) -> tuple[str, ...]:
        if self.kind == "prompt_completion":
            return ("prompt", "completion")
        return ("messages",) if self.conversational else ("text",)


def detect_format(columns: list[str], first_row: dict, where: str | None = None) -> DatasetFormat:
    """The format from the column names (and, for prompt-completion, the first row's types); ``where``
    names the first row in the error (e.g. ``"train.jsonl line 1"``)."""
    if "prompt" in columns and "completion" in columns:
        return DatasetFormat("prompt_completion", isinstance(first_row["prompt"], list))
    if "messages" in columns:
        return DatasetFormat("language_modeling", True)
    if "text" in columns:
        return DatasetFormat("language_modeling", False)
    raise ValueError(
        f"{where + ': ' if where else ''}the dataset has columns {sorted(columns)}; SFT needs 'text', "
        "'messages', or 'prompt' and 'completion'"
    )


def check_messages(messages, where: str, field: str) -> None:
    """A ValueError naming the row (``where``: ``"row 3"``, ``"train.jsonl line 4"``) and the field when
    ``messages`` is not a non-empty list of chat messages."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: {field}[{position}] must be a message with a string 'content'")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}: {field}[{position}] has role {message.get('role')!r}; known: {ROLES}")


def check_row(row: dict, where: str, fmt: DatasetFormat) -> None:
    """A ValueError naming the row (``where``) and the field when ``row`` does not fit ``fmt``."""
    for field in fmt.columns:
        value = row.get(field)
        if value is None:
            raise ValueError(f"{where}: missing {field!r}")
        if fmt.conversational:
            check_messages(value, where, field)
        elif not isinstance(value, str):
            raise ValueError(f"{where}: {field!r} must be text, got {type(value).__name__}")
        elif field != "prompt" and not value:
            raise ValueError(f"{where}: {field!r} is empty")
