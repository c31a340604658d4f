"""The order training reads the data in: ``train_sampling_strategy`` (transformers' random or sequential;
KTO's default sequential, as TRL's KTOConfig) and TRL's ``shuffle_dataset`` (grpo, rloo, distill)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_kto_rows, tiny_sft_rows, tiny_tokenizer
from fastalign.train.batches import BatchPosition, MicroBatches
from fastalign.train.checkpoint import CONFIG_KEY, TRAINER_STATE
from fastalign.train.config import ConfigError, TrainConfig, check_config, load_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective, with_objective_defaults
from fastalign.train.objectives.base import BatchPlan
from fastalign.train.run import run_training
from tests.train.runs import logged, short_config

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def order_of(batches: MicroBatches, steps: int) -> list[int]:
    """The example ids (each example's one token) the steps read, micro-batch by micro-batch."""
    ids, position = [], BatchPosition()
    for _ in range(steps):
        for batch in batches.step_batches(position):
            ids += batch["input_ids"][:, 0].tolist()
        position = batches.advance(position)
    return ids


def micro_batches(shuffle: bool, rank: int = 0, world_size: int = 1) -> MicroBatches:
    from fastalign.data.sft import TokenizedExample

    examples = [TokenizedExample([i + 10], [1]) for i in range(12)]
    return MicroBatches(
        examples, batch_size=2, accumulation=2, pad_token_id=0, seed=3, shuffle=shuffle, rank=rank,
        world_size=world_size,
    )  # fmt: skip


def test_sequential_reads_the_data_in_its_order_every_epoch_and_random_reshuffles():
    assert order_of(micro_batches(False), 6) == list(range(10, 22)) * 2  # 3 steps an epoch
    shuffled = order_of(micro_batches(True), 6)
    assert shuffled[:12] != list(range(10, 22)) and shuffled[:12] != shuffled[12:]
    assert sorted(shuffled[:12]) == list(range(10, 22))


def test_sequential_deals_consecutive_micro_batches_to_the_ranks_as_accelerate_does():
    # rank r's k-th micro-batch of step s is the data's (s·A + k)·W + r-th block of batch_size rows
    ranks = [order_of(micro_batches(False, rank, 2), 1) for rank in range(2)]
    assert ranks == [[10, 11, 14, 15], [12, 13, 16, 17]]


@pytest.mark.parametrize(
    ("name", "options", "strategy", "shuffle"),
    [
        ("sft", {}, "random", True),
        ("kto", {}, "sequential", False),  # TRL's KTOConfig default
        ("dpo", {"train_sampling_strategy": "sequential"}, "sequential", False),
        ("grpo", {}, None, True),  # TRL's GRPO, RLOO and distillation samplers read shuffle_dataset
        ("grpo", {"shuffle_dataset": False}, None, False),
        ("rloo", {"shuffle_dataset": False}, None, False),
        ("distill", {"shuffle_dataset": False}, None, False),
    ],
)
def test_each_objective_reads_in_its_trl_order(name, options, strategy, shuffle):
    config = with_objective_defaults(name, TrainConfig(**options, **NEEDS.get(name, {})))
    assert config.train_sampling_strategy == strategy
    check_config(config)  # what a run saves is a valid config again
    make_objective(name, config, CPU)
    assert BatchPlan.from_config(config, tiny_tokenizer(), CPU).shuffle is shuffle


#: What each objective needs to be made at all.
NEEDS = {
    "grpo": {"reward_funcs": ["exact_match"]},
    "rloo": {"reward_funcs": ["exact_match"]},
    "distill": {"teacher_model_name_or_path": "tiny-llama"},
}


def test_each_key_is_refused_where_trl_does_not_read_it():
    with pytest.raises(
        ConfigError, match=r"'shuffle_dataset' .* is for grpo, rloo, distill; sft does not read it"
    ):
        make_objective("sft", TrainConfig(shuffle_dataset=False), CPU)
    for name in ("grpo", "rloo", "distill"):
        config = TrainConfig(train_sampling_strategy="sequential", **NEEDS[name])
        with pytest.raises(
            ConfigError, match=f"'train_sampling_strategy' .*{name} orders its prompts by shuffle_dataset"
        ):
            make_objective(name, config, CPU)
    with pytest.raises(ConfigError, match=r"'train_sampling_strategy' .*must be one of random, sequential"):
        load_config(None, ["--train_sampling_strategy", "group_by_length"])


@pytest.mark.parametrize(
    ("name", "rows", "resumes"), [("sft", tiny_sft_rows(8), True), ("kto", tiny_kto_rows(8), False)]
)
def test_a_checkpoint_saved_before_the_key_resumes_as_it_ran(tmp_path, name, rows, resumes):
    """A checkpoint from before ``train_sampling_strategy`` read its data reshuffled (random): an sft run
    resumes it; a kto run, which now reads the data's order, is refused naming the key."""
    config = short_config(
        tmp_path,
        rows,
        max_steps=2,
        lr_scheduler_type="constant",
        save_steps=1,
        save_strategy="steps",
        per_device_train_batch_size=2,
    )
    run_training(config, name)
    checkpoint = Path(config.output_dir) / "checkpoint-2"
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    del state[CONFIG_KEY]["train_sampling_strategy"]
    (checkpoint / TRAINER_STATE).write_text(json.dumps(state))
    again = dataclasses.replace(config, max_steps=3, resume_from_checkpoint=str(checkpoint))
    if resumes:
        run_training(again, name)
        assert [row["step"] for row in logged(config.output_dir)][-1] == 3
    else:
        with pytest.raises(ConfigError, match="train_sampling_strategy 'random' -> 'sequential'"):
            run_training(again, name)
