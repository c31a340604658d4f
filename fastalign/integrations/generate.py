"""Serve a model's ``generate`` with fastalign's rollout engine, for trainers that sample through it.

TRL's GRPO and RLOO trainers (without vLLM) sample with the model instance's own ``generate``, each
prompt repeated ``num_generations`` times in adjacent rows. ``generate`` then prefills every copy,
decodes every row until the longest ends and draws with ``torch.multinomial``. ``serve_generate(model)``
puts the rollout engine (``fastalign.sampling.generation``) behind that ``generate``: each run of identical
adjacent rows is one prompt, prefilled once, its completions decoded from one cache, ended rows leaving
the batch. It returns what ``generate`` returns: the [rows, prompt + longest completion] ids, ended rows
padded with the pad id.

**Same tokens when greedy; the same distribution, other draws, when sampling.** The engine draws by
inverse CDF, not with ``generate``'s random stream, so a seeded TRL run with it samples other completions
than TRL alone: its losses are not TRL alone's to the digit, the statistics of its samples are. That is
why this is a call of its own, not part of ``fastalign.integrations.trl.enable()``, whose results are
TRL's exactly.

A call the engine would not sample as ``generate`` goes to the model's own ``generate``, said once per
reason in one log line:

- arguments besides ``input_ids``, ``attention_mask``, ``generation_config`` and generation-config fields
  (logits processors, stopping criteria, a streamer, images, ...), or an output dictionary;
- dropout at work (the model in training mode with a dropout probability above 0, LoRA's included):
  ``generate`` gives each copy of a prompt its own dropout masks, one shared prefill cannot;
- gradient checkpointing in training mode (transformers then keeps no cache);
- peft prompt learning (prompt or prefix tuning), whose virtual tokens ``generate`` adds;
- whatever ``engine_refusal`` names (beam search, another cache, no cache, no end token, a rope that
  changes within the sequences, ...).

**A model sharded over several ranks** (FSDP 1 or 2, DeepSpeed ZeRO-3: its forwards are collective, so
every rank calls ``generate`` alike, as transformers' own ``generate`` requires) has its ranks decide
together, in one all-reduce per call: where any rank's call is not the engine's, every rank's goes to the
model's own ``generate``. Its decoding is ``synced`` as ``generate``'s ``synced_gpus`` (a rank whose rows
have ended keeps stepping until every rank's have), unless ``synced_gpus`` says otherwise (False is
honoured, as by ``generate``). An unsharded model's ranks (DDP, or one copy each) decide alone.

The wrapper is a method bound to the model (``types.MethodType``), so a deep copy of a served model
serves its own weights, and ``restore_generate`` puts back whatever ``generate`` the instance had.
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any

import torch
import torch.distributed as dist
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from fastalign.sampling.generation import engine_refusal, merged_generation_config, sample_groups

logger = logging.getLogger(__name__)

#: The instance attribute holding the ``generate`` the instance had before serving (None: the class's).
_OWN = "_fastalign_own_generate"
#: ``generate``'s own parameters (not generation-config fields) that are unset when None or False: TRL
#: and users pass them so; any other value is not the engine's to serve.
_UNSET_WHEN_FALSY = frozenset(
    {
        "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
        "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate",
    }
)  # fmt: skip
_SAID: set[str] = set()


def serve_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model.generate`` (this instance's) sample with the rollout engine where it samples as
    ``generate`` does, and with the model's own ``generate`` elsewhere. Call it before handing the model
    to the trainer (TRL's peft wrapping reaches this instance's ``generate``). Idempotent;
    ``restore_generate`` undoes it. Returns the model."""
    if _is_served(model):
        return model
    setattr(model, _OWN, vars(model).get("generate"))
    model.generate = types.MethodType(generate, model)
    return model


def restore_generate(model: torch.nn.Module) -> torch.nn.Module:
    """Give ``model`` back the ``generate`` it had before ``serve_generate``. Returns the model."""
    if _is_served(model):
        own = vars(model).pop(_OWN)
        if own is None:
            del model.generate
        else:
            model.generate = own
    return model


def _is_served(model: torch.nn.Module) -> bool:
    return getattr(vars(model).get("generate"), "__func__", None) is generate


def _own_generate(model: torch.nn.Module):
    own = vars(model).get(_OWN)
    return own if own is not None else types.MethodType(type(model).generate, model)


