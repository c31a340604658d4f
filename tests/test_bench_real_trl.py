"""benchmarks/e2e/bench_real_trl.py sets both tools up alike: every option it hands both is a valid option
of fastalign's config and of TRL's config for the objective, with the same value on both sides; its rows
fit the run's max_length on the real tokenizer. (The benchmark itself runs for minutes to hours.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.e2e import bench_real_trl as bench
from fastalign.train.config import TrainConfig, check_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from tests.helpers import require

TRL_CONFIGS = {"sft": "SFTConfig", "dpo": "DPOConfig", "dpo-lora": "DPOConfig", "kto": "KTOConfig",
               "grpo": "GRPOConfig"}  # fmt: skip


def spec(objective: str, setting: str) -> dict:
    preset = bench.PRESETS["cpu"]
    return {"objective": objective, "setting": setting, "seed": 0, **preset}


@pytest.mark.parametrize("setting", list(bench.SETTINGS))
@pytest.mark.parametrize("objective", bench.OBJECTIVES)
def test_both_tools_take_the_shared_options_with_the_same_values(objective, setting, tmp_path):
    require("trl")
    import trl

    options = bench.shared_options(spec(objective, setting))
    rewards = {"reward_funcs": [f"benchmarks.e2e.bench_real_trl:{bench.distinct_tokens.__name__}"]}
    config = TrainConfig(output_dir=str(tmp_path), **options, **(rewards if objective == "grpo" else {}))
    check_config(config)
    name = "dpo" if objective == "dpo-lora" else objective
    make_objective(
        name, config, DistributedContext(0, 1, 0, torch.device("cpu"))
    )  # no key only other objectives read
    theirs = getattr(trl, TRL_CONFIGS[objective])(output_dir=str(tmp_path), use_cpu=True, **options)
    for key, value in options.items():
        assert getattr(config, key) == getattr(theirs, key) == value, key
    # "defaults" leaves bf16 and checkpointing to each tool: TRL turns both on, fastalign neither
    fields = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    if setting == "defaults":
        assert theirs.bf16 and theirs.gradient_checkpointing
        assert not fields["bf16"] and not fields["gradient_checkpointing"]
    else:
        assert theirs.bf16 == config.bf16 and theirs.gradient_checkpointing == config.gradient_checkpointing


@pytest.mark.real
@pytest.mark.parametrize("objective", bench.OBJECTIVES)
def test_rows_fit_the_max_length_at_about_the_lengths_asked(smollm2, objective):
    from transformers import AutoTokenizer

    preset = bench.PRESETS["cpu"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt, completion = preset["prompt_tokens"], preset["completion_tokens"]
    rows = bench.make_rows(tokenizer, objective, preset["batch"], prompt, completion)
    assert len(rows) == preset["batch"] and len({row["prompt"] for row in rows}) == len(rows)
    tokens = bench.step_tokens(tokenizer, objective, rows, completion)
    sequences = len(rows) * (2 if objective.startswith("dpo") else 1)
    assert (prompt + completion) * 0.95 <= tokens / sequences <= preset["max_length"]
    if objective.startswith("dpo"):
        assert all(row["chosen"] != row["rejected"] for row in rows)
    if objective == "kto":
        assert {row["label"] for row in rows} == {True, False}
