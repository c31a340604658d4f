"""TrainConfig from YAML and flags: TRL names, coercion by field type, and one-line errors that name the
key and where it was set."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fastalign.train import config as config_module
from fastalign.train.config import ConfigError, TrainConfig, check_config, load_config, save_config
from fastalign.train.config import checks as config_checks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_tiny.yaml"


@pytest.fixture(autouse=True)
def integrations_installed(monkeypatch):
    """report_to's packages count as installed here (each test that says otherwise patches it again)."""
    monkeypatch.setattr(config_checks, "_installed", lambda package: True)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def config_error(path: Path | None, flags: list[str] = ()) -> str:
    """The message of the ConfigError that loading raises, checked to be one line."""
    with pytest.raises(ConfigError) as error:
        load_config(path, flags)
    message = str(error.value)
    assert "\n" not in message and message
    return message


# defaults, precedence, flag syntax


def test_no_file_and_no_flags_give_the_defaults(tmp_path):
    assert load_config() == TrainConfig()
    assert load_config(None, []) == TrainConfig()
    assert load_config(write(tmp_path, "# only a comment\n")) == TrainConfig()  # empty YAML is null


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = write(tmp_path, "learning_rate: 2e-4\nmax_steps: 10\npacking: true\n")
    config = load_config(path, ["--max_steps", "20"])
    assert config.max_steps == 20  # flag over file
    assert (config.learning_rate, config.packing) == (2e-4, True)  # file over defaults
    assert config.max_length == TrainConfig().max_length  # untouched default
    assert load_config(path, ["--max_steps", "3", "--max_steps=4"]).max_steps == 4  # last flag wins


def test_a_null_flag_puts_a_number_or_switch_the_file_set_back_to_its_default(tmp_path):
    """``--save_steps null`` after a file's ``save_steps: 30`` (with ``--save_strategy epoch``, which
    refuses a save_steps it would not read): before, 'must be a number, got null'."""
    path = write(tmp_path, "save_steps: 30\npacking: true\nmax_steps: 5\n")
    flags = ["--save_strategy", "epoch", "--save_steps", "null", "--packing", "none", "--max_steps=NULL"]
    config = load_config(path, flags)
    defaults = TrainConfig()
    assert (config.save_steps, config.packing, config.max_steps) == (
        defaults.save_steps, defaults.packing, defaults.max_steps
    )  # fmt: skip
    optional = load_config(write(tmp_path, "max_prompt_length: 8\n"), ["--max_prompt_length", "null"])
    assert optional.max_prompt_length is None  # an optional key: null itself
    # a string or list key too: before, --output_dir null wrote to ./null, --lora_target_modules null
    # asked peft for a module named "null", --report_to null was refused
    listed = load_config(
        write(tmp_path, "output_dir: elsewhere\nlora_target_modules: [q_proj]\nreport_to: none\n"),
        ["--output_dir", "null", "--lora_target_modules", "null", "--report_to", "null"],
    )
    assert (listed.output_dir, listed.lora_target_modules, listed.report_to) == (
        defaults.output_dir, defaults.lora_target_modules, defaults.report_to
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "key", "value"),
    [
        (["--loss_type", "[sigmoid, sft]"], "loss_type", ["sigmoid", "sft"]),  # YAML's flow list, quoted
        (["--loss_type", "[sigmoid,", "sft]"], "loss_type", ["sigmoid", "sft"]),  # and as the shell splits it
        (["--report_to", "[]"], "report_to", []),
        (
            ["--use_peft", "--lora_target_modules", "[q_proj, v_proj]"],
            "lora_target_modules",
            ["q_proj", "v_proj"],
        ),
        (["--scale_rewards", "false"], "scale_rewards", "none"),  # TRL's bool spellings
        (["--scale_rewards", "True"], "scale_rewards", "group"),
        (["--scale_rewards", "none"], "scale_rewards", "none"),  # a value, not null: its default is group
        (["--report_to", "[", "]"], "report_to", []),  # the shell splits "[ ]"
        (["--use_peft", "--lora_target_modules", "[", "q_proj", "]"], "lora_target_modules", ["q_proj"]),
    ],
)
def test_the_spellings_every_help_and_trl_promise(flags, key, value):
    """``--help`` says lists are "a, b or [a, b]"; before, the brackets stayed in the values."""
    assert getattr(load_config(None, flags), key) == value


def test_scale_rewards_false_in_a_yaml_file_is_trls_none(tmp_path):
    assert load_config(write(tmp_path, "scale_rewards: false\n")).scale_rewards == "none"


