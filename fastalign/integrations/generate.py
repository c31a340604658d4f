"""Serve a model's ``generate`` with fastalign's rollout engine, for trainers that sample through it.

TRL's GRPO, RLOO and distillation trainers (without vLLM) sample with the model instance's own
``generate``, each prompt repeated ``num_generations`` times in adjacent rows. ``generate`` then
prefills every copy, decodes every row until the longest ends and draws with ``torch.multinomial``.
``serve_generate(model)`` puts the rollout engine (``fastalign.train.generation``) behind that
``generate``: each run of identical adjacent rows is one prompt, prefilled once, its completions
decoded from one cache, ended rows leaving the batch. It returns what ``generate`` returns: the
[rows, prompt + longest completion] ids, ended rows padded with the pad id.

**Same tokens when greedy; the same distribution, other draws, when sampling.** The engine draws by
inverse CDF, not with ``generate``'s random stream, so a seeded TRL run with it samples other completions
than TRL alone: its losses are not TRL alone's to the digit, the statistics of its samples are. That is
why this is a call of its own, not part of ``fastalign.integrations.trl.enable()``, whose results are
TRL's exactly.

A call the engine does not cover goes to the model's own ``generate``, said once per reason in one log
line: arguments besides ``input_ids``, ``attention_mask``, ``generation_config`` and generation-config
fields (logits processors, stopping criteria, a streamer, images, ...), output dictionaries, a process
group of more than one rank (the ranks' collectives pair up only if every rank decides alike, which the
engine's own rollout arranges and a bare ``generate`` call cannot), and whatever ``engine_refusal``
names (beam search, another cache, a rope that changes within the sequences, ...).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from fastalign.train.generation import engine_refusal, sample_groups

logger = logging.getLogger(__name__)

#: ``generate`` options that change what it returns, not what it samples: the engine returns ids only.
_OUTPUT_OPTIONS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions")
_SAID: set[str] = set()


def serve_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.generate`` (this instance's) sample with the rollout engine where it can, and with
    the model's own ``generate`` elsewhere. Call it before handing the model to the trainer (TRL's peft
    wrapping reaches this instance's ``generate``). Idempotent; ``restore_generate`` undoes it. Returns
    the model."""
    if getattr(model.generate, "_fastalign_engine", False):
        return model
    own = model.generate

    def generate(*args: Any, **kwargs: Any):
        reason = _not_served(model, args, kwargs)
        if reason is not None:
            _say_once(f"fastalign: this generate call runs the model's own generate ({reason})")
            return own(*args, **kwargs)
        ids, mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask")
        group = _group(ids, mask)
        return sample_groups(model, ids[::group], mask[::group], group, kwargs)

    generate._fastalign_engine = True
    generate.__wrapped__ = own
    generate.__doc__ = own.__doc__
    model.generate = generate
    return model


def restore_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` back its own ``generate`` (undo ``serve_generate``). Returns the model."""
    if getattr(model.generate, "_fastalign_engine", False):
        del model.generate
    return model


def _not_served(model: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this ``generate(*args, **kwargs)`` call is not the engine's (None: it is)."""
    if args:
        return "positional arguments"
    if kwargs.get("attention_mask") is None or not torch.is_tensor(kwargs.get("input_ids")):
        return "input_ids and attention_mask are not both given"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "a process group of more than one rank"
    options = {key: value for key, value in kwargs.items() if key not in ("input_ids", "attention_mask")}
    config = options.get("generation_config")
    for name in _OUTPUT_OPTIONS:
        if options.get(name) or (name not in options and getattr(config, name, False)):
            return f"{name} is set"
    return engine_refusal(model, options, width=kwargs["input_ids"].shape[1])


def _group(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The rows of each prompt: the greatest common divisor of the lengths of the runs of identical
    adjacent rows (ids and mask), so that every block of that many rows is one prompt repeated (1: each
    row a prompt of its own)."""
    rows = ids.shape[0]
    same = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1])).all(-1).tolist()
    starts = [0] + [row for row in range(1, rows) if not same[row - 1]]
    return math.gcd(*(end - start for start, end in zip(starts, [*starts[1:], rows], strict=True)))


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)
