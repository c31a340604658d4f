"""A teacher's top-k log-probs on a data set's completions, stored once for offline distillation
(``fastalign teacher-logprobs`` writes them, ``fastalign train distill --teacher_logprobs_path`` reads them).

A directory of safetensors shards (never pickle) beside ``manifest.json``. Shard ``i`` holds rows
``[i·shard_rows, (i+1)·shard_rows)`` of the scored rows, in the data's order; per row its content hash (of
its prompt and completion token ids: ``row_hash``) and, per completion token, the teacher's top-k token ids
(int32) and log-probs (``dtype``), the log of the mass outside them and the log-prob of the completion's
own token (fp32):

- ``row_hashes`` uint8 [R, 32] (sha256), ``offsets`` int64 [R + 1] (each row's tokens),
- ``ids`` int32 [T, k], ``logprobs`` [T, k], ``tail`` fp32 [T], ``token_logprobs`` fp32 [T],
- with ``tail_samples`` M > 0 (``fastalign teacher-logprobs --tail_samples``, fastalign's: TRL stores no
  such thing), ``sample_ids`` int32 [T, M]: M draws per token from the teacher's distribution outside its
  top-k (``linear_topk_logprobs``), at uniforms from a generator seeded by (``tail_samples_seed``, the
  row's hash): ``tail_uniforms``. ``train distill`` turns them into an unbiased estimate of the tail.

Every file is written atomically (a temporary file in the same directory, then ``os.replace``), with the mode
a plain ``open`` gives (0o666 less the umask): a shard that exists is complete, so a killed run resumes from
the shards it finished. The manifest names what was scored (teacher, revision and a fingerprint of its
weights, whether fastalign patched it, its weights' dtype, attention kernel, autocast and 4-bit quantization,
tokenizer hash, k, dtype, temperature, the tail draws and their seed, the data set's hash, row count) and says
``complete`` once every shard is written. Readers match rows by their content hash, not position.

The evaluation rows (``eval_dataset_name``) are scored into the sub-directory ``eval`` (``EVAL_DIR``), the
same layout with its own manifest: scoring them later leaves the training rows' shards as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
#: The sub-directory of an ``eval_dataset_name``'s scores.
EVAL_DIR = "eval"
#: The weight files whose names, sizes and mtimes fingerprint a local teacher.
WEIGHT_FILES = ("*.safetensors", "*.bin")
FORMAT = "fastalign-teacher-logprobs/1"
#: Stored log-prob dtypes, and their bytes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ID_BYTES = 4


def disk_bytes_per_token(k: int, dtype: str = "float32", tail_samples: int = 0) -> int:
    """Bytes a scored completion token takes on disk: k × (id + log-prob), plus the fp32 tail and
    completion-token log-prob, plus an id per tail draw."""
    return k * (ID_BYTES + DTYPES[dtype].itemsize) + 8 + tail_samples * ID_BYTES


def row_hash(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> bytes:
    """The sha256 of a row's prompt and completion token ids (how rows are matched to their scores)."""
    digest = hashlib.sha256()
    digest.update(len(prompt_ids).to_bytes(8, "little"))
    digest.update(torch.tensor(list(prompt_ids) + list(completion_ids), dtype=torch.int64).numpy().tobytes())
    return digest.digest()


def tail_uniforms(seed: int, row: bytes, tokens: int, samples: int) -> torch.Tensor:
    """The uniforms [tokens, samples] (float64, in [0, 1)) of one row's tail draws, from a generator
    seeded by the sha256 of ``seed`` and the row's content hash ``row``: a row draws the same whatever
    batch, shard, rank or resumed run scores it."""
    digest = hashlib.sha256(seed.to_bytes(8, "little") + row).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.rand(tokens, samples, generator=generator, dtype=torch.float64)


def dataset_hash(hashes: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for value in hashes:
        digest.update(value)
    return digest.hexdigest()


def weights_fingerprint(directory: str | Path) -> str:
    """A cheap fingerprint of a local model directory's weights (no file is read): the sha256 of each
    top-level ``WEIGHT_FILES`` file's name, size and ``st_mtime_ns``, so retraining the directory in
    place (or touching a weight file) changes it."""
    directory = Path(directory)
    files = sorted({path for pattern in WEIGHT_FILES for path in directory.glob(pattern) if path.is_file()})
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"files:{len(files)}:{digest.hexdigest()[:16]}"


def tokenizer_hash(tokenizer) -> str:
    """The sha256 of a tokenizer's vocabulary, special tokens and chat template: what decides the ids."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {
            name: getattr(tokenizer, name, None)
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        },
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    teacher: str
    teacher_revision: str | None
    tokenizer_hash: str
    k: int
    dtype: str
    temperature: float
    dataset_hash: str
    rows: int
    shard_rows: int
    shards: int
    # what identifies the teacher's weights (``weights_fingerprint``) and whether fastalign patched it
    # (use_liger_kernel: slightly other numerics); None in a manifest written before they were recorded
    teacher_weights: str | None = None
    teacher_patched: bool | None = None
    # how it ran: its floating weights' dtype ("float32", "bfloat16", ...) and attention kernel
    # (transformers' name, e.g. "sdpa"), which change the numerics; None in a manifest written before
    # they were recorded (training reads such a manifest all the same; resuming it is refused)
    teacher_dtype: str | None = None
    teacher_attn_implementation: str | None = None
    # its forward's autocast ("bfloat16" or "float16": bf16 / fp16) and 4-bit quantization (e.g.
    # "nf4+double_quant"); None: none, as in every manifest written before they were recorded
    teacher_autocast: str | None = None
    teacher_quantization: str | None = None
    # the rows of its LM head (its vocabulary, which a student's must equal; a tokenizer hash does not
    # tell: a head may be padded past the tokenizer's ids); None in a manifest written before it was
    teacher_vocab: int | None = None
    # draws per token from the tail (``sample_ids``) and their seed (None without draws); a manifest
    # written before they existed has none
    tail_samples: int = 0
    tail_samples_seed: int | None = None
    complete: bool = False
    tokens: int | None = None  # completion tokens scored, once complete
    format: str = FORMAT

    def run_keys(self) -> dict:
        """What must agree for a resumed run to continue this one."""
        keys = asdict(self)
        for key in ("complete", "tokens"):
            keys.pop(key)
        return keys


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _create_temporary(path: Path) -> tuple[str, int]:
    """A new empty file beside ``path`` (a hidden, unique name) and its permission bits. It is created
    with mode 0o666, so the kernel applies the process's umask (and a directory's default ACL) as it does
    to a plain ``open(..., "w")``: the umask is neither read nor changed (``os.umask`` can only read it
    by setting it, which would race with other threads)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            return str(tmp), stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
    raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")


