"""Every default fastalign shares a name with is TRL 1.16's default for that trainer, or a documented
difference: TRL's config classes are the oracle, read field by field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import OBJECTIVES, with_objective_defaults
from tests.helpers import require

trl = require("trl")
from trl.experimental.cpo import CPOConfig  # noqa: E402
from trl.experimental.distillation import DistillationConfig  # noqa: E402
from trl.experimental.online_dpo import OnlineDPOConfig  # noqa: E402
from trl.experimental.orpo import ORPOConfig  # noqa: E402

#: Keys both sides need set to be built at all (distill: a teacher; TRL's server path, offline distill's
#: counterpart, needs a live server and is not compared here: its `loss_top_k` default is docs/trl.md's).
REQUIRED = {"distill": {"teacher_model_name_or_path": "teacher"}}

#: fastalign objective → TRL's config for it (and the options that make it that objective in TRL).
TRL_CONFIGS = {
    "sft": (trl.SFTConfig, {}),
    "dpo": (trl.DPOConfig, {}),
    "kto": (trl.KTOConfig, {}),
    "cpo": (CPOConfig, {}),
    "simpo": (CPOConfig, {"loss_type": "simpo"}),
    "orpo": (ORPOConfig, {}),
    "grpo": (trl.GRPOConfig, {}),
    "rloo": (trl.RLOOConfig, {}),
    "online_dpo": (OnlineDPOConfig, {}),
    "reward": (trl.RewardConfig, {}),
    "distill": (DistillationConfig, REQUIRED["distill"]),
}


#: Defaults that differ on purpose, each a row of docs/trl.md's differences table.
DIFFERENCES = {
    "output_dir",  # TRL: trainer_output; fastalign: outputs/run
    "bf16",  # TRL: bf16 autocast even on a CPU; fastalign: fp32 unless asked
    "gradient_checkpointing",  # TRL: on; fastalign: off (the fused heads remove the logits peak)
    "use_liger_kernel",  # TRL: off; fastalign: its own kernels on (what it is for)
}

#: A fastalign value that means what TRL's resolved value means (TRL fills these in __post_init__).
SAME_MEANING = {
    # None: one generation per optimizer step, as TRL's steps_per_generation = gradient_accumulation_steps
    "steps_per_generation": lambda config: config.gradient_accumulation_steps,
}


def _trl_config(name: str):
    cls, options = TRL_CONFIGS[name]
    return cls(output_dir="trainer_output", use_cpu=True, **options)


def _refused_here(name: str) -> set[str]:
    """General keys objective ``name`` refuses when set, because TRL's trainer ignores them (its sampler
    reads ``shuffle_dataset`` instead of ``train_sampling_strategy``)."""
    return {"train_sampling_strategy"} if OBJECTIVES[name].default_sampling_strategy is None else set()


def _fastalign_values(name: str) -> dict[str, object]:
    """The value each config key has in a fastalign run of objective ``name`` left at its defaults: the
    objective's resolved option where it reads the key, else the runner's."""
    reward = (
        ["fastalign.builtin:digit_ratio"] if name in ("grpo", "rloo", "online_dpo") else []
    )  # TRL needs one too
    config = with_objective_defaults(name, TrainConfig(reward_funcs=reward, **REQUIRED.get(name, {})))
    objective = OBJECTIVES[name].from_config(name, config, DistributedContext(0, 1, 0, torch.device("cpu")))
    read = OBJECTIVES[name].config_keys(name)
    readers = {key for cls_name, cls in OBJECTIVES.items() for key in cls.config_keys(cls_name)}
    values = {}
    for key in (f.name for f in dataclasses.fields(TrainConfig)):
        if key in read:
            value = getattr(objective.options, key, getattr(config, key))
        elif key in readers or key in _refused_here(name):
            continue  # only other objectives read it (and a set value is refused)
        else:
            value = getattr(config, key)
        if value is None and key in SAME_MEANING:
            value = SAME_MEANING[key](config)
        values[key] = value
    return values


def _same(ours: object, theirs: object) -> bool:
    if isinstance(ours, list) and not isinstance(theirs, list):  # fastalign's loss_type is always a list
        return ours == [theirs]
    return ours == theirs


@pytest.mark.parametrize("name", list(TRL_CONFIGS))
def test_defaults_are_trls_or_a_documented_difference(name):
    theirs = _trl_config(name)
    ours = _fastalign_values(name)
    shared = sorted(key for key in ours if hasattr(theirs, key))
    assert len(shared) > 15, shared  # the comparison covers the options users set
    differing = {key for key in shared if not _same(ours[key], getattr(theirs, key))}
    undocumented = {key: (ours[key], getattr(theirs, key)) for key in differing - DIFFERENCES}
    assert not undocumented, f"{name}: (fastalign, TRL) defaults differ: {undocumented}"


def test_every_documented_difference_is_real_and_in_the_docs():
    page = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
    table = page.read_text(encoding="utf-8").split("## The differences", 1)[1].split("\n#", 1)[0]
    for key in DIFFERENCES:
        assert any(
            not _same(_fastalign_values(name)[key], getattr(_trl_config(name), key)) for name in TRL_CONFIGS
        ), f"{key} is listed as a difference but every default matches TRL's now: drop it"
        assert re.search(rf"`{key}`", table), f"docs/trl.md's differences table does not mention `{key}`"