@pytest.mark.parametrize(
    "flags",
    [
        ["--max_steps", "7"],
        ["--max_steps=7"],
        ["--max-steps", "7"],
        ["--max-steps=7"],
    ],
)
def test_both_flag_syntaxes_and_hyphenated_names(flags):
    assert load_config(None, flags).max_steps == 7


def test_flag_values_keep_equals_signs_and_leading_minus():
    config = load_config(None, ["--output_dir=runs/a=b", "--max_steps", "-1", "--num_train_epochs", "2"])
    assert (config.output_dir, config.max_steps, config.num_train_epochs) == ("runs/a=b", -1, 2.0)


# coercion, by field type


@pytest.mark.parametrize(
    ("field", "yaml_text", "expected"),
    [
        ("bf16", "yes", True),  # YAML 1.1 booleans
        ("bf16", "False", False),
        ("max_steps", "1e3", 1000),  # YAML 1.1 reads 1e3 as text: integral, so accepted
        ("max_steps", "1000.0", 1000),
        ("learning_rate", "2e-5", 2e-5),  # YAML 1.1 reads 2e-5 as text
        ("learning_rate", "1", 1.0),  # an int for a float field
        ("resume_from_checkpoint", "null", None),
        ("resume_from_checkpoint", "~", None),
        ("resume_from_checkpoint", "none", "none"),  # in YAML only null is None: a string stays a string
        ("completion_only_loss", "null", None),  # bool | None
        ("completion_only_loss", "true", True),
        ("lora_target_modules", "[q_proj, v_proj]", ["q_proj", "v_proj"]),
        ("lora_target_modules", "q_proj, v_proj", ["q_proj", "v_proj"]),  # comma-separated text
        ("report_to", "[]", []),
    ],
)
def test_yaml_values_are_coerced_to_the_field_type(tmp_path, field, yaml_text, expected):
    peft = "use_peft: true\n" if field.startswith("lora_") else ""  # a LoRA option needs it
    value = getattr(load_config(write(tmp_path, f"{peft}{field}: {yaml_text}\n")), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("flags", "field", "expected"),
    [
        (["--packing", "true"], "packing", True),
        (["--packing", "TRUE"], "packing", True),
        (["--packing", "1"], "packing", True),
        (["--packing", "Yes"], "packing", True),
        (["--bf16", "false"], "bf16", False),
        (["--bf16", "0"], "bf16", False),
        (["--bf16", "no"], "bf16", False),
        (["--save_steps", "30"], "save_steps", 30.0),  # a step count or a ratio, as transformers
        (["--save_steps", "1e3"], "save_steps", 1000.0),
        (["--learning_rate", "1e-4"], "learning_rate", 1e-4),
        (["--num_train_epochs", "2"], "num_train_epochs", 2.0),
        (["--model_name_or_path", "/models/llama"], "model_name_or_path", "/models/llama"),
        (["--resume_from_checkpoint", "none"], "resume_from_checkpoint", None),
        (["--resume_from_checkpoint", "NULL"], "resume_from_checkpoint", None),
        (["--resume_from_checkpoint", "latest"], "resume_from_checkpoint", "latest"),
        (["--completion_only_loss", "none"], "completion_only_loss", None),
        (["--completion_only_loss", "false"], "completion_only_loss", False),
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj,v_proj"],
            "lora_target_modules",
            ["q_proj", "v_proj"],
        ),
        (
            ["--use_peft", "true", "--lora_target_modules", " q_proj , v_proj ,"],
            "lora_target_modules",
            ["q_proj", "v_proj"],
        ),
        (["--report_to", "tensorboard"], "report_to", ["tensorboard"]),
        (["--report_to", ""], "report_to", []),
    ],
)
def test_flag_values_are_coerced_to_the_field_type(flags, field, expected):
    value = getattr(load_config(None, flags), field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("max_steps: ten\n", [], "config key 'max_steps' (in {path}) must be an integer, got 'ten' (str)"),
        ("max_steps: 1.5\n", [], "config key 'max_steps' (in {path}) must be an integer, got 1.5 (float)"),
        ("max_steps: 1e-3\n", [], "'max_steps' (in {path}) must be an integer, got '1e-3' (str)"),
        ("max_steps: true\n", [], "'max_steps' (in {path}) must be an integer, got True (bool)"),
        ("", ["--max_steps", "1.5"], "'max_steps' (on the command line) must be an integer, got '1.5' (str)"),
        ("packing: 1\n", [], "'packing' (in {path}) must be a boolean, got 1 (int)"),
        ("packing: 'true'\n", [], "'packing' (in {path}) must be a boolean, got 'true' (str)"),
        ("", ["--packing", "maybe"], "'packing' (on the command line) must be a boolean, got 'maybe' (str)"),
        (
            "learning_rate: fast\n",
            [],
            "'learning_rate' (in {path}) must be a number or null, got 'fast' (str)",
        ),
        (
            "learning_rate: .nan\n",
            [],
            "'learning_rate' (in {path}) must be a number or null, got nan (float)",
        ),
        ("output_dir: [a, b]\n", [], "'output_dir' (in {path}) must be a string, got ['a', 'b'] (list)"),
        ("output_dir: null\n", [], "'output_dir' (in {path}) must be a string, got None (NoneType)"),
        ("output_dir: 2024\n", [], "'output_dir' (in {path}) must be a string, got 2024 (int)"),  # quote it
        ("eval_dataset_name: 1.5\n", [], "'eval_dataset_name' (in {path}) must be a string or null, got 1.5"),
        ("completion_only_loss: maybe\n", [], "'completion_only_loss' (in {path}) must be a boolean or null"),
        (
            "lora_target_modules: 3\n",
            [],
            "'lora_target_modules' (in {path}) must be a list of strings, got 3",
        ),
        ("lora_target_modules: [q, 1]\n", [], "'lora_target_modules' (in {path}) must be a list of strings"),
    ],
)
def test_wrong_types_name_the_key_the_type_and_the_value(tmp_path, yaml_text, flags, message):
    path = write(tmp_path, yaml_text)
    assert message.format(path=path) in config_error(path, flags)


