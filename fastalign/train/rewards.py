"""GRPO reward functions: TRL's signature, resolved from config specs, called and checked per batch.

A reward function is ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, as in
TRL, so TRL reward functions work unchanged: ``prompts``/``completions`` are strings (standard data) or
message lists (conversational: a completion is ``[{"role": "assistant", "content": text}]``), and
``columns`` holds every other dataset column as a list aligned with the samples. None means the function
does not apply to that sample; it becomes NaN, which ``fastalign.ops.combine_rewards`` and
``group_advantages`` leave out.

A spec in ``reward_funcs`` is a built-in name (``exact_match``, ``regex:<pattern>``, ...), an import path
``package.module:function`` or TRL's ``package.module.function``, a file ``path/to/file.py:function``, a
callable, or a trained reward model
(``fastalign.train.reward_model``, as TRL takes one): a local model directory (with a config.json), a Hub id
``org/name``, or programmatically a loaded ``PreTrainedModel`` or ``(model, tokenizer)`` pair. The kinds
are told apart without guessing: a built-in name wins, then an existing directory or a colon-less string
with a slash is a model, then a string with a colon, or a dotted name, is an import path; a bare unknown
name is an error (never a Hub download: a mistyped built-in fails at once, offline).

Reward files are code: resolving ``package.module:function`` imports that module (looked up in the
current directory first, as TRL's ``trl grpo`` and ``python -m`` do, so a ``rewards.py`` beside the config
is ``rewards:f`` or ``rewards.f`` from the ``fastalign`` command too), and
``path/file.py:function`` runs that file (relative to the current directory), whether or not it defines
``function``, as TRL's ``reward_funcs`` does. Name only code you trust. The spec is checked before anything
runs, and nothing but the named module (with its packages, as Python imports it) or file is imported: a
spec naming a file that is not ``.py`` (``rewards.txt:f``) is an error, not an import of package ``rewards``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import logging
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch

from fastalign.errors import one_line
from fastalign.train.reward_model import (
    is_model_object,
    is_model_path,
    load_reward_model,
    reward_model_from_object,
)

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]

#: Keyword arguments every reward function receives; a dataset column may not reuse these names.
_ARGUMENTS = ("prompts", "completions", "completion_ids")
#: A number as written in text: optional minus, digits with optional thousands commas, optional decimals.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
#: Tokens at which the built-in `length_penalty` is 0 when its spec names no target.
DEFAULT_LENGTH_TARGET = 64


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function and the name its metrics go under (``rewards/<name>/mean``)."""

    name: str
    fn: RewardFn


class _MissingColumn(ValueError):
    """A built-in called without the dataset column it needs: a setup error, reported as is (not as a
    failure on some sample)."""


# --------------------------------------------------------------------------------------------------
# Built-ins.


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """The text of a completion: the string itself, or the content of a conversation's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        f"a completion must be a string or a list of messages ending in one with string 'content', "
        f"got {_short(completion)}"
    )


def _answers(function: str, answer: Sequence | None, columns: Mapping[str, Any]) -> Sequence:
    if answer is None:
        others = sorted(key for key in columns if key not in _ARGUMENTS)
        raise _MissingColumn(
            f"reward function {function!r} needs an 'answer' column in the dataset; its columns: {others}"
        )
    return answer


def _decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def exact_match(
    prompts: list, completions: list, completion_ids: list, answer: Sequence | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 where the stripped completion equals ``str(answer)`` stripped, or, for a numeric answer, where
    the completion's last number equals it ("... so she has 1,234.0 apples" matches 1234), else 0.0;
    None where the row's answer is None. The answer is the final answer, not a worked solution."""
    scores: list[float | None] = []
    for completion, expected in zip(completions, _answers("exact_match", answer, kwargs), strict=True):
        if expected is None:
            scores.append(None)
            continue
        text, target = completion_text(completion).strip(), str(expected).strip()
        numbers_in_text = _NUMBER.findall(text)
        numeric = _NUMBER.fullmatch(target) is not None and bool(numbers_in_text)
        same_number = numeric and _decimal(numbers_in_text[-1]) == _decimal(target)
        scores.append(float(text == target or same_number))
    return scores


