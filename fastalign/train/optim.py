"""The optimizer and learning-rate schedule of a run, by transformers' ``TrainingArguments`` names
(``optim``, ``lr_scheduler_type``, ``lr_scheduler_kwargs``, ``warmup_steps``), with its semantics:

- weight decay applies to every trainable weight but biases and norm weights (transformers'
  ``get_decay_parameter_names``), so ``weight_decay`` means what it means in ``Trainer`` and TRL;
- ``warmup_steps`` below 1 is a ratio of the run's steps (as in transformers 5), else a step count; the
  older ``warmup_ratio`` is used when ``warmup_steps`` is 0;
- ``constant`` has no warmup, as transformers' (a warmup set beside it is refused: transformers would drop
  it silently); ``constant_with_warmup`` has one.

transformers' optimization and trainer modules import peft, and peft imports bitsandbytes: they are
imported in the functions that use them, so inside ``run_training``
(``fastalign.quant.bitsandbytes_import``), not with this module.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch

from fastalign.train.config import ConfigError, TrainConfig

#: The names in transformers' lowercase spelling; a norm's weight never decays.
_NO_DECAY = ["bias", "layernorm", "rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _adamw(fused: bool) -> Callable:
    def make(groups, config: TrainConfig):
        betas = (config.adam_beta1, config.adam_beta2)
        return torch.optim.AdamW(
            groups, lr=config.learning_rate, betas=betas, eps=config.adam_epsilon, fused=fused or None
        )

    return make


def _bitsandbytes(name: str) -> Callable:
    def make(groups, config: TrainConfig):
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                f"config key 'optim' ({config.optim!r}) needs bitsandbytes: pip install 'fastalign[qlora]'"
            )
        import bitsandbytes

        optimizer = getattr(bitsandbytes.optim, name)
        betas = (config.adam_beta1, config.adam_beta2)
        return optimizer(groups, lr=config.learning_rate, betas=betas, eps=config.adam_epsilon)

    return make


def _adafactor(groups, config: TrainConfig):
    from transformers.optimization import Adafactor

    # as transformers' Trainer makes it: the given learning rate, no relative step or parameter scaling
    return Adafactor(groups, lr=config.learning_rate, scale_parameter=False, relative_step=False)


def _sgd(groups, config: TrainConfig):
    return torch.optim.SGD(groups, lr=config.learning_rate)


#: ``optim`` (``config.OPTIMIZERS``) → how it is made from the parameter groups and the config.
MAKERS: dict[str, Callable] = {
    "adamw_torch_fused": _adamw(fused=True),
    "adamw_torch": _adamw(fused=False),
    "adamw_8bit": _bitsandbytes("AdamW8bit"),
    "paged_adamw_8bit": _bitsandbytes("PagedAdamW8bit"),
    "adafactor": _adafactor,
    "sgd": _sgd,
}
#: The ``optim`` names that are bitsandbytes' optimizers.
BITSANDBYTES_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The ``optim`` of the config over the trainable parameters, with ``weight_decay`` on all but biases
    and norm weights."""
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, ALL_LAYERNORM_LAYERS, _NO_DECAY))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in trainable if name in decay], "weight_decay": config.weight_decay},
        {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0},
    ]
    return MAKERS[config.optim]([group for group in groups if group["params"]], config)


def warmup_steps(config: TrainConfig, max_steps: int) -> int:
    """The warmup's length in steps: ``warmup_steps`` (below 1: a ratio of ``max_steps``, rounded up as
    transformers' ``TrainingArguments.get_warmup_steps``), or else ``warmup_ratio`` of ``max_steps``."""
    if config.warmup_steps >= 1:
        return int(config.warmup_steps)
    return math.ceil((config.warmup_steps or config.warmup_ratio) * max_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, max_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``lr_scheduler_type`` with ``lr_scheduler_kwargs`` after the warmup; a bad keyword is a
    ``ConfigError`` naming the key."""
    from transformers import get_scheduler

    try:
        return get_scheduler(
            config.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(config, max_steps),
            num_training_steps=max_steps, scheduler_specific_kwargs=config.lr_scheduler_kwargs or {},
        )  # fmt: skip
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"config key 'lr_scheduler_kwargs' ({config.lr_scheduler_kwargs!r}) does not fit "
            f"lr_scheduler_type {config.lr_scheduler_type!r}: {str(error).splitlines()[0]}"
        ) from None


#: Schedules whose ``get_scheduler`` takes no ``lr_scheduler_kwargs`` (it drops them), and the one that
#: also ignores ``warmup_steps`` (transformers' ``constant``: no warmup at all).
_NO_KWARGS = ("constant", "constant_with_warmup")


def check_schedule(config: TrainConfig) -> None:
    """``lr_scheduler_kwargs`` tried on a stand-in optimizer, so a bad one fails before any model work;
    keys transformers' schedule would drop (the constant ones' kwargs, ``constant``'s warmup) refused."""
    kind = config.lr_scheduler_type
    if kind in _NO_KWARGS and config.lr_scheduler_kwargs:
        raise ConfigError(
            f"config key 'lr_scheduler_kwargs' ({config.lr_scheduler_kwargs!r}): lr_scheduler_type {kind!r} "
            "takes none: remove it"
        )
    if kind == "constant" and (config.warmup_steps or config.warmup_ratio):
        key = "warmup_steps" if config.warmup_steps else "warmup_ratio"
        raise ConfigError(
            f"config key {key!r}: lr_scheduler_type 'constant' has no warmup (as in transformers): use "
            "constant_with_warmup, or remove it"
        )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # its rate plays no part
    build_scheduler(probe, config, max_steps=max(config.max_steps, 1))
