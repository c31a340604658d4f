"""What an objective carries across steps is checkpointed (``Objective.state_dict``): a TR-DPO run killed
and resumed continues exactly with its synced reference; a checkpoint without that state is refused, not
resumed with a reset one. Also the registry: an unknown
objective and a key only other objectives read are one-line errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from fastalign.builtin import tiny_tokenizer
from fastalign.train.checkpoint import OBJECTIVE_STATE
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback
from fastalign.train.objectives import OBJECTIVES, make_objective
from fastalign.train.run import run_training
from tests.train.test_alignment import _Crash, config, logged

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))
#: TR-DPO syncing every step: the reference after the resume point differs from the initial one.
TR_DPO = {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}


@pytest.mark.slow
def test_a_resumed_tr_dpo_run_continues_exactly_with_its_synced_reference(tmp_path):
    options = dict(max_steps=4, save_steps=2, learning_rate=1e-2, **TR_DPO)
    run_training(config(tmp_path / "whole", "dpo", **options), "dpo")
    cfg = config(tmp_path / "resumed", "dpo", **options)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "dpo", callbacks=[_Crash(at=3)])
    assert (tmp_path / "resumed" / "checkpoint-2" / OBJECTIVE_STATE).is_dir()
    cfg.resume_from_checkpoint = "latest"
    run_training(cfg, "dpo")
    expected = {row["step"]: row for row in logged(tmp_path / "whole") if "loss" in row}
    got = {row["step"]: row for row in logged(tmp_path / "resumed") if "loss" in row}
    for step in (3, 4):
        for key in ("loss", "rewards/chosen", "rewards/margins"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_a_checkpoint_without_the_objective_state_is_refused(tmp_path):
    cfg = config(tmp_path / "run", "dpo", max_steps=4, save_steps=2, **TR_DPO)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "dpo", callbacks=[_Crash(at=3)])
    shutil.rmtree(tmp_path / "run" / "checkpoint-2" / OBJECTIVE_STATE)
    cfg.resume_from_checkpoint = "latest"
    with pytest.raises(ValueError, match=r"checkpoint-2' holds no objective state \(objective/: reference\."):
        run_training(cfg, "dpo")


def test_an_unknown_objective_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown objective 'nope'; known: sft, dpo"):
        make_objective("nope", TrainConfig(), CPU)


@pytest.mark.parametrize(
    ("name", "key", "value", "readers"),
    [
        ("dpo", "cpo_alpha", 2.0, "simpo, cpo"),
        ("sft", "beta", 0.2, "dpo, simpo, cpo, orpo, kto, online_dpo, grpo, rloo, distill"),
        ("grpo", "precompute_ref_log_probs", True, "dpo, kto"),
        ("simpo", "ref_model_name_or_path", "ref", "dpo, kto, online_dpo, grpo, rloo, ppo"),
        ("kto", "packing", True, "sft"),
    ],
)
def test_a_key_only_other_objectives_read_is_refused(name, key, value, readers):
    overrides = {"reward_funcs": ["fastalign.builtin:digit_ratio"]} if name == "grpo" else {}
    with pytest.raises(ConfigError) as caught:
        make_objective(name, TrainConfig(**{key: value, **overrides}), CPU)
    assert str(caught.value) == (
        f"config key {key!r} ({value!r}) is for {readers}; {name} does not read it: remove it"
    )


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_has_its_built_in_data_and_tokenizes_it(name):
    """Each registered objective makes itself from the defaults and reads its own built-in data set."""
    from fastalign.train.loading import load_dataset_rows

    overrides = {
        "grpo": {"reward_funcs": ["fastalign.builtin:digit_ratio"]},
        "rloo": {"reward_funcs": ["fastalign.builtin:digit_ratio"]},
        "ppo": {"reward_funcs": ["fastalign.builtin:digit_ratio"]},
        "online_dpo": {"reward_funcs": ["fastalign.builtin:digit_ratio"]},
        "distill": {"teacher_model_name_or_path": "tiny-qwen2"},
    }.get(name, {})
    lengths = {"max_prompt_length": 128} if name in ("grpo", "rloo", "ppo") else {"max_length": 128}
    objective = make_objective(name, TrainConfig(**lengths, **overrides), CPU)
    examples = objective.tokenize(load_dataset_rows(objective.default_dataset), tiny_tokenizer())
    assert len(examples) > 8


class _DropoutProbabilities(Callback):
    """Records the p of every dropout module of the model being trained."""

    def on_train_begin(self, engine) -> None:
        self.seen = {m.p for m in engine.model.modules() if isinstance(m, torch.nn.Dropout)}


@pytest.mark.parametrize(
    ("name", "disable_dropout", "expected"),
    [("dpo", None, {0.0}), ("dpo", False, {0.1}), ("kto", None, {0.0}), ("grpo", None, {0.1})],
)
def test_disable_dropout_follows_trl_defaults(tmp_path, name, disable_dropout, expected):
    """TRL's defaults: dropout (LoRA's here) off for the preference objectives, on for GRPO."""
    options = dict(max_steps=1, use_peft=True, lora_r=4, lora_dropout=0.1, disable_dropout=disable_dropout)
    seen = _DropoutProbabilities()
    run_training(config(tmp_path, name, **options), name, callbacks=[seen])
    assert seen.seen == expected
