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


def test_offloading_is_sized_for_the_rows_of_one_forward_and_the_processes_of_this_machine(monkeypatch):
    """A preference pair is one forward of two rows (DPO, reward, online DPO: ``rows_per_example``), and
    torchrun's local ranks offload into one host: the host check and the keep-on-device plan get the
    tokens of the whole forward, and the check every local process (they used to get half the tokens,
    and one process's share)."""
    from fastalign.train import memory, policy
    from fastalign.train.objectives import OBJECTIVES

    assert {name: OBJECTIVES[name].rows_per_example for name in ("dpo", "orpo", "reward", "online_dpo")} == {
        "dpo": 2, "orpo": 2, "reward": 2, "online_dpo": 2
    }  # fmt: skip
    assert {OBJECTIVES[name].rows_per_example for name in ("sft", "kto", "grpo", "rloo")} == {1}
    ppo = {  # the adapter critic's values run through the policy's stack too
        use_peft: OBJECTIVES["ppo"]
        .from_config(
            "ppo", TrainConfig(use_peft=use_peft, reward_funcs=["fastalign.builtin:digit_ratio"]), _ctx("cpu")
        )
        .rows_per_example
        for use_peft in (False, True)
    }
    assert ppo == {False: 1, True: 2}
    offloaded, planned = [], []
    monkeypatch.setattr(memory, "enable_activation_offloading", lambda model, **kw: offloaded.append(kw))
    monkeypatch.setattr(policy, "offload_keep_on_device", lambda *args: planned.append(args[3:]) or 0)
    monkeypatch.setattr(policy, "_place", lambda model, *args: model)
    monkeypatch.setattr(policy, "set_model_options", lambda *args: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    config = TrainConfig(
        max_length=4096,
        per_device_train_batch_size=3,
        gradient_checkpointing=True,
        activation_offloading=True,
    )
    for world_size, rows_per_example in ((1, 2), (8, 1)):
        ctx = DistributedContext(rank=0, world_size=world_size, local_rank=0, device=torch.device("cuda"))
        policy.prepare_policy(
            tiny_model("llama"), config, ctx, needs_fused_head=True, row_tokens=700,
            rows_per_example=rows_per_example,
        )  # fmt: skip
    assert [(kw["tokens"], kw["host_processes"]) for kw in offloaded] == [(700 * 6, 1), (700 * 3, 4)]
    assert planned == [(700, 6), (700, 3)]


def test_the_host_check_asks_room_for_every_process_of_this_machine(monkeypatch):
    from fastalign.train import memory
    from fastalign.train.memory import HostMemoryError, enable_activation_checkpointing

    model = tiny_model("llama")
    enable_activation_checkpointing(model)
    monkeypatch.setattr(memory, "_available_host_bytes", lambda: 3 * GiB)  # 1 GiB usable (a 2 GiB margin)
    fits = GiB // (2 * model.config.hidden_size * 4)  # tokens whose 2 layer inputs fill 1 GiB
    memory.enable_activation_offloading(model, tokens=fits // 2, host_processes=2).remove()
    with pytest.raises(HostMemoryError, match="for each of the 2 processes on this machine"):
        memory.enable_activation_offloading(model, tokens=fits, host_processes=2)
