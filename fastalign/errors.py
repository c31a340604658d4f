"""One-line error text: what every user-facing error of fastalign is (a CLI prints it after ``error:``)."""

from __future__ import annotations


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (library errors often span several), or its type's name when it
    has no message."""
    return " ".join(str(error).split()) or type(error).__name__