def test_every_field_type_is_supported():
    """Each field's default, written as a flag, coerces back to itself: a new field needs no table entry."""
    for f in dataclasses.fields(TrainConfig):
        default = getattr(TrainConfig(), f.name)
        flag = ",".join(default) if isinstance(default, list) else "none" if default is None else str(default)
        assert getattr(load_config(None, [f"--{f.name}", flag]), f.name) == default, f.name


# unknown keys and malformed flags


def test_an_unknown_yaml_key_suggests_the_nearest(tmp_path):
    path = write(tmp_path, "learning_rat: 1e-4\n")
    message = config_error(path)
    assert message == f"unknown config key 'learning_rat' (in {path}); did you mean 'learning_rate'?"


@pytest.mark.parametrize("flag", ["--max_stepz", "--max-stepz", "--max_stepz=3"])
def test_an_unknown_flag_suggests_the_nearest(flag):
    message = config_error(None, [flag, "3"] if "=" not in flag else [flag])
    assert message == "unknown config key 'max_stepz' (on the command line); did you mean 'max_steps'?"


def test_an_unknown_key_with_nothing_close_has_no_suggestion():
    message = config_error(None, ["--zzzzzz", "1"])
    assert message == "unknown config key 'zzzzzz' (on the command line)"


def test_hfargumentparsers_short_forms_a_bare_switch_and_a_list_of_words():
    """TRL's scripts take ``--use_peft`` alone and ``--lora_target_modules q_proj v_proj``: both were
    'needs a value' / 'expected an option' errors."""
    flags = ["--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--reward_funcs", "a:f", "b:g"]
    config = load_config(None, [*flags, "--bf16", "--max_steps", "3"])
    assert (config.use_peft, config.bf16, config.max_steps) == (True, True, 3)
    assert (config.lora_target_modules, config.reward_funcs) == (["q_proj", "v_proj"], ["a:f", "b:g"])
    assert config_error(None, ["--max_steps", "3", "4"]).endswith("got '4'")  # one value for a number


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["5"], "expected an option like --learning_rate 1e-4 (on the command line), got '5'"),
        (["--=5"], "got '--=5'"),
        (["--max_steps"], "option --max_steps needs a value"),
        (["--max_steps", "--bf16", "true"], "option --max_steps needs a value"),
    ],
)
def test_malformed_flags_fail_in_one_line(flags, message):
    assert message in config_error(None, flags)


# value checks after coercion