def atomic_write(path: Path, write) -> None:
    """``write(temporary_path)`` then rename it onto ``path`` (same directory: an atomic replace). The
    file gets the mode a plain ``open(path, "w")`` would give it (0o666 less the umask), set again after
    ``write``, which may replace the file (safetensors' ``save_file`` leaves 0600): ``tempfile.mkstemp``'s
    0600, which ``os.replace`` keeps, would shut out a reader under another uid (shared storage,
    containers). The file is flushed to disk before the rename and the rename after it (``fsync``), so
    that after a power loss a name that exists holds the whole file: a rerun skips the shards it finds."""
    tmp, mode = _create_temporary(path)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
        _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(json.dumps(asdict(manifest), indent=2) + "\n")

    atomic_write(Path(directory) / MANIFEST, write)


def read_manifest(directory: Path) -> Manifest | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
        return Manifest(**data)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: not a teacher log-probs manifest ({error})") from None


@dataclass
class ScoredRow:
    """One row's scores: per completion token, the top-k ids and log-probs, tail and token log-prob, and
    the tail draws."""

    row_hash: bytes
    ids: torch.Tensor  # [T, k]
    logprobs: torch.Tensor  # [T, k]
    tail: torch.Tensor  # [T]
    token_logprobs: torch.Tensor  # [T]
    sample_ids: torch.Tensor  # [T, M], M = 0 without draws (not stored then)


def write_shard(directory: Path, index: int, rows: Sequence[ScoredRow], dtype: str) -> Path:
    """Shard ``index`` of ``rows``, written atomically."""
    from safetensors.torch import save_file

    lengths = torch.tensor([0] + [row.ids.shape[0] for row in rows], dtype=torch.int64)
    tensors = {
        "row_hashes": torch.tensor([list(row.row_hash) for row in rows], dtype=torch.uint8).reshape(-1, 32),
        "offsets": lengths.cumsum(0),
        "ids": torch.cat([row.ids for row in rows]).to(torch.int32).contiguous(),
        "logprobs": torch.cat([row.logprobs for row in rows]).to(DTYPES[dtype]).contiguous(),
        "tail": torch.cat([row.tail for row in rows]).float().contiguous(),
        "token_logprobs": torch.cat([row.token_logprobs for row in rows]).float().contiguous(),
    }
    if rows[0].sample_ids.shape[1]:
        tensors["sample_ids"] = torch.cat([row.sample_ids for row in rows]).to(torch.int32).contiguous()
    path = Path(directory) / shard_name(index)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    return path


class TeacherLogprobs:
    """The scores of a complete directory, looked up by row hash; shards are read lazily (one row's
    slice at a time), so memory holds only the index (36 bytes a row)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise ValueError(f"config key 'teacher_logprobs_path': {self.directory} has no {MANIFEST}")
        if not manifest.complete:
            raise ValueError(
                f"config key 'teacher_logprobs_path': {self.directory} is incomplete "
                "(rerun fastalign teacher-logprobs on it to finish the missing shards)"
            )
        self.manifest = manifest
        draws = ("sample_ids",) if manifest.tail_samples else ()
        self.names = ("ids", "logprobs", "tail", "token_logprobs", *draws)  # a row's tensors
        self._index: dict[bytes, tuple[Any, int, int]] = {}  # row hash: its shard's handle, token range
        for shard in range(manifest.shards):
            path = self.directory / shard_name(shard)
            try:
                handle = safe_open(str(path), framework="pt")
                hashes = handle.get_tensor("row_hashes")
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as error:  # safetensors' SafetensorError, a missing file or tensor
                raise ValueError(
                    f"config key 'teacher_logprobs_path': {path} cannot be read "
                    f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}): "
                    "remove it and rerun fastalign teacher-logprobs on the directory to score it again"
                ) from None
            for row, value in enumerate(hashes):
                self._index[bytes(value.tolist())] = (handle, offsets[row], offsets[row + 1])

    def include(self, other: TeacherLogprobs) -> None:
        """Also look up ``other``'s rows (the evaluation rows' scores beside the training rows')."""
        self._index.update(other._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: bytes) -> dict[str, torch.Tensor]:
        handle, start, end = self._index[key]
        return {name: handle.get_slice(name)[start:end] for name in self.names}
