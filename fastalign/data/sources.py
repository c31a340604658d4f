"""Local dataset files (JSONL/JSON/Parquet, a file or a directory of them) or in-memory rows → a
``datasets.Dataset``. Nothing is fetched here: Hub dataset ids are
``fastalign.train.loading.load_dataset_rows``'s."""

from __future__ import annotations

import contextlib
from pathlib import Path

import datasets

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@contextlib.contextmanager
def _quiet_progress():
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def load_rows(source: str | Path | list[dict]) -> datasets.Dataset:
    """Rows from a local file or directory, or a list of dicts; a clear ValueError otherwise."""
    if isinstance(source, list):
        if not source:
            raise ValueError("the dataset is empty (an empty list of rows)")
        return datasets.Dataset.from_list(source)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"dataset_name {str(source)!r} is not a local file or directory (no hub access)")
    files = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"dataset directory {str(path)!r} holds no .jsonl, .json or .parquet file")
    suffixes = {p.suffix for p in files}
    if not suffixes <= set(_BUILDERS) or len({_BUILDERS[s] for s in suffixes}) > 1:
        raise ValueError(f"dataset files must all be JSONL/JSON or all Parquet, got {sorted(suffixes)}")
    builder = _BUILDERS[files[0].suffix]
    with _quiet_progress():  # local files load in a blink; the bars would only bury a one-line error
        rows = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
    if len(rows) == 0:
        raise ValueError(f"the dataset {str(source)!r} is empty")
    return rows