@pytest.mark.parametrize(
    ("key", "value", "wanted"),
    [
        ("per_device_train_batch_size", "0", "must be positive, got 0"),
        ("per_device_eval_batch_size", "-2", "must be positive, got -2"),
        ("gradient_accumulation_steps", "0", "must be positive, got 0"),
        ("max_length", "0", "must be positive or null, got 0"),
        ("logging_steps", "0", "must be positive, got 0.0"),
        ("learning_rate", "0", "must be positive or null, got 0.0"),
        ("warmup_ratio", "1.0", "must be in [0, 1), got 1.0"),
        ("warmup_ratio", "-0.1", "must be in [0, 1), got -0.1"),
        ("eval_split_ratio", "1", "must be in [0, 1), got 1.0"),
        (
            "lr_scheduler_type",
            "cosin",
            "must be one of linear, cosine, cosine_with_restarts, polynomial, constant, "
            "constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr, "
            "warmup_stable_decay, got 'cosin'",
        ),
        (
            "optim",
            "adam",
            "must be one of adamw_torch_fused, adamw_torch, adamw_8bit, paged_adamw_8bit, "
            "adafactor, sgd, got 'adam'",
        ),
        (
            "warmup_steps",
            "2.5",
            "must be a whole number of steps, a ratio of the run's steps below 1, or 0 "
            "(warmup_ratio decides), got 2.5",
        ),
        ("save_total_limit", "0", "must be at least 1, or null to keep all, got 0"),
        ("tiled_mlp_budget_mib", "0", "must be positive, got 0.0"),
        (
            "report_to",
            "[wandb, mlflow]",
            "must be tensorboard, wandb, a list of them, none or all, got ['wandb', 'mlflow']",
        ),
    ],
)
def test_bad_values_fail_naming_the_key_and_where(tmp_path, key, value, wanted):
    path = write(tmp_path, f"{key}: {value}\n")
    assert config_error(path) == f"config key {key!r} (in {path}) {wanted}"
    flag = [f"--{key}", value.strip("[]").replace(" ", "")]
    assert config_error(None, flag).startswith(f"config key {key!r} (on the command line) {wanted}")


def test_tiled_mlp_needs_the_patched_model():
    flags = ["--tiled_mlp", "true", "--use_liger_kernel", "false"]
    assert config_error(None, flags) == (
        "config key 'tiled_mlp' (on the command line) tiles the patched MLPs: it needs use_liger_kernel: true"
    )
    assert (
        load_config(None, ["--tiled_mlp", "true", "--tiled_mlp_budget_mib", "64"]).tiled_mlp_budget_mib == 64
    )


def test_tiled_mlp_on_a_family_whose_mlp_is_not_patched_is_refused():
    """StarCoder2's MLP (c_fc/c_proj, not gated) is the model's own: tiling it is refused, not ignored."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastalign.train.policy import _patch

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1, vocab_size=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("starcoder2", **small))
    config = load_config(None, ["--tiled_mlp", "true"])
    with pytest.raises(ConfigError, match="config key 'tiled_mlp': starcoder2's MLP is not one fastalign"):
        _patch(model, config, torch.device("cpu"), needs_fused_head=True, lm_head=True)


def test_boundary_values_are_accepted():
    config = load_config(
        None,
        [
            "--warmup_ratio",
            "0",
            "--eval_split_ratio",
            "0.0",
            "--save_total_limit",
            "1",
            "--lr_scheduler_type",
            "constant",
            "--report_to",
            "tensorboard,wandb",
        ],
    )
    assert (config.warmup_ratio, config.eval_split_ratio, config.save_total_limit) == (0.0, 0.0, 1)
    assert (config.lr_scheduler_type, config.report_to) == ("constant", ["tensorboard", "wandb"])


@pytest.mark.parametrize(
    ("yaml_text", "flag", "expected"),
    [
        ("none", "none", []),
        ("[none]", "none", []),
        ("wandb", "wandb", ["wandb"]),
        ("[tensorboard, wandb]", "tensorboard,wandb", ["tensorboard", "wandb"]),
        ("[]", "", []),
    ],
)
def test_report_to_takes_transformers_forms(tmp_path, yaml_text, flag, expected):
    """As ``TrainingArguments``: one name or a list, "none" for none (before: "none" was an error)."""
    assert load_config(write(tmp_path, f"report_to: {yaml_text}\n")).report_to == expected
    assert load_config(None, ["--report_to", flag]).report_to == expected


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_report_to_a_package_not_installed_is_one_line_at_load(monkeypatch, name):
    """Before: a traceback from the callback's import once the run had started (its config written)."""
    monkeypatch.setattr(config_checks, "_installed", lambda package: package != name)
    assert config_error(None, ["--report_to", name]) == (
        f"config key 'report_to' (on the command line) ({name!r}) needs the {name} package: "
        f"pip install {name}"
    )
    with pytest.raises(ConfigError, match=f"needs the {name} package"):
        check_config(TrainConfig(report_to=[name]))


