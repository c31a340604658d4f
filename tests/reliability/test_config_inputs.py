"""Config values, YAML files, reward paths, ``fastalign merge`` and ``fastalign plan`` (issue 17:
nothing lost, nothing silent).

Each case is one faulty input: a config value that is out of range or means something other than it says,
a YAML file that sets a key twice, a reward spec, a run directory or base model that ``fastalign merge``
cannot use, a bad ``fastalign plan`` flag. Each asserts the exit code (or exception type), one line naming
the culprit, and where an earlier run is involved, that none of its files changed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import typing
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.train.config import ConfigError, TrainConfig, check_config, load_config
from fastalign.train.config import checks as config_checks
from fastalign.train.rewards import resolve_reward_funcs
from fastalign.train.run import run_training
from tests.reliability.conftest import assert_one_line_error, snapshot

TINY = dict(max_steps=1, per_device_train_batch_size=2, max_length=32, logging_steps=1, loss_curve_png=False)


@pytest.fixture(autouse=True)
def no_progress_bar(monkeypatch):
    """The training bar redraws itself on stderr, which the one-line check would count as lines."""
    import tqdm.auto

    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *args, **kwargs: real(*args, **{**kwargs, "disable": True}))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny SFT run: the earlier run that a bad config must leave as it was."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_training(TrainConfig(output_dir=str(out), **TINY), "sft")
    return out


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------
# Config values: every one is refused at load, naming the key and the file, before any work.

#: (objective, YAML, key): a value the config accepted before, and what it did then.
BAD_VALUES = [
    # silently accepted: a checkpoint every step (step % -1 == 0)
    ("sft", "save_steps: -1\n", "save_steps"),
    # silently accepted: a negative warmup handed to the scheduler
    ("sft", "warmup_steps: -5\n", "warmup_steps"),
    # silently accepted: a full epoch (transformers' Trainer trains no steps at 0; -1 means epochs)
    ("sft", "max_steps: 0\n", "max_steps"),
    # silently accepted: an evaluation every step
    ("sft", "eval_steps: -1\neval_split_ratio: 0.25\n", "eval_steps"),
    # traceback: OverflowError (cannot convert float infinity to integer)
    ("sft", "num_train_epochs: .inf\n", "num_train_epochs"),
    # vague: "step 2: loss nan" after a step, naming no key
    ("sft", "learning_rate: .inf\n", "learning_rate"),
    # vague: torch's "Invalid beta parameter at index 0: 1.5"
    ("sft", "adam_beta1: 1.5\n", "adam_beta1"),
    # vague: "step 2: loss nan" (eps 0 divides by zero), naming no key
    ("sft", "adam_epsilon: 0\n", "adam_epsilon"),
    # vague: torch's "Invalid weight_decay value: -0.1" (no config key, no file)
    ("sft", "weight_decay: -0.1\n", "weight_decay"),
    # silently accepted: clip_grad_norm_ to 0 zeroes every gradient, nothing trains
    ("sft", "max_grad_norm: 0\n", "max_grad_norm"),
    # wrong result: a negative clip coefficient flips every gradient (gradient ascent)
    ("sft", "max_grad_norm: -1.0\n", "max_grad_norm"),
    # vague: torch's "Overflow when unpacking long long"
    ("sft", "seed: 18446744073709551616\n", "seed"),
    # vague and misattributed: "config key 'lora_target_modules' (all-linear): dropout probability ..."
    ("sft", "use_peft: true\nlora_dropout: 1.5\n", "lora_dropout"),
    # silently accepted: scaling alpha / r = 0, the adapter neither learns nor changes the model
    ("sft", "use_peft: true\nlora_alpha: 0\n", "lora_alpha"),
    # wrong result: the desirable rows' loss is maximized
    ("kto", "desirable_weight: -1.0\n", "desirable_weight"),
    # wrong result: the chosen NLL is maximized
    ("cpo", "cpo_alpha: -1.0\n", "cpo_alpha"),
    # wrong result: the ipo term is maximized
    ("dpo", "loss_type: [sigmoid, ipo]\nloss_weights: [1.0, -1.0]\n", "loss_weights"),
    # silently accepted: logits / inf sample uniformly
    ("grpo", "temperature: .inf\n", "temperature"),
    # vague: GRPOLoss's "beta, epsilon and epsilon_high must be >= 0" after the model loaded
    ("grpo", "epsilon: -0.1\n", "epsilon"),
]


@pytest.mark.parametrize(("objective", "text", "key"), BAD_VALUES, ids=[case[2] for case in BAD_VALUES])
def test_a_bad_config_value_is_one_line_naming_the_key_and_leaves_the_earlier_run(
    bad_input, finished_run, tmp_path, objective, text, key
):
    earlier = tmp_path / "run"
    shutil.copytree(finished_run, earlier)
    before = snapshot(earlier)
    path = write(tmp_path, text)
    outcome = bad_input("train", objective, "--config", path, "--output_dir", earlier, culprit=f"'{key}'")
    assert str(path) in outcome.message  # where it was set
    assert snapshot(earlier) == before


#: (objective, YAML, key): a key the config accepted and then ignored (or read otherwise than TRL or
#: transformers do), refused in one line now. ``{text}``: a file of text rows.
ACCEPTED_AND_IGNORED = [
    ("sft", "assistant_only_loss: true\n", "assistant_only_loss"),  # prompt-completion rows
    ("sft", "completion_only_loss: true\ndataset_name: {text}\n", "completion_only_loss"),
    ("sft", "dataset_text_field: body\n", "dataset_text_field"),  # prompt-completion rows
    (
        "sft",
        "eval_dataset_name: tiny-sft\neval_split_ratio: 0.25\neval_strategy: steps\n",
        "eval_split_ratio",
    ),
    ("grpo", "ref_model_name_or_path: tiny-llama\n", "ref_model_name_or_path"),  # beta 0: no KL term
    ("rloo", "beta: 0\nref_model_name_or_path: tiny-llama\n", "ref_model_name_or_path"),
    ("grpo", "use_bias_correction_kl: false\n", "use_bias_correction_kl"),
    ("ppo", "kl_coef: 0\nkl_estimator: k3\n", "kl_estimator"),
    ("online_dpo", "truncation: true\n", "truncation"),  # no max_prompt_length to truncate to
    ("distill", "teacher_model_name_or_path: tiny-llama\nlmbda: 0\ntop_k: 5\n", "top_k"),  # nothing sampled
    (
        "sft",
        "lr_scheduler_type: constant_with_warmup\nlr_scheduler_kwargs: {num_cycles: 2}\n",
        "lr_scheduler_kwargs",
    ),
    ("sft", "lr_scheduler_type: constant\nwarmup_steps: 2\n", "warmup_steps"),  # transformers' has none
    ("sft", "per_device_eval_batch_size: 4\n", "per_device_eval_batch_size"),  # nothing held out
    ("grpo", "num_generations_eval: 4\n", "num_generations_eval"),
    ("kto", "train_sampling_strategy: random\n", "train_sampling_strategy"),  # KTO's KL pairs need the order
]


@pytest.mark.parametrize(
    ("objective", "text", "key"),
    ACCEPTED_AND_IGNORED,
    ids=[f"{case[0]}-{case[2]}" for case in ACCEPTED_AND_IGNORED],
)
def test_a_key_that_would_be_ignored_is_refused_in_one_line(bad_input, tmp_path, objective, text, key):
    rows = tmp_path / "text.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i} of plain text"}) + "\n" for i in range(8)))
    rewards = (
        "reward_funcs: [fastalign.builtin:digit_ratio]\n"
        if objective in ("grpo", "rloo", "ppo", "online_dpo")
        else ""
    )
    path = write(tmp_path, text.replace("{text}", str(rows)) + rewards)
    bad_input("train", objective, "--config", path, "--output_dir", tmp_path / "run", culprit=f"'{key}'")
    assert not (tmp_path / "run").exists()


#: (objective, YAML, key): a model a run cannot train as configured, refused in one line naming its key
#: before any data or weights are read: a teacher that is not there.
UNUSABLE_MODELS = [
    ("distill", "teacher_model_name_or_path: /nonexistent/teacher\n", "teacher_model_name_or_path"),
]


@pytest.mark.parametrize(("objective", "text", "key"), UNUSABLE_MODELS)
def test_a_model_the_objective_cannot_train_is_one_line_naming_its_key(
    bad_input, tmp_path, objective, text, key
):
    path = write(tmp_path, text)
    outcome = bad_input("train", objective, "--config", path, "--output_dir", tmp_path / "run", culprit=key)
    assert "nonexistent" in outcome.message


SAMPLING = ("grpo", "rloo", "online_dpo", "ppo")


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto", *SAMPLING, "distill"])
def test_every_objective_trains_a_model_with_a_final_logit_softcap(tmp_path, objective):
    """Gemma-2's softcap is applied by SFT's labels path and by every head_fn loss (the patched forward
    hands it over; tests/parity/test_softcap_trl.py checks DPO, KTO and GRPO against TRL,
    tests/train/test_distill.py distillation): one step of each on the built-in data (distillation's
    teacher a Gemma-2 too), a finite loss."""
    options = {"reward_funcs": ["fastalign.builtin:digit_ratio"]} if objective in SAMPLING else {}
    options |= {"max_completion_length": 8} if objective in ("grpo", "rloo", "ppo", "distill") else {}
    options |= {"teacher_model_name_or_path": "tiny-gemma2"} if objective == "distill" else {}
    config = TrainConfig(
        model_name_or_path="tiny-gemma2",
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        save_strategy="no",
        **options,
    )
    metrics = (run_training(config, objective) / "metrics.jsonl").read_text().splitlines()
    assert math.isfinite(json.loads(metrics[0])["loss"])


def test_a_yaml_key_set_twice_names_the_key_and_both_lines(bad_input, finished_run, tmp_path):
    """Before: PyYAML kept the last value silently (max_steps 1000, not the 1 the user read first)."""
    earlier = tmp_path / "run"
    shutil.copytree(finished_run, earlier)
    before = snapshot(earlier)
    path = write(tmp_path, "max_steps: 1\nlearning_rate: 1e-4\nmax_steps: 1000\n")
    outcome = bad_input("train", "sft", "--config", path, "--output_dir", earlier, culprit="'max_steps'")
    assert "line 1" in outcome.message and "line 3" in outcome.message and str(path) in outcome.message
    assert snapshot(earlier) == before


def test_delta_must_exceed_the_clipping_bound():
    """Before: accepted at load, then GRPOLoss's "delta must exceed 1 + epsilon_high" (epsilon_high was
    not set) once the model had loaded."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["--delta", "1.1", "--epsilon", "0.2"])
    assert_one_line_error(caught.value, "'delta'")
    assert "1 + epsilon" in str(caught.value)


