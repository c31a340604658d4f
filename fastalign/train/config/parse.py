"""A ``TrainConfig`` from a YAML file and ``--key value`` flags (``load_config``), and back to YAML
(``save_config``): keys and types come from the fields, so a new field is configurable with no other
change."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from collections.abc import Collection, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from fastalign.train.config.checks import check_values, refuse_unread
from fastalign.train.config.fields import ConfigError, TrainConfig

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NULL = ("none", "null")
_ON_THE_COMMAND_LINE = "on the command line"


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    reads: Collection[str] | None = None,
) -> TrainConfig:
    """Defaults, then the YAML mapping at ``path``, then ``--key value`` / ``--key=value`` overrides.

    Keys and types come from the ``TrainConfig`` fields, so a new field is configurable with no other change;
    every problem is a one-line ``ConfigError`` naming the key and where it was set. ``reads``: the keys of
    a command that runs a model without training it (``fastalign teacher-logprobs``): any other key set
    away from its default is refused first (``refuse_unread``), and the checks that only a training run
    needs are left out (held-out data without an ``eval_strategy``, ``quantization`` without
    ``use_peft``).
    """
    values: dict[str, tuple[object, str | None]] = {}  # key → (raw value, file it came from; None: a flag)
    if path is not None:
        values |= {key: (value, str(path)) for key, value in _read_yaml(Path(path)).items()}
    values |= {key: (value, None) for key, value in _parse_flags(overrides)}

    hints = typing.get_type_hints(TrainConfig)
    kinds = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.init}
    kwargs: dict[str, object] = {}
    where: dict[str, str] = {}
    for key, (raw, source) in values.items():
        where[key] = _ON_THE_COMMAND_LINE if source is None else f"in {source}"
        if key not in kinds:
            close = difflib.get_close_matches(key, list(kinds), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} ({where[key]}){hint}")
        nulls = _NULL if kinds[key] in (int, float, bool) else ("null",)  # "none" is a value of some texts
        if source is None and type(None) not in typing.get_args(kinds[key]) and str(raw).lower() in nulls:
            continue  # --save_steps null: a key the config file set goes back to its default (a key that
            # takes null, as in YAML, is set to it)
        if key == "resume_from_checkpoint" and str(raw).lower() in ("true", "false"):
            raw = "latest" if str(raw).lower() == "true" else None  # transformers' bool form
        if key == "scale_rewards" and str(raw).lower() in ("true", "false"):
            raw = "group" if str(raw).lower() == "true" else "none"  # TRL's bool form (GRPOConfig)
        try:
            kwargs[key] = _coerce(raw, kinds[key], from_flag=source is None)
        except _Mismatch:
            raise ConfigError(
                f"config key {key!r} ({where[key]}) must be {_describe(kinds[key])}, "
                f"got {raw!r} ({type(raw).__name__})"
            ) from None
    config = TrainConfig(**kwargs)
    if reads is not None:
        refuse_unread(config, reads, where)
    check_values(config, where, trains=reads is None)
    return config


def save_config(config: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML that ``load_config`` reads back equal, written atomically.

    Atomic (a temporary file in the same directory, renamed into place) so that a crash or a concurrent
    reader never sees half a file next to a checkpoint.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    try:
        tmp.write_text(yaml.safe_dump(asdict(config), sort_keys=False), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _DuplicateKey(Exception):
    def __init__(self, key: object, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping naming a key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[object, int] = {}
        for key_node, _ in node.value:  # the keys as written, before merges (``<<``) are flattened in
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise _DuplicateKey(key, lines[key], line)
                lines[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                pass
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"cannot read config {path}: {reason}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as error:
        raise ConfigError(
            f"config key {error.key!r} is set twice in {path}, at line {error.first} and line {error.second} "
            "(YAML would keep the last silently); keep one"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"invalid YAML in config {path}{at}: {problem}") from None
    if data is None:  # an empty file (or only comments): the defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values, got {type(data).__name__}")
    return {str(key): value for key, value in data.items()}


def _parse_flags(flags: Sequence[str]) -> list[tuple[str, str]]:
    """``["--max-steps", "5", "--bf16=true"]`` as ``[("max_steps", "5"), ("bf16", "true")]``, with
    HfArgumentParser's (TRL's scripts') two short forms: a bool key alone is true (``--use_peft``), and
    a list key takes the values that follow it (``--lora_target_modules q_proj v_proj``)."""
    hints = typing.get_type_hints(TrainConfig)
    pairs, items = [], list(flags)
    while items:
        flag = items.pop(0)
        key, sep, value = flag[2:].partition("=")
        if not flag.startswith("--") or not key:
            raise ConfigError(
                f"expected an option like --learning_rate 1e-4 ({_ON_THE_COMMAND_LINE}), got {flag!r}"
            )
        key = key.replace("-", "_")
        kind = hints.get(key)
        if not sep:
            if (not items or items[0].startswith("--")) and kind is bool:
                value = "true"
            elif not items or items[0].startswith("--"):
                raise ConfigError(f"option --{key} needs a value ({_ON_THE_COMMAND_LINE})")
            else:
                value = items.pop(0)
                if list in (typing.get_origin(kind), *map(typing.get_origin, typing.get_args(kind))):
                    while items and not items[0].startswith("--"):  # the shell's "[a," "b]": "[a, b]"
                        value += (" " if value.lstrip().startswith("[") else ",") + items.pop(0)
        pairs.append((key, value))
    return pairs


class _Mismatch(Exception):
    """A value that is not of the field's type (``load_config`` words the error)."""


