"""GRPO's and RLOO's rollout options (TRL's names): the sampling options reach ``generate``, each
objective's TRL defaults, the keys each refuses, the completions log and evaluation by sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_prompt_rows, tiny_tokenizer
from fastalign.data.preference import PromptExample
from fastalign.train.config import SHARED_DEFAULTS, ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from fastalign.train.rollout import SamplingOptions, generate_completions
from tests.train.runs import short_config, train

DIGITS = "fastalign.builtin:digit_ratio"
CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return tiny_model("llama").eval()  # generate needs no patch (and is fast without one)


def prompts(tokenizer) -> dict:
    ids = torch.tensor([tokenizer.encode("What is 2 + 3?")] * 2)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def sample(model, options: SamplingOptions, seed: int):
    torch.manual_seed(seed)
    (done,) = generate_completions(model, [prompts(tiny_tokenizer())], options, tiny_tokenizer(), CPU)
    return done


def test_generate_receives_the_sampling_options_and_generation_kwargs_win(policy, monkeypatch):
    seen = {}
    generate = policy.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return generate(**kwargs)

    monkeypatch.setattr(policy, "generate", spy)
    options = SamplingOptions(
        2,
        5,
        engine="generate",
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        generation_kwargs={"top_k": 3, "no_repeat_ngram_size": 2},
    )
    done = sample(policy, options, seed=0)
    assert done.completion_ids.shape[0] == 4  # 2 prompts × 2 completions
    expected = dict(
        do_sample=True,
        max_new_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=3,  # generation_kwargs merged over the options, as TRL
        min_p=0.05,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
    )
    assert {key: seen[key] for key in expected} == expected


def test_top_k_1_samples_greedily(policy):
    options = SamplingOptions(2, 6, temperature=1.0, top_k=1)
    first, second = sample(policy, options, seed=0), sample(policy, options, seed=1)
    torch.testing.assert_close(first.completion_ids, second.completion_ids)
    batch = prompts(tiny_tokenizer())
    greedy = policy.generate(
        **batch, do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=tiny_tokenizer().eos_token_id
    )[:, batch["input_ids"].shape[1] :]
    width = first.completion_ids.shape[1]
    expected = greedy[:, :width].repeat_interleave(2, 0).masked_fill(first.completion_mask == 0, 0)
    torch.testing.assert_close(first.completion_ids.masked_fill(first.completion_mask == 0, 0), expected)
    # and full sampling draws differently with another seed
    free = SamplingOptions(2, 6, temperature=1.0)
    assert not torch.equal(sample(policy, free, 0).completion_ids, sample(policy, free, 1).completion_ids)


def test_an_unknown_generation_kwarg_is_refused_by_generate(policy):
    with pytest.raises(ValueError, match="no_such_option"):
        sample(policy, SamplingOptions(2, 3, generation_kwargs={"no_such_option": 1}), seed=0)


@pytest.mark.parametrize(
    ("name", "generations", "beta", "dropout"), [("grpo", 8, 0.0, False), ("rloo", 2, 0.05, False)]
)
def test_trl_defaults_per_objective(name, generations, beta, dropout):
    objective = make_objective(name, TrainConfig(reward_funcs=[DIGITS]), CPU)
    options = objective.options
    assert (options.num_generations, options.beta, options.disable_dropout) == (generations, beta, dropout)
    assert options.max_completion_length == 512 and options.top_k == 0 and options.repetition_penalty == 1.0


@pytest.mark.parametrize(
    ("name", "key", "value", "readers"),
    [
        ("rloo", "advantage_estimator", "rloo", "grpo"),
        ("rloo", "loss_type", ["grpo"], "grpo"),
        ("rloo", "scale_rewards", "none", "grpo"),
        ("rloo", "importance_sampling_level", "sequence", "grpo"),
        ("grpo", "normalize_advantages", True, "rloo"),
        ("grpo", "reward_clip_range", [0.0, 1.0], "rloo"),
    ],
)
def test_each_objective_refuses_the_others_keys(name, key, value, readers):
    with pytest.raises(ConfigError, match=rf"'{key}'.*is for .*{readers}; {name} does not read it"):
        make_objective(name, TrainConfig(reward_funcs=[DIGITS], **{key: value}), CPU)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"generation_kwargs": {"num_return_sequences": 2}}, "generation_kwargs"),
        # a completion a stop string ends has no EOS: it used to crash at the first rollout (generate
        # wants the tokenizer), or, given one, count as truncated
        ({"generation_kwargs": {"stop_strings": ["."]}}, "generation_kwargs' sets stop_strings"),
        ({"use_vllm": True, "top_k": 5}, "use_vllm"),  # vLLM is refused whatever the sampling options
        (
            {"eval_split_ratio": 0.25, "per_device_eval_batch_size": 6, "num_generations_eval": 4},
            "per_device_eval_batch_size",
        ),
    ],
)
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_rollout_options_that_cannot_work_are_refused(name, options, key):
    with pytest.raises(ConfigError, match=key):
        make_objective(name, TrainConfig(reward_funcs=[DIGITS], num_generations=2, **options), CPU)


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_truncation_without_max_prompt_length_is_refused(name):
    """Prompts are truncated to max_prompt_length only: without it, truncation would be ignored."""
    with pytest.raises(ConfigError, match=r"config key 'truncation' .* only with max_prompt_length"):
        make_objective(name, TrainConfig(reward_funcs=[DIGITS], truncation=True), CPU)
    make_objective(name, TrainConfig(reward_funcs=[DIGITS], truncation=True, max_prompt_length=32), CPU)


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_max_length_is_refused(name):
    """TRL's GRPOConfig and RLOOConfig (and its former PPOConfig) have no max_length: accepted, it would
    be ignored (a row is a prompt, cut to max_prompt_length, and a completion of max_completion_length)."""
    with pytest.raises(
        ConfigError,
        match=rf"^config key 'max_length' \(64\) is for sft, .*; {name} does not read it \(TRL's config has "
        r"none: max_prompt_length and max_completion_length bound its rows\): remove it$",
    ):
        make_objective(name, TrainConfig(reward_funcs=[DIGITS], max_length=64), CPU)
    make_objective(name, TrainConfig(reward_funcs=[DIGITS]), CPU)
    make_objective(name, TrainConfig(reward_funcs=[DIGITS], max_length=1024), CPU)  # an old config's default


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_the_throughput_estimate_takes_the_longest_prompt_and_a_whole_completion(name):
    """MFU's attention term: the longest training prompt plus max_completion_length (not max_length)."""
    objective = make_objective(name, TrainConfig(reward_funcs=[DIGITS], max_completion_length=12), CPU)
    prompts = [PromptExample(list(range(length)), "p", {}) for length in (3, 9, 5)]
    assert objective.sequence_length(TrainConfig(), prompts) == 9 + 12


