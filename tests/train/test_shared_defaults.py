"""``max_length`` and ``temperature`` default to null and each objective that reads them takes TRL's value
(``SHARED_DEFAULTS``: 1024 and 1.0; OnlineDPOConfig's 512 and 0.9). Configs and checkpoints written when
they defaulted to 1024 and 1.0 for every objective still load and resume as before."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from fastalign.train.config import SHARED_DEFAULTS, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective, with_objective_defaults
from fastalign.train.run_dir import _changed_keys

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))
REWARD = {"reward_funcs": ["fastalign.builtin:digit_ratio"]}
NEEDS = {name: REWARD for name in ("grpo", "rloo", "ppo", "online_dpo")} | {
    "distill": {"teacher_model_name_or_path": "tiny-llama"}
}
OLD_DEFAULTS = {"max_length": 1024, "temperature": 1.0}


@pytest.mark.parametrize(
    ("name", "max_length", "temperature"),
    [
        ("sft", 1024, None), ("dpo", 1024, None), ("grpo", None, 1.0), ("online_dpo", 512, 0.9),
        ("distill", 1024, 1.0),
    ],
)  # fmt: skip
def test_each_objective_fills_what_it_reads_with_trls_default(name, max_length, temperature):
    config = with_objective_defaults(name, TrainConfig(**NEEDS.get(name, {})))
    assert (config.max_length, config.temperature) == (max_length, temperature)
    options = make_objective(name, config, CPU).options
    for key, value in (("max_length", max_length), ("temperature", temperature)):
        assert getattr(options, key, None) == value


@pytest.mark.parametrize(
    "name", ["sft", "dpo", "kto", "reward", "grpo", "rloo", "ppo", "online_dpo", "distill"]
)
def test_a_config_spelling_out_the_old_defaults_still_loads(name):
    """An old run's saved config (every key written) used as a config: the objectives that do not read
    a key are given its old default, which is no setting (it used to be refused once the default was null)."""
    make_objective(
        name, with_objective_defaults(name, TrainConfig(**OLD_DEFAULTS, **NEEDS.get(name, {}))), CPU
    )


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "distill", "online_dpo"])
def test_a_checkpoint_saved_with_the_old_defaults_resumes_where_they_still_hold(name):
    saved = asdict(with_objective_defaults(name, TrainConfig(**NEEDS.get(name, {})))) | OLD_DEFAULTS
    current = asdict(with_objective_defaults(name, TrainConfig(**NEEDS.get(name, {}))))
    changed = {key: (old, new) for key, old, new in _changed_keys(saved, current)}
    if name == "online_dpo":  # TRL's OnlineDPOConfig values now: the run would change, and says so
        assert changed == {"max_length": (1024, 512), "temperature": (1.0, 0.9)}
    else:
        assert changed == {}
    assert set(OLD_DEFAULTS) == set(SHARED_DEFAULTS) and OLD_DEFAULTS == SHARED_DEFAULTS
