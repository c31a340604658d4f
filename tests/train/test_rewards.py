"""GRPO reward functions: built-ins on standard and conversational samples, spec resolution, None → NaN,
nan-aware metrics, and one-line errors that name the spec, the function and the failing sample."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from fastalign.ops import combine_rewards
from fastalign.train.rewards import (
    BUILTIN_REWARDS,
    RewardFunction,
    compute_rewards,
    contains_answer,
    exact_match,
    length_penalty,
    regex_reward,
    resolve_reward_funcs,
    reward_metrics,
)


def my_reward(prompts, completions, completion_ids, **kwargs):
    """Imported by path in the tests below: the completion's length in characters, None when empty."""
    return [float(len(c)) if c else None for c in completions]


NOT_A_FUNCTION = 3


def conversational(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def rewards(spec, completions, completion_ids=None, **columns) -> list[float]:
    """One spec on a batch, through resolve and compute (as the trainer calls it), as a list."""
    completion_ids = completion_ids or [[1]] * len(completions)
    funcs = resolve_reward_funcs([spec])
    table = compute_rewards(funcs, ["p"] * len(completions), completions, completion_ids, columns)
    return table[:, 0].tolist()


def value_error(call, *args, **kwargs) -> str:
    """The one-line ValueError message that ``call`` raises."""
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    message = str(error.value)
    assert message and "\n" not in message
    return message


# built-ins


def test_exact_match_compares_stripped_text_or_the_last_number():
    completions = ["  Paris \n", "paris", "so 6 x 7 = 42.", "The total is 1,234.0 apples", "42 then 43", "x"]
    answers = ["Paris", "Paris", 42, "1234", "42", None]
    got = rewards("exact_match", completions, answer=answers)
    assert got[:5] == [1.0, 0.0, 1.0, 1.0, 0.0] and math.isnan(got[5])
    # a non-numeric answer is only matched as text; a number is not "found" in digit-free text
    assert exact_match(None, ["v2 is 2"], None, answer=["v2"]) == [0.0]
    assert exact_match(None, ["none here"], None, answer=[7]) == [0.0]
    assert exact_match(None, ["-3.50"], None, answer=[-3.5]) == [1.0]


def test_exact_match_and_contains_answer_read_the_last_message_of_a_conversation():
    completions = [conversational("It is 12."), [{"role": "user", "content": "12"}, *conversational("no")]]
    assert rewards("exact_match", completions, answer=["12", "12"]) == [1.0, 0.0]
    assert rewards("contains_answer", completions, answer=[12, 12]) == [1.0, 0.0]


def test_contains_answer_looks_for_the_answer_anywhere():
    got = rewards("contains_answer", ["I think Paris.", "Lyon", "x"], answer=["Paris", "Paris", None])
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2])


def test_regex_searches_each_completion():
    completions = [
        "The answer is 42",
        "I guess the answer is 42",
        "The answer is x",
        conversational("The answer is 7"),
    ]
    assert rewards(r"regex:^The answer is \d+", completions) == [1.0, 0.0, 0.0, 1.0]
    assert rewards("regex:(?s)<a>.*</a>", ["<a>\n1\n</a>", "<a>1"]) == [1.0, 0.0]
    assert rewards("regex:a:b", ["xa:b", "ab"]) == [1.0, 0.0]  # the pattern may hold a colon
    assert regex_reward("b").__name__ == "regex"


def test_length_penalty_is_zero_at_the_target_and_minus_one_at_zero_or_twice_it():
    ids = [[0] * 64, [], [0] * 128, [0] * 32]
    assert rewards("length_penalty", ["x"] * 4, ids) == [0.0, -1.0, -1.0, -0.5]
    assert rewards("length_penalty:4", ["x"] * 3, [[0] * 4, [0] * 5, [0] * 2]) == [0.0, -0.25, -0.5]
    assert length_penalty(10)(None, None, [[0] * 15]) == [-0.5]


def test_every_builtin_accepts_extra_columns_it_does_not_use():
    for name in ("exact_match", "contains_answer", "regex:a", "length_penalty"):
        assert len(rewards(name, ["a", "b"], answer=["a", "c"], other=[1, 2])) == 2
    assert set(BUILTIN_REWARDS) == {"exact_match", "contains_answer", "regex", "length_penalty"}


# resolving specs