def test_report_to_in_code_takes_the_same_forms():
    assert TrainConfig(report_to="none").report_to == [] and TrainConfig(report_to=["none"]).report_to == []
    assert TrainConfig(report_to="wandb").report_to == ["wandb"]


def test_report_to_all_is_every_installed_integration(monkeypatch):
    installed = {"wandb"}
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name: object() if name in installed else None, raising=True
    )
    assert load_config(None, ["--report_to", "all"]).report_to == ["wandb"]
    installed.clear()
    assert TrainConfig(report_to="all").report_to == []


def test_report_to_none_among_names_is_an_error():
    assert config_error(None, ["--report_to", "none,wandb"]).startswith(
        "config key 'report_to' (on the command line) must be tensorboard, wandb, a list of them, none or all"
    )


def test_max_steps_or_epochs_must_be_positive(tmp_path):
    assert load_config(None, ["--max_steps", "5", "--num_train_epochs", "0"]).max_steps == 5
    assert load_config(None, ["--max_steps", "-1", "--num_train_epochs", "0.5"]).num_train_epochs == 0.5
    path = write(tmp_path, "max_steps: -1\n")
    message = config_error(path, ["--num_train_epochs", "0"])
    assert "'max_steps' or 'num_train_epochs' must be positive" in message
    assert f"max_steps=-1 in {path}" in message and "num_train_epochs=0.0 on the command line" in message


# files


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("[]\n", "list"), ("42\n", "int")])
def test_a_yaml_file_that_is_not_a_mapping_names_the_file(tmp_path, text, kind):
    path = write(tmp_path, text)
    assert config_error(path) == f"config {path} must be a mapping of keys to values, got {kind}"


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "max_steps: 5\nlora_target_modules: [q_proj\n")
    message = config_error(path)
    assert message.startswith(f"invalid YAML in config {path} at line 3, column 1:")


def test_a_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.yaml"
    assert config_error(path).startswith(f"cannot read config {path}: No such file")


def test_save_and_load_round_trip(tmp_path):
    config = dataclasses.replace(
        TrainConfig(),
        eval_dataset_name="null",  # strings that look like other YAML types come back as strings
        eval_strategy="epoch",
        output_dir="2024",
        resume_from_checkpoint="none",
        completion_only_loss=False,
        learning_rate=3e-5,
        adam_epsilon=1e-12,
        max_steps=17,
        lora_target_modules=["q_proj", "v_proj"],
        report_to=["tensorboard"],
        use_peft=True,
    )
    path = tmp_path / "resolved.yaml"
    path.write_text("stale: true\n")  # replaced, not appended to
    save_config(config, path)
    assert load_config(path) == config
    assert load_config(path) != TrainConfig()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resolved.yaml"]  # no temporary file left


def test_the_example_config_loads():
    config = load_config(EXAMPLE)
    assert (config.model_name_or_path, config.dataset_name, config.output_dir) == (
        "tiny-llama",
        "tiny-sft",
        "outputs/sft-tiny",
    )
    assert (config.max_steps, config.per_device_train_batch_size, config.learning_rate) == (60, 8, 3e-3)
    assert (config.lr_scheduler_type, config.warmup_ratio, config.logging_steps) == ("cosine", 0.1, 10)
    assert (config.save_steps, config.packing, config.max_length, config.seed) == (30, True, 256, 0)
    assert load_config(EXAMPLE, ["--max_steps", "20"]).max_steps == 20


def test_the_help_of_a_key_with_fixed_values_lists_them_all():
    """``train --help`` said "one of OPTIMIZERS": the name of a constant, not the values."""
    from fastalign.train.config.docs import key_docs

    docs = key_docs()
    for key, values in (
        ("optim", config_module.OPTIMIZERS),
        ("lr_scheduler_type", config_module.LR_SCHEDULERS),
        ("train_sampling_strategy", config_module.SAMPLING_STRATEGIES),
    ):
        described = docs[key].doc
        assert all(value in described for value in values), (key, described)


@pytest.mark.parametrize(
    ("yaml_text", "flags"),
    [("resume_from_checkpoint: true\n", []), ("", ["--resume_from_checkpoint", "True"])],
)
def test_resume_from_checkpoint_true_is_latest_as_in_transformers(tmp_path, yaml_text, flags):
    assert load_config(write(tmp_path, yaml_text), flags).resume_from_checkpoint == "latest"
    assert load_config(write(tmp_path, "resume_from_checkpoint: false\n")).resume_from_checkpoint is None