def _number_kinds(kind: typing.Any) -> set[type]:
    """int and float in a field type, at any depth (``list[float] | None`` → {float})."""
    found = {kind} & {int, float}
    for arg in typing.get_args(kind):
        found |= _number_kinds(arg)
    return found


def _takes_a_list(kind: typing.Any) -> bool:
    return typing.get_origin(kind) is list or any(_takes_a_list(arg) for arg in typing.get_args(kind))


def test_every_numeric_field_has_a_range_check():
    """A guard, not a case: a new int/float field must come with its row in ``_VALUE_CHECKS``."""
    hints = typing.get_type_hints(TrainConfig)
    numeric = {f.name for f in dataclasses.fields(TrainConfig) if _number_kinds(hints[f.name])}
    ranged = {key for key, _, wanted in config_checks._VALUE_CHECKS if wanted != "a finite number"}
    assert numeric - ranged == set()


@pytest.mark.parametrize("raw", [".inf", "-.inf"])
def test_no_float_field_takes_an_infinity(tmp_path, raw):
    """Every float field (float, float | None, list[float]) refuses ±inf naming its key."""
    hints = typing.get_type_hints(TrainConfig)
    floats = [name for name, kind in hints.items() if float in _number_kinds(kind)]
    assert "learning_rate" in floats and "loss_weights" in floats and "delta" in floats
    for key in floats:
        value = f"[{raw}]" if _takes_a_list(hints[key]) else raw
        with pytest.raises(ConfigError) as caught:
            load_config(write(tmp_path, f"{key}: {value}\n"))
        assert_one_line_error(caught.value, f"'{key}'")