def test_import_paths_files_and_callables_resolve_with_their_names(tmp_path):
    (tmp_path / "x.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Scale:\n    k: float = 2.0\n\n"
        "def f(prompts, completions, completion_ids, **kwargs):\n"
        "    return [Scale().k * len(ids) for ids in completion_ids]\n"
    )

    def custom(prompts, completions, completion_ids, **kwargs):
        return [1.0] * len(completions)

    funcs = resolve_reward_funcs(
        [
            "tests.train.test_rewards:my_reward",
            f"{tmp_path / 'x.py'}:f",
            custom,
            RewardFunction("mine", custom),
        ]
    )
    assert [func.name for func in funcs] == ["my_reward", "f", "custom", "mine"]
    assert funcs[0].fn is my_reward
    got = compute_rewards(funcs, ["p", "q"], ["abc", ""], [[1, 2], [3]], {})
    expected = torch.tensor([[3.0, 4.0, 1.0, 1.0], [math.nan, 2.0, 1.0, 1.0]])
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got.dtype == torch.float32
    assert resolve_reward_funcs("os.path:join")[0].name == "join"  # a lone spec and a dotted module


def test_repeated_names_get_a_suffix_so_each_has_its_own_metrics():
    funcs = resolve_reward_funcs(["regex:a", "regex:b", "regex:c", "exact_match"])
    assert [func.name for func in funcs] == ["regex", "regex_2", "regex_3", "exact_match"]


@pytest.mark.parametrize(
    ("specs", "pattern"),
    [
        ([], r"^reward_funcs: no reward functions given"),
        (
            ["exact_mach"],
            r"reward_funcs: unknown built-in reward 'exact_mach' .*did you mean 'exact_match'\?",
        ),
        (
            ["nothing_like_it"],
            r"unknown built-in reward 'nothing_like_it' .*'module:function' or 'module.function'",
        ),
        (
            ["no_such_module_xyz:f"],
            r"reward_funcs: 'no_such_module_xyz:f': no module named 'no_such_module_xyz'",
        ),
        (["tests.train.nope:f"], r"'tests.train.nope:f': no module named 'tests.train.nope'"),
        (["tests.train.test_rewards:my_rewrd"], r"has no attribute 'my_rewrd'; did you mean 'my_reward'\?"),
        (
            ["tests.train.test_rewards:NOT_A_FUNCTION"],
            r"'tests.train.test_rewards:NOT_A_FUNCTION' is not callable \(type int\)$",
        ),
        (["regex:("], r"reward_funcs: 'regex:\(': bad regular expression: missing \)"),
        (["regex:"], r"reward_funcs: 'regex:': built-in 'regex' needs a pattern"),
        (["exact_match:x"], r"reward_funcs: 'exact_match:x': built-in 'exact_match' takes no parameter"),
        (["length_penalty:0"], r"'length_penalty:0': the target must be a positive whole number .* got '0'"),
        (["length_penalty:ten"], r"'length_penalty:ten': the target must be a positive whole number"),
        ([42], r"reward_funcs: a spec must be .* got 42 \(int\)"),
        (["missing.py:f"], r"reward_funcs: 'missing.py:f': file 'missing.py' not found"),
    ],
)
def test_bad_specs_are_one_line_errors_naming_reward_funcs_and_the_spec(specs, pattern):
    assert re.search(pattern, value_error(resolve_reward_funcs, specs))


