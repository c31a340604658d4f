"""The objectives ``fastalign train`` knows, by their CLI names. Each module tells one algorithm's whole
story (its options, data, reference or rollout, loss and metrics; see ``base.Objective``); this registry
is the only other place a new objective is named."""

from __future__ import annotations

import dataclasses

from fastalign.train.config import SHARED_DEFAULTS, ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import Objective
from fastalign.train.objectives.distill import DistillObjective
from fastalign.train.objectives.dpo import DPOObjective
from fastalign.train.objectives.grpo import GRPOObjective
from fastalign.train.objectives.kto import KTOObjective
from fastalign.train.objectives.online_dpo import OnlineDPOObjective
from fastalign.train.objectives.ppo import PPOObjective
from fastalign.train.objectives.reward import RewardObjective
from fastalign.train.objectives.rloo import RLOOObjective
from fastalign.train.objectives.sft import SFTObjective

OBJECTIVES: dict[str, type[Objective]] = {
    "sft": SFTObjective,
    "dpo": DPOObjective,
    "simpo": DPOObjective,
    "cpo": DPOObjective,
    "orpo": DPOObjective,
    "kto": KTOObjective,
    "online_dpo": OnlineDPOObjective,
    "grpo": GRPOObjective,
    "rloo": RLOOObjective,
    "ppo": PPOObjective,
    "reward": RewardObjective,
    "distill": DistillObjective,
}

#: Keys some objectives read that the runner reads too, for every objective (never unread).
_RUNNER_KEYS = frozenset({"use_peft", "model_name_or_path"})
#: A key some objectives do not read → (what they read instead, the refusal's reason when they do).
_INSTEAD = {
    "max_length": (
        {"max_prompt_length", "max_completion_length"},
        "TRL's config has none: max_prompt_length and max_completion_length bound its rows",
    ),
}


def make_objective(name: str, config: TrainConfig, ctx: DistributedContext) -> Objective:
    """Objective ``name`` with its options from ``config``, checked before any model work: a one-line
    ``ConfigError`` for an unknown name (listing the known ones), a bad value, or a key this objective
    would ignore."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    _refuse_unread_keys(name, config)
    if config.train_sampling_strategy is not None and OBJECTIVES[name].default_sampling_strategy is None:
        raise ConfigError(
            f"config key 'train_sampling_strategy' ({config.train_sampling_strategy!r}): {name} orders its "
            "prompts by shuffle_dataset, as TRL's sampler does (false: the data's order): use it"
        )
    return OBJECTIVES[name].from_config(name, config, ctx)


def with_objective_defaults(name: str, config: TrainConfig) -> TrainConfig:
    """``config`` with the keys it leaves null that the runner reads set to objective ``name``'s TRL
    default (``learning_rate``: SFTConfig's 2e-5, RewardConfig's 1e-4, PPO's 5e-5, OnlineDPOConfig's
    5e-7, the other trainers' 1e-6;
    ``train_sampling_strategy``: KTOConfig's sequential, the others' random, none where TRL's sampler
    reads ``shuffle_dataset`` instead; ``max_length`` and ``temperature``, where the objective reads them:
    ``SHARED_DEFAULTS``, OnlineDPOConfig's 512 and 0.9)."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    objective = OBJECTIVES[name]
    return dataclasses.replace(
        config,
        learning_rate=objective.default_learning_rate
        if config.learning_rate is None
        else config.learning_rate,
        train_sampling_strategy=config.train_sampling_strategy or objective.default_sampling_strategy,
        **{
            key: objective.shared_defaults.get(key, default)
            for key, default in SHARED_DEFAULTS.items()
            if getattr(config, key) is None and key in objective.config_keys(name)
        },
    )


def own_keys(name: str) -> frozenset[str]:
    """The keys objective ``name`` reads that not every objective reads: its options (some shared with
    related objectives), as ``fastalign train <name> --help`` groups them. Every other key is read by the
    runner or by every objective, or only by other objectives."""
    everyone = frozenset.intersection(*(cls.config_keys(other) for other, cls in OBJECTIVES.items()))
    return OBJECTIVES[name].config_keys(name) - everyone - _RUNNER_KEYS


def _refuse_unread_keys(name: str, config: TrainConfig) -> None:
    """A key set (away from its default) that only other objectives read would be silently ignored."""
    defaults = TrainConfig()
    read = OBJECTIVES[name].config_keys(name)
    for key in (f.name for f in dataclasses.fields(TrainConfig)):
        value = getattr(config, key)
        # (a config written before max_length and temperature defaulted to null spells out their defaults)
        if key in read or key in _RUNNER_KEYS or value in (getattr(defaults, key), SHARED_DEFAULTS.get(key)):
            continue
        readers = [other for other, cls in OBJECTIVES.items() if key in cls.config_keys(other)]
        if readers:
            instead, reason = _INSTEAD.get(key, (None, ""))
            why = f" ({reason})" if instead and instead <= read else ""
            raise ConfigError(
                f"config key {key!r} ({getattr(config, key)!r}) is for {', '.join(readers)}; {name} does not "
                f"read it{why}: remove it"
            )


__all__ = [
    "OBJECTIVES",
    "DPOObjective",
    "DistillObjective",
    "GRPOObjective",
    "KTOObjective",
    "Objective",
    "OnlineDPOObjective",
    "PPOObjective",
    "RLOOObjective",
    "RewardObjective",
    "SFTObjective",
    "make_objective",
    "own_keys",
    "with_objective_defaults",
]
