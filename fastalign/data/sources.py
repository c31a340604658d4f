"""Local dataset files (JSON Lines, a JSON array, Parquet; a file or a directory of them) or in-memory
rows → ``Rows``: the rows as plain dicts, and where each came from. Nothing is fetched here: Hub dataset
ids are ``fastalign.train.loading.load_dataset_rows``'s.

JSON is parsed here, line by line, rather than by ``datasets``: every value arrives exactly as written
(``datasets`` infers one type per column and rewrites a mixed column, so the strings "9", "null" and
"true" became 9, None and True). Parquet files keep their own schema's types. Every problem is a one-line
ValueError naming the file, and for JSON the 1-based line, as an editor shows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from fastalign.errors import one_line

_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


class Rows(list):
    """A data set's rows (dicts) and, for each, where it came from (``origins[i]``, e.g.
    ``"data/train.jsonl line 7"``), which the tokenizers name in their errors. A plain list of rows is
    named by its 0-based index instead (``"row 3"``), as ``rows[3]`` and a Hub dataset's ``dataset[3]``
    are."""

    def __init__(self, rows: Iterable[dict], origins: Sequence[str]):
        super().__init__(rows)
        if len(origins) != len(self):
            raise ValueError(f"{len(origins)} origins for {len(self)} rows")
        self.origins: list[str] = list(origins)


def row_origins(rows: Sequence[dict]) -> list[str]:
    """What errors call each row: its file and line for ``Rows`` from files, else ``row <index>``."""
    if isinstance(rows, Rows):
        return list(rows.origins)
    return [f"row {index}" for index in range(len(rows))]


def load_rows(source: str | Path | list[dict]) -> Rows:
    """Rows from a local file or directory, or a list of dicts; a clear ValueError otherwise."""
    if isinstance(source, list):
        if not source:
            raise ValueError("the dataset is empty (an empty list of rows)")
        return Rows(source, row_origins(source))
    path = Path(source)
    if not path.exists():
        raise ValueError(f"dataset_name {str(source)!r} is not a local file or directory (no hub access)")
    files = (
        sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _JSON_SUFFIXES + _PARQUET_SUFFIXES)
        if path.is_dir()
        else [path]
    )
    if not files:
        raise ValueError(f"dataset directory {str(path)!r} holds no .jsonl, .json or .parquet file")
    suffixes = {p.suffix for p in files}
    if not (suffixes <= set(_JSON_SUFFIXES) or suffixes <= set(_PARQUET_SUFFIXES)):
        raise ValueError(f"dataset files must all be JSONL/JSON or all Parquet, got {sorted(suffixes)}")
    rows, origins, first = [], [], None
    for file in files:
        file_rows, file_origins = _read_parquet(file) if file.suffix == ".parquet" else _read_json(file)
        kind = _kind(file_rows[0])
        if first is None:
            first = (file, kind)
        elif kind != first[1]:
            raise ValueError(
                f"dataset directory {str(path)!r} mixes row formats: {first[0].name} holds {first[1]} rows "
                f"but {file.name} {kind} rows; one data set has one format"
            )
        rows += file_rows
        origins += file_origins
    # Every row gets every column of the data set, None where it has no value, as in a table (and as
    # ``datasets`` loads JSON): a column that only some rows have still reaches the reward functions.
    names = list(dict.fromkeys(name for row in rows for name in row))
    rows = [row if len(row) == len(names) else {name: row.get(name) for name in names} for row in rows]
    return Rows(rows, origins)


def _kind(row: dict) -> str:
    """The TRL format a row's columns (those with a value) say it is in, to tell files apart."""
    keys = {key for key, value in row.items() if value is not None}
    if {"chosen", "rejected"} <= keys:
        return "preference (chosen/rejected)"
    if {"prompt", "completion", "label"} <= keys:
        return "unpaired preference (prompt/completion/label)"
    if {"prompt", "completion"} <= keys:
        return "prompt-completion"
    if "messages" in keys:
        return "conversational language modeling (messages)"
    if "text" in keys:
        return "language modeling (text)"
    if "prompt" in keys:
        return "prompt-only"
    return f"unknown-format (columns {sorted(keys)})"


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    row = dict(pairs)
    if len(row) != len(pairs):
        duplicate = next(key for index, (key, _) in enumerate(pairs) if key in dict(pairs[:index]))
        raise ValueError(f"the key {duplicate!r} appears twice in one object (which value counts?)")
    return row


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (standard JSON has no NaN or Infinity)")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _read_json(file: Path) -> tuple[list[dict], list[str]]:
    """The rows of a JSON Lines file (one object per line; blank lines are skipped), or of a ``.json``
    file that is one JSON array of objects; each row's origin is its file and the 1-based line it starts
    on."""
    data = file.read_bytes()
    if not data:
        raise ValueError(f"dataset file {file} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(
            f"{file} line {line}: not UTF-8 text (byte 0x{data[error.start]:02x} at column {column}); "
            "dataset files must be UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not text.strip():
        raise ValueError(f"dataset file {file} holds only blank lines, no rows")
    is_array = file.suffix == ".json" and text.lstrip().startswith("[")
    items = _json_array(file, text) if is_array else _json_lines(file, text)
    rows, origins = [], []
    for line, value in items:
        if not isinstance(value, dict):
            kind = _JSON_TYPES.get(type(value), "null")
            raise ValueError(
                f"{file} line {line} is a JSON {kind}, not an object: each row must be one object, "
                '{"column": value, ...}'
            )
        rows.append(value)
        origins.append(f"{file} line {line}")
    if not rows:
        raise ValueError(f"dataset file {file} is an empty JSON array, no rows")
    return rows, origins


def _json_lines(file: Path, text: str) -> list[tuple[int, object]]:
    # Split at "\n" only: str.splitlines would also split inside strings at U+2028 and other separators.
    items = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            items.append((number, _DECODER.decode(line)))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{file} line {number}: malformed JSON ({error.msg} at column {error.colno}); "
                "a JSON Lines file holds one complete object per line"
            ) from None
        except ValueError as error:
            raise ValueError(f"{file} line {number}: {error}") from None
    return items


