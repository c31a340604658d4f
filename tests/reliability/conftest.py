"""The bad-input suite (issue: nothing lost, nothing silent): every case is a faulty input given to the
CLI or the API, and asserts the exit code (or exception type), that the message is one line naming the
culprit, and that no file of an earlier run changed.

``bad_input`` runs one CLI case: ``fastalign <args>`` in-process, its stderr captured. ``earlier_run``
is a directory holding a finished tiny run's files; ``unchanged(earlier_run)`` is a snapshot to compare
with after the case ran.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastalign.cli.main import main


@dataclass
class Outcome:
    code: int
    message: str  # stderr, stripped


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by relative path → sha256 of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def bad_input(capsys) -> Callable[..., Outcome]:
    """``bad_input(*args, culprit=..., code=2)`` runs ``fastalign *args``, and asserts the exit code and
    a one-line ``error: ...`` message that contains ``culprit`` (case-insensitive); returns the outcome."""

    def run(*args: str, culprit: str, code: int = 2) -> Outcome:
        capsys.readouterr()
        got = main([str(arg) for arg in args])
        err = capsys.readouterr().err.strip()
        lines = [line for line in err.splitlines() if line.strip() and not _noise(line)]
        assert got == code, f"exit {got}, wanted {code}: {err[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
        assert culprit.lower() in lines[0].lower(), f"{culprit!r} not named in: {lines[0]}"
        return Outcome(got, lines[0])

    return run


def _noise(line: str) -> bool:
    """Library progress bars and warnings on stderr are not the error message."""
    return any(
        mark in line
        for mark in (
            "it/s]",
            "step/s]",
            "s/step]",
            "Warning",
            "warnings.warn",
            "Loading weights",
            "warning: ",
        )
    )


def assert_one_line_error(error: BaseException, culprit: str) -> None:
    """An API error: one line, naming ``culprit``."""
    text = str(error).strip()
    assert "\n" not in text, text
    assert culprit.lower() in text.lower(), f"{culprit!r} not named in: {text}"