def contains_answer(
    prompts: list, completions: list, completion_ids: list, answer: Sequence | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 where ``str(answer)`` (stripped) appears in the completion, else 0.0; None where the answer
    is None. Lenient where ``exact_match`` is strict: the answer may sit inside reasoning."""
    return [
        None if expected is None else float(str(expected).strip() in completion_text(completion))
        for completion, expected in zip(completions, _answers("contains_answer", answer, kwargs), strict=True)
    ]


def regex_reward(pattern: str | re.Pattern[str]) -> RewardFn:
    """A reward of 1.0 where ``re.search(pattern, completion)`` matches, else 0.0 — a format reward
    (e.g. ``r"<answer>.*</answer>"``). Flags go inline: ``(?s)`` lets ``.`` cross lines, ``(?m)``
    makes ``^``/``$`` match at each line. Compiled once, here."""
    compiled = re.compile(pattern)

    def regex(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float | None]:
        return [float(compiled.search(completion_text(completion)) is not None) for completion in completions]

    return regex


def length_penalty(target: int = DEFAULT_LENGTH_TARGET) -> RewardFn:
    """A reward of −|len(completion_ids) − target| / target: 0 at ``target`` tokens, −1 at none or at
    twice the target, linear between. Symmetric, so it asks for a length rather than brevity; set
    ``target`` to the length the task wants (the default, 64 tokens, suits short answers)."""
    if target <= 0:
        raise ValueError(f"length_penalty: target must be a positive number of tokens, got {target}")

    def length_penalty(
        prompts: list, completions: list, completion_ids: list, **kwargs: Any
    ) -> list[float | None]:
        return [-abs(len(ids) - target) / target for ids in completion_ids]

    return length_penalty


def _without_parameter(fn: RewardFn) -> Callable[[str | None], RewardFn]:
    def make(parameter: str | None) -> RewardFn:
        if parameter is not None:
            raise ValueError(f"built-in {fn.__name__!r} takes no parameter")
        return fn

    return make


def _make_regex(parameter: str | None) -> RewardFn:
    if not parameter:
        raise ValueError("built-in 'regex' needs a pattern: 'regex:<pattern>'")
    try:
        return regex_reward(parameter)
    except re.error as error:
        raise ValueError(f"bad regular expression: {error}") from None


def _make_length_penalty(parameter: str | None) -> RewardFn:
    try:
        return length_penalty(DEFAULT_LENGTH_TARGET if parameter is None else int(parameter))
    except ValueError:
        raise ValueError(f"the target must be a positive whole number of tokens, got {parameter!r}") from None


#: Built-in rewards by name; each maps the spec's text after the colon (None: no colon) to a function.
BUILTIN_REWARDS: dict[str, Callable[[str | None], RewardFn]] = {
    "exact_match": _without_parameter(exact_match),
    "contains_answer": _without_parameter(contains_answer),
    "regex": _make_regex,
    "length_penalty": _make_length_penalty,
}


# --------------------------------------------------------------------------------------------------
# Resolving specs.


def resolve_reward_funcs(
    specs: object,
    *,
    device: torch.device | str | None = None,
    dtype: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[RewardFunction]:
    """``reward_funcs`` as named functions; every problem is a one-line ValueError naming the spec.

    A string is a built-in (``name`` or ``name:parameter``; built-in names win over a module of the same
    name), else a reward model's directory or Hub id (``reward_model.is_model_path``), else an import
    path ``module:function`` or ``file.py:function``. A loaded model (or ``(model, tokenizer)``) scores as
    a reward model too. A callable is named by its ``__name__``; a RewardFunction keeps its name; a reward
    model is named by the last part of its path or id, as in TRL. Repeated names get ``_2``, ``_3``, ...
    so that each function has its own metrics.

    The keywords are the run's, for reward models only: the policy's ``device`` (None: this process's),
    the ``dtype`` key (None or "auto": each checkpoint's own) and ``chat_template_kwargs``.
    """
    if isinstance(specs, (str, RewardFunction)) or callable(specs) or is_model_object(specs):
        specs = [specs]
    if not specs:
        raise ValueError("reward_funcs: no reward functions given; name at least one (e.g. 'exact_match')")
    funcs, seen = [], set()
    models = {"device": device, "chat_template_kwargs": chat_template_kwargs}
    for spec in specs:
        func = _resolve(spec, models, dtype)
        name, count = func.name, 1
        while name in seen:
            count += 1
            name = f"{func.name}_{count}"
        seen.add(name)
        funcs.append(RewardFunction(name, func.fn))
    return funcs


def _resolve(spec: object, models: dict[str, Any], dtype: str | None) -> RewardFunction:
    if isinstance(spec, RewardFunction):
        return spec
    if is_model_object(spec):  # before callable: a model is one
        model = reward_model_from_object(spec, **models)
        return RewardFunction(model.__name__, model)
    if callable(spec):
        return RewardFunction(getattr(spec, "__name__", type(spec).__name__), spec)
    if not isinstance(spec, str):
        raise ValueError(
            f"reward_funcs: a spec must be a built-in name, an import path 'module:function', a reward "
            f"model or a callable, got {spec!r} ({type(spec).__name__})"
        )
    name, colon, parameter = spec.partition(":")
    if name in BUILTIN_REWARDS:
        try:
            return RewardFunction(name, BUILTIN_REWARDS[name](parameter if colon else None))
        except ValueError as error:
            raise ValueError(f"reward_funcs: {spec!r}: {error}") from None
    if is_model_path(spec):
        model = load_reward_model(spec, dtype=dtype, **models)
        return RewardFunction(model.__name__, model)
    if colon:
        location, _, attribute = spec.rpartition(":")
        return _import(spec, location, attribute)
    if spec.endswith(".py"):
        raise ValueError(f"reward_funcs: {spec!r} names a file but no function: '{spec}:function'")
    if "." in spec and _dotted_name(spec):  # TRL's form: the last part is the function
        location, _, attribute = spec.rpartition(".")
        return _import(spec, location, attribute)
    close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
    hint = (
        f"; did you mean {close[0]!r}?"
        if close
        else "; an import path is 'module:function' or 'module.function'; a reward model is a directory or "
        "a Hub id 'org/name'"
    )
    raise ValueError(
        f"reward_funcs: unknown built-in reward {spec!r} (built-ins: {', '.join(BUILTIN_REWARDS)}){hint}"
    )


def _dotted_name(text: str) -> bool:
    """Whether ``text`` is a dotted Python name (``pkg.module``, ``Class.method``)."""
    return all(part.isidentifier() for part in text.split("."))


def _import(spec: str, location: str, attribute: str) -> RewardFunction:
    """The function ``attribute`` (may be dotted) of module or ``.py`` file ``location``, as ``spec`` names
    them. The spec is checked first; only then is the one module or file it names imported (run)."""
    if not location or not attribute:
        raise ValueError(f"reward_funcs: {spec!r} is not an import path 'module:function'")
    if not _dotted_name(attribute):
        raise ValueError(f"reward_funcs: {spec!r}: {attribute!r} is not a function name")
    is_file = location.endswith(".py")
    if not is_file and Path(location).expanduser().is_file():  # rewards.txt: never import package `rewards`
        raise ValueError(f"reward_funcs: {spec!r}: file {location!r} is not a Python file (.py)")
    if not is_file and not _dotted_name(location):
        raise ValueError(
            f"reward_funcs: {spec!r}: {location!r} is neither a Python file (path/file.py) nor a module "
            "name (package.module)"
        )
    module = _load_file(spec, location) if is_file else _load_module(spec, location)
    what = f"file {location!r}" if is_file else f"module {location!r}"
    target: object = module
    for depth, part in enumerate(attribute.split(".")):
        if not hasattr(target, part):
            close = difflib.get_close_matches(part, [n for n in dir(target) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            owner = what if depth == 0 else repr(".".join(attribute.split(".")[:depth]))
            raise ValueError(f"reward_funcs: {spec!r}: {owner} has no attribute {part!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward_funcs: {spec!r} is not callable (type {type(target).__name__})")
    return RewardFunction(attribute.rpartition(".")[2], target)


def _load_module(spec: str, name: str) -> object:
    """Module ``name``, found in the current directory first (as TRL and ``python -m`` find it; the
    ``fastalign`` script alone would not look there): put first on ``sys.path`` only while it imports,
    so that no later import of the run finds a file of the current directory instead of a package."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(f"{error.name}.")):
            raise ValueError(f"reward_funcs: {spec!r}: no module named {error.name!r}") from None
        raise ValueError(f"reward_funcs: {spec!r}: importing {name!r} failed: {one_line(error)}") from error
    except (Exception, SystemExit) as error:  # SystemExit: a module that calls exit() when imported
        raise ValueError(
            f"reward_funcs: {spec!r}: importing {name!r} raised {type(error).__name__}: {one_line(error)}"
        ) from error
    finally:
        if added:
            sys.path.remove(cwd)


def _load_file(spec: str, location: str) -> object:
    """The module of a Python file, registered in ``sys.modules`` under a name made from its path (so the
    file can use dataclasses and the like), never shadowing a real module. Running the file is the only
    code this executes: its directory is not put on ``sys.path``."""
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"reward_funcs: {spec!r}: file {location!r} not found")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_fastalign_reward_file_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None  # a .py path always has a loader
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # SystemExit: a file that calls exit() when run
        del sys.modules[name]
        raise ValueError(
            f"reward_funcs: {spec!r}: loading file {location!r} raised {type(error).__name__}: "
            f"{one_line(error)}"
        ) from error
    return module


# --------------------------------------------------------------------------------------------------
# Calling.


def compute_rewards(
    funcs: Sequence[RewardFunction],
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence],
) -> torch.Tensor:
    """Every function on the batch: [N, F] float32 on the CPU, NaN where a function returned None.

    Each function is called once on the whole batch with keyword arguments, as TRL calls it. When it
    raises, it is called again one sample at a time to name the sample that fails, so a function with
    side effects sees those samples twice.
    """
    count = len(completions)
    for what, values in (("prompts", prompts), ("completion_ids", completion_ids), *columns.items()):
        if len(values) != count:
            raise ValueError(f"compute_rewards: {what!r} has {len(values)} values for {count} completions")
    clash = [key for key in columns if key in _ARGUMENTS]
    if clash:
        raise ValueError(
            f"compute_rewards: dataset column {clash[0]!r} clashes with a reward function argument"
        )
    arguments = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    rewards = torch.empty(count, len(funcs), dtype=torch.float32)
    for index, func in enumerate(funcs):
        rewards[:, index] = torch.tensor(_call(func, arguments, count), dtype=torch.float32)
    unscored = torch.isnan(rewards).all(dim=1)
    if unscored.any():
        first = int(unscored.nonzero()[0, 0])
        logger.warning(
            "fastalign: every reward function returned None for %d of %d completions (e.g. prompt=%s, "
            "completion=%s): they have no reward (GRPO and RLOO give them advantage 0, online DPO and PPO "
            "score them 0); make a function score each completion",
            int(unscored.sum()), count, _short(prompts[first]), _short(completions[first]),
        )  # fmt: skip
    return rewards


def _call(func: RewardFunction, arguments: dict[str, Sequence], count: int) -> list[float]:
    try:
        values = func.fn(**arguments)
    except _MissingColumn:
        raise
    except Exception as error:
        raise ValueError(
            f"reward function {func.name!r} raised {type(error).__name__}: {one_line(error)} "
            f"{_failing_sample(func, arguments, count)}"
        ) from error
    if hasattr(values, "tolist"):  # a tensor or array
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(
            f"reward function {func.name!r} returned {type(values).__name__}; expected a list of numbers "
            f"or None, one per completion"
        )
    if len(values) != count:
        raise ValueError(
            f"reward function {func.name!r} returned {len(values)} values for {count} completions"
        )
    rewards = []
    for sample, value in enumerate(values):
        if value is None:
            rewards.append(math.nan)
            continue
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(
                f"reward function {func.name!r} returned {_short(value)} ({type(value).__name__}) for "
                f"sample {sample}; expected a number or None"
            )
        if not math.isfinite(value):
            raise ValueError(
                f"reward function {func.name!r} returned {value} for sample {sample}; return None where "
                f"it does not apply"
            )
        rewards.append(float(value))
    return rewards


def _failing_sample(func: RewardFunction, arguments: dict[str, Sequence], count: int) -> str:
    """Where a batch call failed: the first sample that fails alone, or the batch."""
    for sample in range(count):
        try:
            func.fn(**{key: values[sample : sample + 1] for key, values in arguments.items()})
        except Exception:
            prompt, completion = arguments["prompts"][sample], arguments["completions"][sample]
            return f"on sample {sample} (prompt={_short(prompt)}, completion={_short(completion)})"
    return f"on the batch of {count} samples (no sample fails alone)"


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# --------------------------------------------------------------------------------------------------
# Metrics.


def reward_metrics(funcs: Sequence[RewardFunction], rewards_per_func: torch.Tensor) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``rewards/<name>/std`` of each function over the samples it applied
    to (non-NaN): the std unbiased as in TRL, 0 for one value; both NaN where it applied to none."""
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[1] != len(funcs):
        raise ValueError(
            f"reward_metrics: rewards_per_func must be [N, {len(funcs)}] for {len(funcs)} functions, "
            f"got {tuple(rewards_per_func.shape)}"
        )
    metrics = {}
    for func, column in zip(funcs, rewards_per_func.detach().double().cpu().unbind(1), strict=True):
        values = column[~torch.isnan(column)]
        mean = values.mean().item() if values.numel() else math.nan
        std = values.std().item() if values.numel() > 1 else (0.0 if values.numel() else math.nan)
        metrics[f"rewards/{func.name}/mean"] = mean
        metrics[f"rewards/{func.name}/std"] = std
    return metrics