def test_a_config_built_in_code_is_checked_the_same():
    """``TrainConfig(...)`` skips ``load_config``; ``check_config`` gives the same one-line error."""
    with pytest.raises(ConfigError) as caught:
        check_config(TrainConfig(save_steps=-1))
    assert_one_line_error(caught.value, "'save_steps'")
    check_config(TrainConfig())  # the defaults pass


# --------------------------------------------------------------------------------------------------
# Reward paths: the named file runs, nothing else does, a missing function is one line.

REWARD_FILE = """\
from pathlib import Path
marker = Path(__file__).with_suffix(".ran")
marker.write_text(marker.read_text() + "x" if marker.exists() else "x")

def good(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)
"""


def grpo(tmp_path: Path, spec: str) -> tuple[str, ...]:
    return (
        "train",
        "grpo",
        "--output_dir",
        str(tmp_path / "out"),
        "--reward_funcs",
        spec,
        "--max_steps",
        "1",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--max_completion_length",
        "4",
        "--loss_curve_png",
        "false",
    )


def test_a_missing_reward_function_names_the_file_and_the_function(bad_input, tmp_path):
    """The named file runs (once: that is what a reward path is), then one line names it and the function;
    no output directory is made. (Already one line before.)"""
    reward = write(tmp_path, REWARD_FILE, "my_rewards.py")
    outcome = bad_input(*grpo(tmp_path, f"{reward}:god"), culprit="'god'")
    assert str(reward) in outcome.message and "did you mean 'good'?" in outcome.message
    assert (tmp_path / "my_rewards.ran").read_text() == "x"
    assert not (tmp_path / "out").exists()