def _coerce(raw: object, kind: Any, *, from_flag: bool) -> object:
    """``raw`` as a value of type ``kind``: YAML values as typed, flag values (always text) parsed."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (raw is None or (from_flag and str(raw).lower() in _NULL)):
            return None
        for arg in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(raw, arg, from_flag=from_flag)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is dict:  # a YAML mapping, or JSON text on the command line
        if from_flag and isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError:
                raise _Mismatch from None
        if isinstance(raw, dict) and all(isinstance(key, str) for key in raw):
            return dict(raw)
        raise _Mismatch
    if origin is list:
        (item_kind,) = args or (str,)
        if from_flag and isinstance(raw, str) and raw.strip().startswith("["):  # "[a, b]": YAML's flow list
            try:
                raw = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise _Mismatch from None
        if isinstance(raw, str):  # "q_proj, v_proj" (a flag, or YAML written the same way)
            return [
                _coerce(item.strip(), item_kind, from_flag=True) for item in raw.split(",") if item.strip()
            ]
        if isinstance(raw, list):
            return [_coerce(item, item_kind, from_flag=from_flag) for item in raw]
        raise _Mismatch
    if isinstance(raw, bool):  # before int: bool is an int subclass, and True is no number
        if kind is bool:
            return raw
        raise _Mismatch
    if kind is bool:
        if from_flag and isinstance(raw, str) and raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise _Mismatch
    if kind is int:
        return _as_int(raw)
    if kind is float:
        try:
            number = float(raw) if isinstance(raw, (int, float, str)) else math.nan
        except ValueError:
            raise _Mismatch from None
        if math.isnan(number):
            raise _Mismatch
        return number
    if kind is str:
        if isinstance(raw, str):  # no str(raw): YAML ``output_dir: 1.10`` would come out as "1.1"
            return raw
        raise _Mismatch
    raise TypeError(
        f"TrainConfig field type {kind!r} has no coercion; add one to fastalign.train.config.parse"
    )


def _as_int(raw: object) -> int:
    """An int, never silently truncated: 1.5 and "1.5" fail, 1000.0 and "1e3" (YAML 1.1 text) are 1000."""
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
        try:
            raw = float(raw)
        except ValueError:
            raise _Mismatch from None
    if isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return int(raw)
    raise _Mismatch


_WORDS = {
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(kind: Any, plural: bool = False) -> str:
    """A field type in words, for error messages: ``str | None`` → "a string or null"."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(arg) for arg in args if arg is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is list:
        return f"a list of {_describe(args[0] if args else str, plural=True)}"
    if origin is dict:
        return "a mapping of names to values (JSON on the command line)"
    singular, many = _WORDS.get(kind, (str(kind), str(kind)))
    return many if plural else singular
