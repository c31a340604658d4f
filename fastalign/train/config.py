"""The training configuration: one flat set of options named as in TRL / transformers'
``TrainingArguments``, so YAML keys and ``--name value`` flags carry over from those tools."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml


@dataclass
class TrainConfig:
    """Every option of ``fastalign train``; a config names only what differs from these defaults."""

    # model and data
    model_name_or_path: str = "tiny-llama"  # a local directory (config + tokenizer) or a built-in tiny name
    dataset_name: str = "tiny-sft"  # a local JSONL/JSON/Parquet file or directory, or a built-in name
    eval_dataset_name: str | None = None
    eval_split_ratio: float = 0.0  # held-out fraction of dataset_name when no eval_dataset_name
    output_dir: str = "outputs/run"
    max_length: int = 512
    truncation: bool = False  # without it, an over-long example is an error naming its row
    packing: bool = False
    completion_only_loss: bool | None = None  # None: on for prompt-completion data
    assistant_only_loss: bool = False

    # schedule
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "cosine"  # constant, linear, cosine (each after warmup)
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # > 0 overrides warmup_ratio
    seed: int = 42

    # precision and memory
    bf16: bool = False
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    use_liger_kernel: bool = True  # patch_model the model (named as in transformers' TrainingArguments)

    # LoRA
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    # logging, evaluation, checkpoints
    logging_steps: int = 10
    eval_steps: int = 0  # 0: no evaluation during training
    save_steps: int = 0  # 0: only the final model
    save_total_limit: int = 2
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or "latest" in output_dir
    report_to: list[str] = field(default_factory=list)  # "tensorboard", "wandb"
    loss_curve_png: bool = True  # write <output_dir>/loss_curve.png at the end (needs matplotlib)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML, written atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(asdict(config), sort_keys=False))
    os.replace(tmp, path)


class ConfigError(ValueError):
    """A config problem, said in one line that names the key (and the file)."""


_CHOICES = {"lr_scheduler_type": ("constant", "linear", "cosine")}
_POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
             "max_length", "logging_steps", "save_total_limit", "learning_rate")  # fmt: skip
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then the YAML mapping at ``path``, then ``--key value`` / ``--key=value`` overrides."""
    values: dict[str, tuple[object, str]] = {}  # key → (raw value, where it came from)
    if path is not None:
        where = f"in {path}"
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ConfigError(f"cannot read config {path}: {str(error).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values, got {type(data).__name__}")
        values |= {str(key): (value, where) for key, value in data.items()}
    values |= {key: (value, "on the command line") for key, value in _parse_flags(overrides)}
    hints = typing.get_type_hints(TrainConfig)
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    kwargs = {}
    for key, (raw, where) in values.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} ({where}){hint}")
        kwargs[key] = _coerce(key, raw, hints[key], where)
    config = TrainConfig(**kwargs)
    _check(config)
    return config


def _parse_flags(flags: Sequence[str]) -> list[tuple[str, str]]:
    pairs, items = [], list(flags)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--"):
            raise ConfigError(f"expected an option like --learning_rate 1e-4, got {flag!r}")
        key, sep, value = flag[2:].partition("=")
        if not sep:
            if not items:
                raise ConfigError(f"option --{key} needs a value")
            value = items.pop(0)
        pairs.append((key.replace("-", "_"), value))
    return pairs


def _coerce(key: str, raw: object, kind: object, where: str) -> object:
    """``raw`` (from YAML, or a string from a flag) as the field's type, or a ConfigError."""
    args = typing.get_args(kind)
    if (typing.get_origin(kind) in (typing.Union, types.UnionType)) and type(None) in args:
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        kind = next(arg for arg in args if arg is not type(None))
    if kind is bool and isinstance(raw, str) and raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    try:
        if kind is bool and isinstance(raw, bool):
            return raw
        if kind is int and not isinstance(raw, bool):
            number = float(raw) if isinstance(raw, str) else raw
            if isinstance(number, (int, float)) and float(number).is_integer():
                return int(number)
        if kind is float and not isinstance(raw, bool) and isinstance(raw, (int, float, str)):
            return float(raw)
        if kind is str and isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            return str(raw)
        if typing.get_origin(kind) is list:
            items = raw.split(",") if isinstance(raw, str) else raw
            if isinstance(items, list) and all(isinstance(item, str) for item in items):
                return [item.strip() for item in items if item.strip()]
    except ValueError:
        pass
    expected = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        kind, "a list of strings"
    )
    raise ConfigError(f"config key {key!r} ({where}) must be {expected}, got {raw!r} ({type(raw).__name__})")


def _check(config: TrainConfig) -> None:
    for key in _POSITIVE:
        if getattr(config, key) <= 0:
            raise ConfigError(f"config key {key!r} must be positive, got {getattr(config, key)!r}")
    for key, choices in _CHOICES.items():
        if getattr(config, key) not in choices:
            raise ConfigError(f"config key {key!r} must be one of {choices}, got {getattr(config, key)!r}")
    for key in ("warmup_ratio", "eval_split_ratio"):
        if not 0 <= getattr(config, key) < 1:
            raise ConfigError(f"config key {key!r} must be in [0, 1), got {getattr(config, key)!r}")
    unknown_sinks = set(config.report_to) - {"tensorboard", "wandb"}
    if unknown_sinks:
        raise ConfigError(f"'report_to' accepts tensorboard and wandb, got {sorted(unknown_sinks)}")
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        raise ConfigError("set max_steps or num_train_epochs to a positive value")
