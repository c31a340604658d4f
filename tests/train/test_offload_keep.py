"""``activation_offloading_keep_on_device``: a number as given; "auto" the memory planner's most layers that
fit on a CUDA device (its memory monkeypatched here), 0 on the CPU; a bad value is one line."""

from __future__ import annotations

import types

import pytest
import torch

from fastalign.builtin import tiny_model
from fastalign.plan import PlanError, plan_memory
from fastalign.plan.planner import AUTO_KEEP_SHARE
from fastalign.train.config import ConfigError, TrainConfig, load_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.policy import offload_keep_on_device

GiB = 2**30


def _ctx(device: str) -> DistributedContext:
    return DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device(device))


def test_a_number_is_kept_and_auto_is_0_on_the_cpu():
    model = tiny_model("llama")
    assert (
        offload_keep_on_device(model, TrainConfig(activation_offloading_keep_on_device=3), _ctx("cpu")) == 3
    )
    assert offload_keep_on_device(model, TrainConfig(), _ctx("cpu")) == 0


def test_auto_on_cuda_is_the_planners_choice_for_the_gpus_memory(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=6)
    config = TrainConfig(
        use_peft=True,
        bf16=True,
        max_length=4096,
        per_device_train_batch_size=1,
        gradient_checkpointing=True,
        activation_offloading=True,
    )
    plan = dict(
        method="lora",
        seq_len=4096,
        checkpointing=True,
        offload_activations=True,
        lora_dropout=0.05,
        suggest=False,
    )
    answers = set()
    fits = plan_memory(model.config, **plan, keep_on_device=0).total_per_gpu
    for memory in (int(fits / AUTO_KEEP_SHARE) + 1, 80 * GiB):
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device, memory=memory: types.SimpleNamespace(total_memory=memory),
        )
        keep = plan_memory(model.config, **plan, gpu_memory_bytes=memory).offload_keep_on_device
        assert offload_keep_on_device(model, config, _ctx("cuda")) == keep
        answers.add(keep)
    assert answers == {0, 6}  # none kept where offloading every layer just fits; all six on 80 GB


def test_auto_plans_for_the_rows_the_objective_trains_on(monkeypatch):
    """``row_tokens`` (an objective's row length, e.g. GRPO's prompt + completion) is the planned length."""
    seen = []

    def plan(config, **options):
        seen.append(options["seq_len"])
        raise PlanError("seq_len", "stop")  # "auto" keeps none where the planner cannot plan

    monkeypatch.setattr("fastalign.plan.plan_memory", plan)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80 * GiB)
    )
    model = tiny_model("llama")
    config = TrainConfig(max_length=4096, gradient_checkpointing=True, activation_offloading=True)
    assert offload_keep_on_device(model, config, _ctx("cuda"), row_tokens=700) == 0
    assert offload_keep_on_device(model, config, _ctx("cuda")) == 0
    assert seen == [700, 4096]


def test_the_config_key_takes_a_number_or_auto():
    key, on = "--activation_offloading_keep_on_device", "--activation_offloading=true"
    assert load_config(overrides=[on, f"{key}=3"]).activation_offloading_keep_on_device == 3
    assert load_config(overrides=[on, f"{key}=auto"]).activation_offloading_keep_on_device == "auto"
    for value in ("-1", "all", "1.5"):
        with pytest.raises(ConfigError, match=r"must be a number of layers \(0 or more\) or \"auto\""):
            load_config(overrides=[on, f"{key}={value}"])
