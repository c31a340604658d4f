"""What each ``TrainConfig`` key is, read from the comments beside its field in
``fastalign.train.config.fields``: the comments stay the one place a key is described, and ``fastalign
train <objective> --help`` and the docs pages (``fastalign.cli.usage``) show them. A field's doc is its
trailing comment and the comment lines right below it; a comment block after a blank line opens a
section, titled by its first words."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass

from fastalign.train.config.fields import TrainConfig

_FIELD = re.compile(r"^    (\w+): ")


@dataclass(frozen=True)
class KeyDoc:
    """One key: its type as annotated, its default, its section of ``TrainConfig`` and its doc."""

    name: str
    type: str
    default: object
    section: str
    doc: str


@functools.cache
def key_docs() -> dict[str, KeyDoc]:
    """Every ``TrainConfig`` key's ``KeyDoc``, in the fields' order."""
    comments: dict[str, list[str]] = {}
    sections: dict[str, str] = {}
    section, current, after_blank = "", None, False
    for line in inspect.getsource(TrainConfig).splitlines()[1:]:
        text = line.strip()
        if text.startswith("def "):
            break
        if not text:
            current, after_blank = None, True
            continue
        if text.startswith("#"):
            if current is not None:
                comments[current].append(text[1:].strip())
            elif after_blank:  # a section's first line: its title is up to a colon or parenthesis
                section = re.split(r"[:(]", text[1:], maxsplit=1)[0].strip()
            after_blank = False
            continue
        after_blank = False
        match = _FIELD.match(line)
        current = match.group(1) if match else None
        if current is not None:
            comments[current] = [line.split("  # ", 1)[1]] if "  # " in line else []
            sections[current] = section
    docs = {}
    for field in dataclasses.fields(TrainConfig):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        doc = " ".join(comments.get(field.name, []))
        docs[field.name] = KeyDoc(field.name, str(field.type), default, sections[field.name], doc)
    return docs