def _json_array(file: Path, text: str) -> list[tuple[int, object]]:
    """The items of a file that is one JSON array, each with the line it starts on."""
    items, position = [], text.index("[") + 1

    def skip(at: int) -> int:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        return at

    def line_of(at: int) -> int:
        return text.count("\n", 0, at) + 1

    try:
        position = skip(position)
        if text[position : position + 1] == "]":
            return []
        while True:
            start = skip(position)
            try:
                value, position = _DECODER.raw_decode(text, start)
            except json.JSONDecodeError:
                raise  # handled below, with its own line and column
            except ValueError as error:  # a duplicate key or NaN: the item's line
                raise ValueError(f"{file} line {line_of(start)}: {error}") from None
            items.append((line_of(start), value))
            position = skip(position)
            separator = text[position : position + 1]
            position += 1
            if separator == "]":
                break
            if separator != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter or ']'", text, position - 1)
        if skip(position) != len(text):
            raise json.JSONDecodeError("Extra data after the array", text, skip(position))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file} line {error.lineno}: malformed JSON ({error.msg} at column {error.colno})"
        ) from None
    return items


def _read_parquet(file: Path) -> tuple[list[dict], list[str]]:
    """The rows of a Parquet file, typed as its schema says; each row's origin is its 0-based index."""
    import pyarrow
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(file)
    except (pyarrow.ArrowException, OSError) as error:
        message = one_line(error)
        raise ValueError(f"dataset file {file} is not a readable Parquet file: {message}") from None
    if table.num_rows == 0:
        raise ValueError(f"dataset file {file} holds no rows")
    return table.to_pylist(), [f"{file} row {index}" for index in range(table.num_rows)]