def test_a_reward_spec_naming_a_non_python_file_imports_nothing(bad_input, tmp_path, monkeypatch):
    """Before: ``rewards.txt:good`` was taken for module ``rewards.txt``, so Python imported (ran) the
    package ``rewards`` — rewards.py, a file the user never named — and then failed."""
    write(tmp_path, REWARD_FILE, "rewards.py")
    write(tmp_path, REWARD_FILE, "rewards.txt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    bad_input(*grpo(tmp_path, "rewards.txt:good"), culprit="'rewards.txt'")
    assert not (tmp_path / "rewards.ran").exists()


def test_a_reward_spec_with_a_bad_function_name_runs_nothing(bad_input, tmp_path):
    """Before: the file ran first, then "has no attribute 'good()'". The spec is checked first now."""
    reward = write(tmp_path, REWARD_FILE, "my_rewards.py")
    bad_input(*grpo(tmp_path, f"{reward}:good()"), culprit="'good()'")
    assert not (tmp_path / "my_rewards.ran").exists()


def test_a_reward_file_that_exits_is_one_line(bad_input, tmp_path):
    """Before: its SystemExit(3) left ``fastalign`` with exit code 3 and no message at all."""
    reward = write(tmp_path, "import sys\nsys.exit(3)\n", "exits.py")
    outcome = bad_input(*grpo(tmp_path, f"{reward}:good"), culprit=str(reward))
    assert "SystemExit" in outcome.message


def test_a_reward_file_error_with_newlines_is_one_line(tmp_path):
    """Before: the error's own newlines went into the ValueError (two lines from the API)."""
    reward = write(tmp_path, "raise RuntimeError('first line\\nsecond line')\n", "broken.py")
    with pytest.raises(ValueError) as caught:
        resolve_reward_funcs([f"{reward}:good"])
    assert_one_line_error(caught.value, str(reward))
    assert "first line second line" in str(caught.value)


# --------------------------------------------------------------------------------------------------
# fastalign merge: a run directory or base it cannot use is one line naming the file; nothing is written.


def lora_run(out: Path, model: str) -> Path:
    run_training(
        TrainConfig(output_dir=str(out), model_name_or_path=model, use_peft=True, lora_r=4, **TINY), "sft"
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """LoRA runs: on the built-in tiny-llama, and on a local base directory (``base``)."""
    root = tmp_path_factory.mktemp("merge")
    base = root / "base"
    tiny_model("llama").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    return {
        "builtin": lora_run(root / "builtin", "tiny-llama"),
        "base": base,
        "local": lora_run(root / "local", str(base)),
    }


def copy_run(runs: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    run = tmp_path / kind
    shutil.copytree(runs[kind], run)
    return run


def set_base(run: Path, model: str) -> None:
    """Point the run's fastalign_config.yaml (and, for a local run, its adapter_config.json) at ``model``."""
    config = yaml.safe_load((run / "fastalign_config.yaml").read_text())
    (run / "fastalign_config.yaml").write_text(yaml.safe_dump({**config, "model_name_or_path": model}))
    adapter = json.loads((run / "adapter_config.json").read_text())
    if adapter.get("base_model_name_or_path"):
        (run / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": model}))


def merge_fails(bad_input, run: Path, culprit: str, *flags: str) -> str:
    before = snapshot(run)
    outcome = bad_input("merge", run, *flags, culprit=culprit)
    assert snapshot(run) == before  # nothing written, nothing left half-merged
    return outcome.message


def test_merge_never_unpickles_a_base_that_only_has_pytorch_model_bin(bad_input, runs, tmp_path):
    """Before: transformers' from_pretrained unpickled pytorch_model.bin and the merge went ahead."""
    base = tmp_path / "base"
    shutil.copytree(runs["base"], base)
    torch.save(load_file(base / "model.safetensors"), base / "pytorch_model.bin")
    (base / "model.safetensors").unlink()
    run = copy_run(runs, "local", tmp_path)
    set_base(run, str(base))
    message = merge_fails(bad_input, run, "pytorch_model.bin")
    assert str(base) in message and "never" in message


def test_merge_of_a_missing_run_directory_says_not_found(bad_input, tmp_path):
    """Before: "holds no LoRA adapter (adapter_config.json)" for a directory that does not exist."""
    bad_input("merge", tmp_path / "no_such_run", culprit=f"{tmp_path / 'no_such_run'} not found")


def test_merge_without_fastalign_config_names_it(bad_input, runs, tmp_path):
    """(Already one line before: load_config's "cannot read config".)"""
    run = copy_run(runs, "builtin", tmp_path)
    (run / "fastalign_config.yaml").unlink()
    merge_fails(bad_input, run, "fastalign_config.yaml")


def test_merge_with_a_corrupt_adapter_config_names_it(bad_input, runs, tmp_path):
    """Before: json's "Expecting property name enclosed in double quotes", naming no file."""
    run = copy_run(runs, "builtin", tmp_path)
    (run / "adapter_config.json").write_text('{"r": 4,')
    merge_fails(bad_input, run, "adapter_config.json")


def test_merge_with_corrupt_adapter_weights_names_the_file(bad_input, runs, tmp_path):
    """Before: a SafetensorError traceback out of peft."""
    run = copy_run(runs, "builtin", tmp_path)
    (run / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    merge_fails(bad_input, run, "adapter_model.safetensors")


def test_merge_never_unpickles_adapter_model_bin(bad_input, runs, tmp_path):
    """Before: peft torch.load-ed adapter_model.bin and the merge went ahead."""
    run = copy_run(runs, "builtin", tmp_path)
    torch.save(load_file(run / "adapter_model.safetensors"), run / "adapter_model.bin")
    (run / "adapter_model.safetensors").unlink()
    merge_fails(bad_input, run, "adapter_model.bin")


def test_merge_of_an_adapter_too_wide_for_the_base_names_the_adapter(bad_input, runs, tmp_path):
    """Before: a multi-line "Error(s) in loading state_dict ... size mismatch" traceback."""
    narrow = tmp_path / "narrow"
    tiny_model("llama", hidden_size=32, head_dim=8).save_pretrained(narrow)
    tiny_tokenizer().save_pretrained(narrow)
    run = copy_run(runs, "builtin", tmp_path)
    set_base(run, str(narrow))
    message = merge_fails(bad_input, run, "adapter_model.safetensors")
    assert "size mismatch" in message and "fastalign_config.yaml" in message


def test_merge_of_an_adapter_for_another_architecture_names_the_adapter(bad_input, runs, tmp_path):
    """Before: peft placed what matched (o_proj, down_proj), skipped the rest with a warning, and saved a
    half-merged model (tiny-phi3 fuses qkv and gate_up)."""
    run = copy_run(runs, "builtin", tmp_path)
    set_base(run, "tiny-phi3")
    message = merge_fails(bad_input, run, "adapter_model.safetensors")
    assert "does not fit" in message


def test_merge_of_an_adapter_missing_tensors_names_the_adapter(bad_input, runs, tmp_path):
    """Before: peft warned "Found missing adapter keys" and merged the rest: layer 1 silently untrained."""
    run = copy_run(runs, "builtin", tmp_path)
    weights = run / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if "layers.1." not in k}, weights)
    message = merge_fails(bad_input, run, "adapter_model.safetensors")
    assert "lacks" in message and "layers.1." in message


def test_merge_of_an_adapter_from_another_run_names_both_bases(bad_input, runs, tmp_path):
    """A run directory whose adapter was trained on ``base`` while its config names tiny-llama (same
    shapes): before, merged silently into the wrong weights."""
    run = copy_run(runs, "local", tmp_path)
    config = yaml.safe_load((run / "fastalign_config.yaml").read_text())
    (run / "fastalign_config.yaml").write_text(yaml.safe_dump({**config, "model_name_or_path": "tiny-llama"}))
    message = merge_fails(bad_input, run, "adapter_config.json")
    assert str(runs["base"]) in message and "tiny-llama" in message


def test_merge_into_the_run_directory_is_refused(bad_input, runs, tmp_path):
    """Before: config.json, model.safetensors and the tokenizer files were written over the run's own."""
    run = copy_run(runs, "builtin", tmp_path)
    merge_fails(bad_input, run, "is the run directory", "--output_dir", str(run))


def test_merge_into_another_runs_directory_is_refused(bad_input, runs, tmp_path):
    """Before: the merged config.json, model.safetensors and tokenizer were written into the other run's
    directory, beside (and over) its adapter and tokenizer."""
    run, other = copy_run(runs, "builtin", tmp_path), tmp_path / "other"
    shutil.copytree(runs["local"], other)
    before = snapshot(other)
    merge_fails(bad_input, run, "adapter_config.json", "--output_dir", str(other))
    assert snapshot(other) == before


def test_a_second_merge_replaces_the_first_and_keeps_other_files(runs, tmp_path, capsys):
    """Not a bad input: the guard that the move into place replaces only the merged model's files."""
    run, out = copy_run(runs, "builtin", tmp_path), tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_text("an earlier merge's shard")
    assert main(["merge", str(run), "--output_dir", str(out)]) == 0
    first = snapshot(out)
    assert main(["merge", str(run), "--output_dir", str(out)]) == 0
    assert snapshot(out) == first and (out / "notes.txt").read_text() == "mine"
    assert "model-00001-of-00002.safetensors" not in first and "model.safetensors" in first
    assert not list(tmp_path.glob(".*merge-tmp"))


def usage_error(capsys, *args: str) -> str:
    """An argparse error of ``fastalign *args``: exit 2 and one ``error:`` line (argparse exits with
    SystemExit, which ``bad_input`` does not catch)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        main([str(arg) for arg in args])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_merge_with_a_bad_dtype_is_one_line(capsys, runs, tmp_path):
    """Before: argparse's usage text and its error, several lines."""
    run = copy_run(runs, "builtin", tmp_path)
    before = snapshot(run)
    assert "--dtype" in usage_error(capsys, "merge", run, "--dtype", "float8")
    assert snapshot(run) == before


# --------------------------------------------------------------------------------------------------
# fastalign plan.


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--model", "no-such-model"], "--model"),  # already one line before
        (["--model", "llama-3-8b", "--gpus", "-1"], "--gpus"),  # already one line before
        (["--model", "llama-3-8b", "--gpu-memory", "24XB"], "--gpu-memory"),  # already one line before
        # before: argparse took "-24GB" for an option: usage text + "expected one argument"
        (["--model", "llama-3-8b", "--gpu-memory", "-24GB"], "'-24GB'"),
    ],
    ids=["unknown-model", "negative-gpus", "bad-unit", "negative-memory"],
)
def test_plan_bad_inputs_are_one_line(bad_input, flags, culprit):
    bad_input("plan", *flags, culprit=culprit)


def test_plan_flag_without_its_value_is_one_line(capsys):
    """Before: argparse's usage text and "expected one argument", several lines."""
    assert "--gpu-memory" in usage_error(capsys, "plan", "--model", "llama-3-8b", "--gpu-memory")


@pytest.mark.parametrize(
    ("flags", "key", "needs"),
    [
        (["--lora_r", "8"], "lora_r", "use_peft: true"),
        (["--lora_alpha", "8"], "lora_alpha", "use_peft: true"),
        (["--lora_dropout", "0.1"], "lora_dropout", "use_peft: true"),
        (["--lora_target_modules", "q_proj"], "lora_target_modules", "use_peft: true"),
        (["--bnb_4bit_use_double_quant", "false"], "bnb_4bit_use_double_quant", "quantization"),
        (
            ["--activation_offloading_keep_on_device", "2"],
            "activation_offloading_keep_on_device",
            "activation_",
        ),
        (["--tiled_mlp_budget_mib", "64"], "tiled_mlp_budget_mib", "tiled_mlp: true"),
        (["--save_strategy", "no", "--save_total_limit", "2"], "save_total_limit", "save_strategy steps"),
        (["--warmup_steps", "2", "--warmup_ratio", "0.5"], "warmup_ratio", "warmup_steps is 0"),
        (["--optim", "sgd", "--adam_beta1", "0.8"], "adam_beta1", "an Adam optimizer"),
        (["--optim", "adafactor", "--adam_epsilon", "1e-6"], "adam_epsilon", "an Adam optimizer"),
        (["--ref_model_mixup_alpha", "0.3"], "ref_model_mixup_alpha", "sync_ref_model: true"),
        (["--ref_model_sync_steps", "10"], "ref_model_sync_steps", "sync_ref_model: true"),
    ],
)
def test_an_option_without_what_it_qualifies_is_refused(flags, key, needs):
    """Accepted before and silently ignored: now one line naming the key and what it needs."""
    with pytest.raises(
        ConfigError, match=rf"^config key '{key}' \(on the command line\) .*{re.escape(needs)}"
    ):
        load_config(None, flags)


@pytest.mark.parametrize(
    "flags",
    [
        ["--use_peft", "true", "--lora_r", "8"],
        ["--use_peft", "true", "--quantization", "nf4", "--bnb_4bit_use_double_quant", "false"],
        ["--activation_offloading", "true", "--activation_offloading_keep_on_device", "2"],
        ["--tiled_mlp", "true", "--tiled_mlp_budget_mib", "64"],
        ["--save_total_limit", "2"],
        ["--warmup_ratio", "0.5"],
        ["--optim", "adamw_torch", "--adam_beta1", "0.8"],
        ["--sync_ref_model", "true", "--ref_model_sync_steps", "10"],
        ["--max_steps", "5", "--num_train_epochs", "2"],  # max_steps overrides, as transformers documents
    ],
)
def test_an_option_with_what_it_qualifies_is_accepted(flags):
    load_config(None, flags)


def test_merge_into_another_runs_directory_is_refused_unless_asked(bad_input, runs, tmp_path, capsys):
    """Before: ``merge lora --output_dir other_run`` replaced the other run's model silently."""
    run = copy_run(runs, "builtin", tmp_path)
    other = copy_run(runs, "base", tmp_path)  # a model directory: another run's export
    before = snapshot(other)
    message = bad_input("merge", run, "--output_dir", other, culprit="--overwrite_output_dir").message
    assert str(other) in message and snapshot(other) == before
    assert main(["merge", str(run), "--output_dir", str(other), "--overwrite_output_dir"]) == 0
    assert snapshot(other) != before
    assert main(["merge", str(run)]) == 0 and main(["merge", str(run)]) == 0  # RUN_DIR/merged: merge's own
