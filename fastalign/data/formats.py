"""TRL's dataset formats for SFT: which one a dataset is, and whether a row is well formed.

- language modeling: ``text`` (standard; ``dataset_text_field`` names another column) or ``messages``
  (conversational);
- prompt-completion: ``prompt`` and ``completion``, both strings (standard) or both lists of
  messages (conversational).

ShareGPT-style rows (``conversations``, messages with ``from`` and ``value``) are read as TRL's SFTTrainer
reads them (``as_chatml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class DatasetFormat:
    kind: Literal["language_modeling", "prompt_completion"]
    conversational: bool
    text_field: str = "text"  # the column of standard language-modeling rows (``dataset_text_field``)

    @property
    def columns(self) -> tuple[str, ...]:
        if self.kind == "prompt_completion":
            return ("prompt", "completion")
        return ("messages",) if self.conversational else (self.text_field,)


#: The columns whose messages ``as_chatml`` renames (TRL's ``maybe_convert_to_chatml``).
_MESSAGE_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "conversations")


def as_chatml(row: dict) -> dict:
    """``row`` as TRL's ``maybe_convert_to_chatml`` makes it: in each column of messages, a message's
    ``from`` is its ``role`` and its ``value`` its ``content``, and ``conversations`` is ``messages``
    (the roles are kept as written, as TRL keeps them). A row without them is returned as it is."""
    if not any(isinstance(row.get(key), list) for key in _MESSAGE_COLUMNS):
        return row
    converted = dict(row)
    for key in _MESSAGE_COLUMNS:
        if isinstance(row.get(key), list):
            converted[key] = [_chatml_message(message) for message in row[key]]
    if "conversations" in converted:
        converted["messages"] = converted.pop("conversations")
    return converted


def _chatml_message(message):
    if not isinstance(message, dict) or ("from" not in message and "value" not in message):
        return message
    return {{"from": "role", "value": "content"}.get(key, key): value for key, value in message.items()}


def detect_format(
    columns: list[str], first_row: dict, where: str | None = None, text_field: str = "text"
) -> DatasetFormat:
    """The format from the column names (and, for prompt-completion, the first row's types), in TRL's
    order: prompt-completion, then ``messages``, then ``text_field``. ``where`` names the first row in
    the error (e.g. ``"train.jsonl line 1"``)."""
    if "prompt" in columns and "completion" in columns:
        return DatasetFormat("prompt_completion", isinstance(first_row["prompt"], list))
    if "messages" in columns:
        return DatasetFormat("language_modeling", True)
    if text_field in columns:
        return DatasetFormat("language_modeling", False, text_field)
    raise ValueError(
        f"{where + ': ' if where else ''}the dataset has columns {sorted(columns)}; SFT needs "
        f"{text_field!r} (dataset_text_field), 'messages', or 'prompt' and 'completion'"
    )


def check_messages(messages, where: str, field: str) -> None:
    """A ValueError naming the row (``where``: ``"row 3"``, ``"train.jsonl line 4"``) and the field when
    ``messages`` is not a non-empty list of chat messages. A message that calls tools (``tool_calls``)
    may have no ``content``, as chat templates with tool support render it."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {field}[{position}] must be a message with a string 'content'")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(
                f"{where}: {field}[{position}] must be a message with a string 'content' (or 'tool_calls')"
            )
        if message.get("role") not in ROLES:
            role = message.get("role")
            hint = (
                " (ShareGPT's human and gpt: write them user and assistant)"
                if role in ("human", "gpt")
                else ""
            )
            raise ValueError(f"{where}: {field}[{position}] has role {role!r}; known: {ROLES}{hint}")


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