class _Stop(Exception):
    pass


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_the_policy_is_prepared_for_rows_of_the_longest_prompt_and_a_whole_completion(
    name, tmp_path, monkeypatch
):
    """Activation offloading's host pool and its keep-on-device plan are sized from the objective's row
    length (the longest prompt + max_completion_length), not the max_length these objectives refuse."""
    import fastalign.train.run as run_module

    seen = {}

    def prepare(model, config, ctx, *, row_tokens, **_):
        seen["row_tokens"] = row_tokens
        raise _Stop

    monkeypatch.setattr(run_module, "prepare_policy", prepare)
    rows = tiny_prompt_rows(6)
    config = short_config(tmp_path, rows, reward_funcs=[DIGITS], max_completion_length=11)
    with pytest.raises(_Stop):
        run_module.run_training(config, name)
    objective = make_objective(name, config, CPU)
    longest = max(len(example.prompt_ids) for example in objective.tokenize(rows, tiny_tokenizer()))
    assert seen["row_tokens"] == longest + 11 != SHARED_DEFAULTS["max_length"]


def run(tmp_path: Path, name: str, **options) -> list[dict]:
    defaults = dict(reward_funcs=[DIGITS], num_generations=4, max_completion_length=6)
    config = short_config(tmp_path, tiny_prompt_rows(20), per_device_train_batch_size=8, **defaults | options)
    return train(config, name)


@pytest.mark.slow
def test_log_completions_writes_each_generation_at_the_logging_steps(tmp_path):
    rows = run(tmp_path, "rloo", log_completions=True, beta=0.0)
    assert {"reward", "reward_std", "frac_reward_zero_std", "clip_ratio/region_mean"} <= set(rows[0])
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1] * 8 + [2] * 8  # one generation a step, 8 completions
    first = logged[0]
    assert set(first) == {"step", "prompt", "completion", "digit_ratio", "advantage"}
    assert isinstance(first["prompt"], str) and isinstance(first["completion"], str)
    # RLOO's leave-one-out advantages of one group sum to 0
    assert sum(row["advantage"] for row in logged[:4]) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_evaluation_samples_the_held_out_prompts_and_logs_eval_rewards(tmp_path, name):
    rows = run(
        tmp_path,
        name,
        eval_split_ratio=0.2,  # 4 prompts × 3 completions: 2 evaluation micro-batches of 6
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=6,
        num_generations_eval=3,
    )
    evaluations = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in evaluations] == [1, 2]
    for row in evaluations:
        assert 0.0 <= row["eval_reward"] <= 1.0 and row["eval_completions/mean_length"] > 0
        assert "eval_reward_std" in row and "eval_entropy" in row
        assert not any(key.startswith("eval_timing") for key in row)
    if name == "rloo":  # its default beta (0.05): the reference's KL, folded into the reward
        assert "eval_kl" in evaluations[0] and "kl" in rows[0]