def generate(self: torch.nn.Module, *args: Any, **kwargs: Any):
    """``generate``, served by the rollout engine where it samples as ``generate`` does. Named as the
    method it stands in for: a pickled served model (``torch.save``) loads with its class's ``generate``."""
    kwargs = {key: value for key, value in kwargs.items() if key not in _UNSET_WHEN_FALSY or value}
    synced_gpus = kwargs.pop("synced_gpus", None)
    reason = _not_served(self, args, kwargs)
    sharded = _world_size() > 1 and _sharded(self)
    if sharded:  # only a sharded model's forwards are collective: an unsharded rank decides alone
        reason = _agreed(reason, kwargs.get("input_ids"))
    synced = sharded if synced_gpus is None else bool(synced_gpus)
    if reason is not None:
        if reason not in _SAID:
            _SAID.add(reason)
            logger.warning(f"fastalign: this generate call runs the model's own generate ({reason})")
        return _own_generate(self)(*args, **kwargs, synced_gpus=synced)
    ids, mask = kwargs.pop("input_ids"), kwargs.pop("attention_mask")
    config, _ = merged_generation_config(self, kwargs)
    group = _group(ids, mask)
    with torch.no_grad():  # as generate's own decorator
        return sample_groups(
            self, ids[::group], mask[::group], group * config.num_return_sequences, kwargs, synced=synced
        )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _agreed(reason: str | None, ids: Any) -> str | None:
    """This rank's ``reason`` not to serve the call, or, where it has none and another rank has one, the
    reason every rank then shares: one all-reduce, on the ids' device (as ``generate``'s synced loop)
    where they are a tensor. A sharded model's ranks call ``generate`` alike (its forwards pair up)."""
    if torch.is_tensor(ids):
        device = ids.device
    elif "gloo" in str(dist.get_backend()):
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    refused = torch.tensor(float(reason is not None), device=device)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX)
    if reason is None and refused.item() > 0:
        return "another rank's call is not served, and the ranks' sharded forwards must pair up"
    return reason


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forwards are collective, as ``generate`` asks to decide ``synced_gpus``: DeepSpeed
    ZeRO-3, or FSDP (1 or 2) on the model or on any module of it."""
    if is_deepspeed_zero3_enabled():
        return True
    return any(is_fsdp_managed_module(module) for module in model.modules())


def _not_served(model: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this ``generate(*args, **kwargs)`` call is not the engine's (None: it is)."""
    if args:
        return "positional arguments"
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if not torch.is_tensor(ids) or not torch.is_tensor(mask):
        return "input_ids and attention_mask are not both given"
    if ids.ndim != 2 or ids.shape[0] == 0:
        return "no rows"
    if model.training and _dropout_at_work(model):
        return "dropout is at work (training mode): generate draws each row's masks, a shared prefill cannot"
    if model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return "gradient checkpointing in training mode keeps no cache"
    if _prompt_learning(model):
        return "peft prompt learning adds virtual tokens in generate"
    options = {key: value for key, value in kwargs.items() if key not in ("input_ids", "attention_mask")}
    refusal = engine_refusal(model, options, width=ids.shape[1])
    if refusal is not None:
        return refusal
    config, _ = merged_generation_config(model, options)
    if config.return_dict_in_generate:
        return "return_dict_in_generate is set"
    if config.num_return_sequences > 1 and not config.do_sample:
        return "num_return_sequences with greedy decoding (generate refuses it)"
    return None


def _dropout_at_work(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` in training mode drops anything: a dropout module (LoRA's
    included) or an attention dropout probability above 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            return True
    return False


def _prompt_learning(model: torch.nn.Module) -> bool:
    """Whether ``model``, or the peft model whose ``generate`` called it (peft puts its own
    ``prepare_inputs_for_generation`` on the base model for the call), learns virtual prompt tokens."""
    owner = getattr(vars(model).get("prepare_inputs_for_generation"), "__self__", None)
    return any(
        getattr(getattr(candidate, "active_peft_config", None), "is_prompt_learning", False)
        for candidate in (model, owner)
        if candidate is not None
    )


def _group(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The rows of each prompt: the greatest common divisor of the lengths of the runs of identical
    adjacent rows (ids and mask), so that every block of that many rows is one prompt repeated (1: each
    row a prompt of its own)."""
    rows = ids.shape[0]
    same = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1])).all(-1).tolist()
    starts = [0] + [row for row in range(1, rows) if not same[row - 1]]
    return math.gcd(*(end - start for start, end in zip(starts, [*starts[1:], rows], strict=True)))