def test_a_file_that_fails_to_load_names_the_spec_and_the_error(tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    spec = f"{tmp_path / 'broken.py'}:f"
    message = value_error(resolve_reward_funcs, [spec])
    assert message.startswith(f"reward_funcs: {spec!r}: loading") and "ModuleNotFoundError" in message


def test_a_module_whose_own_import_fails_is_not_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = value_error(resolve_reward_funcs, ["needs_dep:f"])
    assert message == (
        "reward_funcs: 'needs_dep:f': importing 'needs_dep' failed: No module named 'no_such_dependency_xyz'"
    )


# calling


def test_none_becomes_nan_and_combine_rewards_weights_the_rest():
    def half(prompts, completions, completion_ids, **kwargs):
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    def never(prompts, completions, completion_ids, **kwargs):
        return [None] * len(completions)

    funcs = resolve_reward_funcs(["exact_match", half, never])
    got = compute_rewards(funcs, ["p"] * 3, ["1", "2", "x"], [[1]] * 3, {"answer": ["1", "1", None]})
    torch.testing.assert_close(
        got,
        torch.tensor([[1.0, 0.5, math.nan], [0.0, math.nan, math.nan], [math.nan, 0.5, math.nan]]),
        equal_nan=True,
    )
    combined = combine_rewards(got, torch.tensor([2.0, -1.0, 5.0]))
    torch.testing.assert_close(combined, torch.tensor([1.5, 0.0, -0.5]))
    all_none = combine_rewards(compute_rewards(funcs[2:], ["p"], ["x"], [[1]], {}))
    assert torch.isnan(all_none).all()


def test_completions_no_function_scores_are_said_in_one_warning(caplog):
    """As TRL's "All reward functions returned None": before, a run whose functions all returned None
    trained nothing (advantage 0 everywhere, loss 0) and said nothing."""

    def never(prompts, completions, completion_ids, **kwargs):
        return [None] * len(completions)

    def odd(prompts, completions, completion_ids, **kwargs):
        return [1.0 if i % 2 else None for i in range(len(completions))]

    with caplog.at_level("WARNING", logger="fastalign.train.rewards"):
        compute_rewards(resolve_reward_funcs([never, odd]), ["p"] * 4, ["a", "b", "c", "d"], [[1]] * 4, {})
    (record,) = caplog.records
    assert "returned None for 2 of 4 completions" in record.getMessage() and "'a'" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastalign.train.rewards"):
        compute_rewards(
            resolve_reward_funcs([odd, "exact_match"]),
            ["p"] * 2,
            ["1", "2"],
            [[1]] * 2,
            {"answer": ["1", "1"]},
        )
    assert not caplog.records  # every completion has a score


def test_metrics_are_nan_aware_per_function():
    funcs = resolve_reward_funcs(["regex:a", "exact_match", "length_penalty"])
    table = torch.tensor([[1.0, math.nan, 0.0], [0.0, 2.0, math.nan], [1.0, math.nan, math.nan]])
    metrics = reward_metrics(funcs, table)
    assert list(metrics) == [
        "rewards/regex/mean",
        "rewards/regex/std",
        "rewards/exact_match/mean",
        "rewards/exact_match/std",
        "rewards/length_penalty/mean",
        "rewards/length_penalty/std",
    ]
    assert metrics["rewards/regex/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/regex/std"] == pytest.approx(math.sqrt(1 / 3))  # unbiased: Σ(x − x̄)² / (n − 1)
    assert metrics["rewards/exact_match/mean"] == 2.0 and metrics["rewards/exact_match/std"] == 0.0
    assert metrics["rewards/length_penalty/mean"] == 0.0
    empty = reward_metrics(funcs[:1], torch.full((2, 1), math.nan))
    assert math.isnan(empty["rewards/regex/mean"]) and math.isnan(empty["rewards/regex/std"])
    assert re.search(
        r"reward_metrics: .* \[N, 3\] .* got \(3, 2\)", value_error(reward_metrics, funcs, table[:, :2])
    )


def test_tensors_are_accepted_as_return_values():
    def as_tensor(prompts, completions, completion_ids, **kwargs):
        return torch.arange(len(completions), dtype=torch.float64)

    got = compute_rewards(resolve_reward_funcs([as_tensor]), ["p"] * 3, ["a"] * 3, [[1]] * 3, {})
    assert got[:, 0].tolist() == [0.0, 1.0, 2.0]


# errors while calling


def fails_on_b(prompts, completions, completion_ids, **kwargs):
    return [1.0 if c != "b" else len(None) for c in completions]


def fails_on_pairs(prompts, completions, completion_ids, **kwargs):
    if len(completions) > 1:
        raise RuntimeError("batch too big")
    return [1.0]


def compute_error(func, completions=("a", "b", "c"), **columns) -> str:
    completions = list(completions)
    funcs = resolve_reward_funcs([func])
    return value_error(
        compute_rewards,
        funcs,
        [f"prompt {c}" for c in completions],
        completions,
        [[1]] * len(completions),
        columns,
    )


def test_a_raising_function_names_the_first_failing_sample_and_chains_the_error():
    message = compute_error(fails_on_b)
    assert re.fullmatch(
        r"reward function 'fails_on_b' raised TypeError: object of type 'NoneType' has no len\(\) "
        r"on sample 1 \(prompt='prompt b', completion='b'\)",
        message,
    )
    with pytest.raises(ValueError) as error:
        compute_rewards(resolve_reward_funcs([fails_on_b]), ["p"], ["b"], [[1]], {})
    assert isinstance(error.value.__cause__, TypeError)


def test_long_samples_are_shortened_in_the_error():
    message = compute_error(lambda prompts, completions, **kw: [len(None)], [conversational("x" * 500)])
    assert "reward function '<lambda>' raised TypeError" in message and "on sample 0" in message
    assert "completion=[{'role': 'assistant', 'content': 'xxx" in message and "...)" in message
    assert len(message) < 300


def test_a_function_that_fails_only_on_the_batch_says_so():
    assert compute_error(fails_on_pairs) == (
        "reward function 'fails_on_pairs' raised RuntimeError: batch too big "
        "on the batch of 3 samples (no sample fails alone)"
    )


def test_a_missing_answer_column_names_the_builtin_not_a_sample():
    message = compute_error("exact_match", other=[1, 2, 3])
    assert (
        message
        == "reward function 'exact_match' needs an 'answer' column in the dataset; its columns: ['other']"
    )
    assert "contains_answer" in compute_error("contains_answer")
    assert "contains_answer" in value_error(contains_answer, None, ["a"], None)


def test_a_message_completion_without_text_content_is_a_type_error_on_that_sample():
    bad = [conversational("1"), [{"role": "assistant"}]]
    funcs = resolve_reward_funcs(["regex:1"])
    message = value_error(compute_rewards, funcs, ["p", "q"], bad, [[1], [1]], {})
    assert message.startswith("reward function 'regex' raised TypeError: a completion must be a string")
    assert "on sample 1 (prompt='q', completion=[{'role': 'assistant'}])" in message


@pytest.mark.parametrize(
    ("returned", "pattern"),
    [
        ("1.0", r"^reward function 'bad' returned str; expected a list of numbers or None"),
        (1.0, r"^reward function 'bad' returned float; expected a list"),
        ([1.0, 2.0], r"^reward function 'bad' returned 2 values for 3 completions$"),
        (
            [1.0, True, 0.0],
            r"^reward function 'bad' returned True \(bool\) for sample 1; expected a number or None$",
        ),
        ([1.0, 2.0, "3"], r"^reward function 'bad' returned '3' \(str\) for sample 2"),
        ([1.0, math.nan, 0.0], r"^reward function 'bad' returned nan for sample 1; return None where"),
        ([math.inf, 1.0, 0.0], r"^reward function 'bad' returned inf for sample 0"),
    ],
)
def test_bad_return_values_name_the_function_and_the_sample(returned, pattern):
    def bad(prompts, completions, completion_ids, **kwargs):
        return returned

    assert re.search(pattern, compute_error(bad))


def test_mismatched_inputs_and_clashing_columns_are_errors():
    funcs = resolve_reward_funcs(["regex:a"])
    message = value_error(compute_rewards, funcs, ["p"], ["a", "b"], [[1], [2]], {})
    assert message == "compute_rewards: 'prompts' has 1 values for 2 completions"
    message = value_error(compute_rewards, funcs, ["p"], ["a"], [[1]], {"answer": [1, 2]})
    assert message == "compute_rewards: 'answer' has 2 values for 1 completions"
    message = value_error(compute_rewards, funcs, ["p"], ["a"], [[1]], {"completion_ids": [[1]]})
    assert "column 'completion_ids' clashes" in message


# TRL's forms


def test_trl_dotted_form_and_modules_of_the_current_directory(tmp_path, monkeypatch):
    """``rewards.reward_len`` (TRL's form) and ``rewards:reward_len``, for a rewards.py in the current
    directory, from the ``fastalign`` script too (whose sys.path lacks the current directory). Before:
    "no module named 'rewards'"; only ``rewards.py:reward_len`` worked."""
    module = f"cwd_rewards_{tmp_path.name}"  # a fresh module name per run: sys.modules keeps imports
    (tmp_path / f"{module}.py").write_text(
        "def reward_len(prompts, completions, completion_ids, **kwargs):\n"
        "    return [float(len(ids)) for ids in completion_ids]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    path_before = list(sys.path)
    funcs = resolve_reward_funcs([f"{module}.reward_len", f"{module}:reward_len", "os.path.join"])
    assert [func.name for func in funcs] == ["reward_len", "reward_len_2", "join"]
    assert funcs[0].fn is funcs[1].fn and funcs[0].fn([], ["a"], [[1, 2]]) == [2.0]
    assert sys.path == path_before  # the current directory was on it only while importing


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "no_such_module_xyz.f",
            "reward_funcs: 'no_such_module_xyz.f': no module named 'no_such_module_xyz'",
        ),
        ("os.path.nope", "reward_funcs: 'os.path.nope': module 'os.path' has no attribute 'nope'"),
        ("rewards.py", "reward_funcs: 'rewards.py' names a file but no function: 'rewards.py:function'"),
    ],
)
def test_bad_dotted_specs_are_one_line(spec, message):
    assert value_error(resolve_reward_funcs, [spec]) == message


def test_metrics_jsonl_writes_a_missing_number_as_null(tmp_path):
    """A NaN mean reward (no function scored) went into metrics.jsonl as a bare NaN, which is not JSON."""
    import json
    from types import SimpleNamespace

    from fastalign.train.callbacks import JsonlMetrics

    writer = JsonlMetrics(tmp_path / "metrics.jsonl")
    engine = SimpleNamespace(ctx=SimpleNamespace(is_main=True))
    writer.on_log(engine, {"step": 1, "reward": math.nan, "loss": 0.5, "grad": [math.inf, 1.0]})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}")) == {
        "step": 1, "reward": None, "loss": 0.5, "grad": [None, 1.0]
    }  # fmt: skip
