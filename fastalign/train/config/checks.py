"""Whether a ``TrainConfig`` can work, before anything loads: each value in its range (``_VALUE_CHECKS``),
and no option set that the run would not read (one beside a missing option it qualifies, or overridden
by another). Every problem is one ``ConfigError`` line naming the key and where it was set."""

from __future__ import annotations

import importlib.util
import math
import typing
from collections.abc import Callable, Collection
from typing import Any

from fastalign.data.packing import PACKING_STRATEGIES
from fastalign.data.sft import TRUNCATION_MODES
from fastalign.ops.grpo import ADVANTAGE_ESTIMATORS, SCALE_REWARDS
from fastalign.ops.preference import F_DIVERGENCE_TYPES
from fastalign.train.config.fields import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    GENERATION_ENGINES,
    LR_SCHEDULERS,
    MODEL_INIT_KEYS,
    MODEL_INIT_OWN,
    OPTIMIZERS,
    REPORT_TO,
    SAMPLING_STRATEGIES,
    STRATEGIES,
    ConfigError,
    TrainConfig,
    field_names,
    model_option,
    set_keys,
)

_STEPS_OR_RATIO = "a whole number of steps, or a ratio of the run's steps in (0, 1)"


def _steps_or_ratio(value: float | None) -> bool:
    """A ``<x>_steps`` value: whole steps >= 1 or a ratio in (0, 1), as transformers (0 is no longer
    fastalign's old "never": the strategies say that); None (eval_steps unset) passes."""
    return value is None or (value > 0 and (value < 1 or float(value).is_integer()))


_POSITIVE = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "logging_steps",
)
#: What picks within a Hub model or dataset: a name (or null, the default, where allowed), never blank.
_NOT_BLANK = (
    "model_revision",
    "dataset_config",
    "dataset_train_split",
    "dataset_test_split",
    "dataset_revision",
)


def _finite(value: object) -> bool:
    """Whether a number (or each number of a list) is finite; None (a default left unset) is."""
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    return not isinstance(value, (int, float)) or math.isfinite(value)


def _takes_floats(kind: Any) -> bool:
    """Whether a field type is float, an optional float or a list of floats."""
    return kind is float or any(_takes_floats(arg) for arg in typing.get_args(kind))


#: Every float field (float, float | None, list[float]): ``.inf`` is a valid YAML float but no valid value.
_FLOATS = tuple(name for name, kind in typing.get_type_hints(TrainConfig).items() if _takes_floats(kind))
#: (key, test, what the test asks): checks of single values after coercion, each naming its key. Every
#: numeric field has one (tests/reliability/test_config_inputs.py checks that none is left out).
_VALUE_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *((key, _finite, "a finite number") for key in _FLOATS),
    *((key, lambda value: value > 0, "positive") for key in _POSITIVE),
    ("learning_rate", lambda value: value is None or value > 0, "positive or null"),
    ("max_length", lambda value: value is None or value > 0, "positive or null"),
    ("max_steps", lambda value: value > 0 or value == -1, "positive, or -1 to train num_train_epochs"),
    ("num_train_epochs", lambda value: value >= 0, "non-negative"),
    ("save_total_limit", lambda value: value is None or value >= 1, "at least 1, or null to keep all"),
    ("warmup_ratio", lambda value: 0 <= value < 1, "in [0, 1)"),
    (
        "warmup_steps",
        lambda value: value >= 0 and (value < 1 or float(value).is_integer()),
        "a whole number of steps, a ratio of the run's steps below 1, or 0 (warmup_ratio decides)",
    ),
    ("optim", lambda value: value in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
    ("eval_split_ratio", lambda value: 0 <= value < 1, "in [0, 1)"),
    (
        "activation_offloading_keep_on_device",
        lambda value: value == "auto" or (type(value) is int and value >= 0),
        'a number of layers (0 or more) or "auto"',
    ),
    ("weight_decay", lambda value: value >= 0, "non-negative"),
    ("adam_beta1", lambda value: 0 <= value < 1, "in [0, 1)"),
    ("adam_beta2", lambda value: 0 <= value < 1, "in [0, 1)"),
    ("adam_epsilon", lambda value: value > 0, "positive"),
    ("tiled_mlp_budget_mib", lambda value: value > 0, "positive"),
    ("max_grad_norm", lambda value: value > 0, "positive (clipping to 0 would zero every gradient)"),
    ("seed", lambda value: 0 <= value < 2**32, "in [0, 2**32)"),
    *((key, lambda value: value is None or value.strip() != "", "a non-empty string") for key in _NOT_BLANK),
    ("lr_scheduler_type", lambda value: value in LR_SCHEDULERS, f"one of {', '.join(LR_SCHEDULERS)}"),
    ("lora_r", lambda value: value > 0, "positive"),
    ("lora_alpha", lambda value: value > 0, "positive"),
    ("lora_dropout", lambda value: 0 <= value < 1, "in [0, 1)"),
    ("quantization", lambda value: value in (None, "nf4", "fp4"), "nf4, fp4 or null"),
    (
        "lora_modules_to_save",
        lambda value: value is None or (value and all(name.strip() for name in value)),
        "a non-empty list of module names or null",
    ),
    ("dtype", lambda value: value is None or value in DTYPES, f"one of {', '.join(DTYPES)} or null"),
    (
        "attn_implementation",
        lambda value: value is None or value in ATTN_IMPLEMENTATIONS,
        f"one of {', '.join(ATTN_IMPLEMENTATIONS)} or null",
    ),
    (
        "num_generations",
        lambda value: value is None or value >= 2,
        "at least 2 (advantages compare completions) or null",
    ),
    ("num_generations_eval", lambda value: value is None or value >= 1, "at least 1 or null"),
    ("top_k", lambda value: value >= 0, "non-negative (0: no top-k filtering)"),
    ("min_p", lambda value: value is None or 0 <= value <= 1, "in [0, 1] or null"),
    ("repetition_penalty", lambda value: value > 0, "positive"),
    (
        "reward_clip_range",
        lambda value: value is None or (len(value) == 2 and value[0] <= value[1]),
        "null or [low, high] with low <= high",
    ),
    ("max_completion_length", lambda value: value > 0, "positive"),
    ("max_prompt_length", lambda value: value is None or value > 0, "positive or null"),
    (
        "train_sampling_strategy",
        lambda value: value in (None, *SAMPLING_STRATEGIES),
        f"one of {', '.join(SAMPLING_STRATEGIES)} (not transformers' group_by_length nor batch_rebalance)",
    ),
    ("temperature", lambda value: value is None or value > 0, "positive or null"),
    ("top_p", lambda value: 0 < value <= 1, "in (0, 1]"),
    ("epsilon", lambda value: value >= 0, "non-negative"),
    ("epsilon_high", lambda value: value is None or value >= 0, "non-negative or null"),
    ("delta", lambda value: value is None or value > 1, "greater than 1 or null"),
    ("top_entropy_quantile", lambda value: 0 <= value <= 1, "in [0, 1]"),
    ("num_iterations", lambda value: value >= 1, "at least 1"),
    ("steps_per_generation", lambda value: value is None or value >= 1, "at least 1 or null"),
    ("ref_model_sync_steps", lambda value: value >= 1, "at least 1"),
    ("ref_model_mixup_alpha", lambda value: 0 <= value <= 1, "in [0, 1]"),
    ("beta", lambda value: value is None or value >= 0, "non-negative or null"),
    ("loss_weights", lambda value: value is None or min(value, default=0) >= 0, "non-negative or null"),
    ("label_smoothing", lambda value: 0 <= value < 0.5, "in [0, 0.5)"),
    ("cpo_alpha", lambda value: value >= 0, "non-negative"),
    ("simpo_gamma", lambda value: value >= 0, "non-negative"),
    ("discopop_tau", lambda value: value > 0, "positive"),
    ("alpha", math.isfinite, "finite (any shape; 0: the log-probs themselves)"),
    ("desirable_weight", lambda value: value > 0, "positive"),
    ("undesirable_weight", lambda value: value > 0, "positive"),
    ("ld_alpha", lambda value: value is None or 0 <= value <= 1, "in [0, 1] or null"),
    ("center_rewards_coefficient", lambda value: value is None or value >= 0, "non-negative or null"),
    (
        "f_divergence_type",
        lambda value: value in F_DIVERGENCE_TYPES,
        f"one of {', '.join(F_DIVERGENCE_TYPES)}",
    ),
    ("f_alpha_divergence_coef", _finite, "any finite number (as TRL; 1 is reverse_kl)"),
    ("reward_weights", lambda value: value is None or any(value), "null or a list with a non-zero weight"),
    ("scale_rewards", lambda value: value in SCALE_REWARDS, f"one of {', '.join(SCALE_REWARDS)}"),
    ("generation_engine", lambda value: value in GENERATION_ENGINES, "fastalign or generate"),
    (
        "advantage_estimator",
        lambda value: value in ADVANTAGE_ESTIMATORS,
        f"one of {', '.join(ADVANTAGE_ESTIMATORS)}",
    ),
    ("importance_sampling_level", lambda value: value in ("token", "sequence"), "one of token, sequence"),
    *(
        (f"{kind}_strategy", lambda value: value in STRATEGIES, f"one of {', '.join(STRATEGIES)}")
        for kind in ("logging", "eval", "save")
    ),
    ("logging_steps", _steps_or_ratio, _STEPS_OR_RATIO),
    (
        "eval_steps",
        _steps_or_ratio,
        f"{_STEPS_OR_RATIO}, or null for logging_steps (0 is not 'never': set eval_strategy no)",
    ),
    ("save_steps", _steps_or_ratio, f"{_STEPS_OR_RATIO} (0 is not 'never': set save_strategy no)"),
    (
        "report_to",
        lambda value: set(value) <= set(REPORT_TO),
        f"{', '.join(REPORT_TO)}, a list of them, none or all",
    ),
    ("dataset_text_field", lambda value: value.strip() != "", "a non-empty column name"),
    *(
        (key, lambda value: value is None or value != "", "a token (non-empty) or null")
        for key in ("eos_token", "pad_token")
    ),
    ("chat_template_path", lambda value: value is None or value.strip() != "", "a path or null"),
    (
        "packing_strategy",
        lambda value: value in PACKING_STRATEGIES,
        f"one of {', '.join(PACKING_STRATEGIES)}",
    ),
    ("truncation_mode", lambda value: value in TRUNCATION_MODES, f"one of {', '.join(TRUNCATION_MODES)}"),
    ("neftune_noise_alpha", lambda value: value is None or value > 0, "positive or null"),
    # online_dpo
    ("max_new_tokens", lambda value: value is None or value > 0, "positive or null"),
    ("missing_eos_penalty", lambda value: value is None or value > 0, "positive or null (as TRL)"),
    # distill
    ("lmbda", lambda value: value is None or 0 <= value <= 1, "in [0, 1] or null"),
    ("loss_top_k", lambda value: value is None or value >= 1, "positive or null"),
    (
        "teacher_logprobs_path",
        lambda value: value is None or value.strip() != "",
        "a directory of fastalign teacher-logprobs or null",
    ),
    (
        "teacher_model_name_or_path",
        lambda value: value is None or value.strip() != "",
        "a model directory, built-in name or Hub id, or null",
    ),
    # ppo
    ("value_model_path", lambda value: value is None or value.strip() != "", "a model path or null"),
    ("num_ppo_epochs", lambda value: value >= 1, "at least 1"),
    ("num_mini_batches", lambda value: value >= 1, "at least 1"),
    ("kl_coef", lambda value: value >= 0, "non-negative"),
    ("kl_estimator", lambda value: value in ("k1", "k3"), "one of k1, k3"),
    ("cliprange", lambda value: value >= 0, "non-negative"),
    ("vf_coef", lambda value: value >= 0, "non-negative"),
    ("cliprange_value", lambda value: value >= 0, "non-negative"),
    ("gamma", lambda value: 0 <= value <= 1, "in [0, 1]"),
    ("lam", lambda value: 0 <= value <= 1, "in [0, 1]"),
    # mixture-of-experts router
    ("router_aux_loss_coef", lambda value: value is None or value >= 0, "non-negative, or null"),
)


def refuse_unread(config: TrainConfig, reads: Collection[str], where: dict[str, str] | None = None) -> None:
    """The keys ``config`` sets away from their defaults that a command which trains nothing would ignore
    (it reads only ``reads``): one ``ConfigError`` naming them all, and where each was set, so that a
    training key (an optimizer's, a loss's, LoRA's) is never taken as honoured."""
    where = where or {}
    unread = [key for key in set_keys(config, field_names()) if key not in reads]
    if not unread:
        return
    named = ", ".join(f"{key!r}" + (f" ({where[key]})" if key in where else "") for key in unread)
    keys, are, them = (
        ("keys", "are training keys", "them") if len(unread) > 1 else ("key", "is a training key", "it")
    )
    raise ConfigError(
        f"config {keys} {named} {are}: this command trains nothing and does not read {them}; remove {them} "
        f"(it reads {', '.join(sorted(reads))})"
    )


def check_config(config: TrainConfig) -> None:
    """The value checks of ``load_config`` for a config built in code (``TrainConfig(...)`` skips them):
    a one-line ``ConfigError`` naming the first key whose value cannot work."""
    check_values(config, {})


def _fail(where: dict[str, str], key: str, message: str) -> typing.NoReturn:
    """A one-line ``ConfigError``: the key, where it was set (when it was), and ``message``."""
    raise ConfigError(f"config key {key!r}{f' ({where[key]})' if key in where else ''} {message}")


def check_values(config: TrainConfig, where: dict[str, str], trains: bool = True) -> None:
    """Values that have the right type but cannot work, named with where they were set (``trains``
    False: for a command that trains nothing, without the checks of training's own needs)."""
    for key, test, wanted in _VALUE_CHECKS:
        value = getattr(config, key)
        if not test(value):
            _fail(where, key, f"must be {wanted}, got {value!r}")
    _check_model_options(config, where, trains)
    _check_truncation_mode(config, where)
    if trains and config.quantization and not config.use_peft:
        _fail(
            where,
            "quantization",
            "freezes the base weights in 4 bits: it needs use_peft: true "
            "(QLoRA trains LoRA adapters on them)",
        )
    if config.tiled_mlp and not config.use_liger_kernel:
        _fail(where, "tiled_mlp", "tiles the patched MLPs: it needs use_liger_kernel: true")
    _check_unread_options(config, where)
    held_out = config.eval_dataset_name is not None or config.eval_split_ratio
    if trains and not held_out:  # fastalign teacher-logprobs scores in batches of per_device_eval_batch_size
        for key in set_keys(config, ("per_device_eval_batch_size", "num_generations_eval")):
            _fail(
                where,
                key,
                f"({getattr(config, key)!r}) is read only with held-out data (eval_dataset_name or "
                "eval_split_ratio)",
            )
    for name in config.report_to:
        if name in REPORT_TO and not _installed(name):
            _fail(where, "report_to", f"({name!r}) needs the {name} package: pip install {name}")
    bound = "epsilon_high" if config.epsilon_high is not None else "epsilon"  # as GRPOLoss clips
    if config.delta is not None and config.delta <= 1 + getattr(config, bound):
        _fail(
            where,
            "delta",
            f"must exceed 1 + {bound} ({1 + getattr(config, bound)!r}), got {config.delta!r}: it caps the "
            "importance ratio above the clipping range",
        )
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        got = ", ".join(
            f"{key}={getattr(config, key)!r}" + (f" {where[key]}" if key in where else "")
            for key in ("max_steps", "num_train_epochs")
        )
        raise ConfigError(f"config key 'max_steps' or 'num_train_epochs' must be positive, got {got}")
    _check_evaluation_and_saving(config, where, trains)


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported (a ``report_to`` integration's)."""
    return importlib.util.find_spec(package) is not None


#: key → (the key or condition it needs, in words; whether the config has it): an option that only
#: means something beside another, refused when set (away from its default) without it.
_NEEDS: dict[str, tuple[str, Callable[[TrainConfig], bool]]] = {
    **{
        key: ("quantization (nf4 or fp4)", lambda config: config.quantization is not None)
        for key in field_names()
        if key.startswith("bnb_4bit_")
    },
    "activation_offloading_keep_on_device": (
        "activation_offloading: true",
        lambda config: config.activation_offloading,
    ),
    "tiled_mlp_budget_mib": ("tiled_mlp: true", lambda config: config.tiled_mlp),
    "save_total_limit": ("save_strategy steps or epoch", lambda config: config.save_strategy != "no"),
    **{
        key: ("sync_ref_model: true (TR-DPO)", lambda config: config.sync_ref_model)
        for key in ("ref_model_mixup_alpha", "ref_model_sync_steps")
    },
    **{
        key: (
            "an Adam optimizer (optim adamw_torch_fused, adamw_torch, adamw_8bit or paged_adamw_8bit)",
            lambda config: config.optim.startswith(("adamw", "paged_adamw")),
        )
        for key in ("adam_beta1", "adam_beta2", "adam_epsilon")
    },
}


def _check_unread_options(config: TrainConfig, where: dict[str, str]) -> None:
    """An option set (away from its default) that the run would not read, for want of the option it
    qualifies (``_NEEDS``), or beside one that overrides it: a one-line error, never silently ignored."""
    for key in set_keys(config, _NEEDS):
        needs, has = _NEEDS[key]
        if not has(config):
            _fail(where, key, f"({getattr(config, key)!r}) is read only with {needs}")
    if config.warmup_ratio and config.warmup_steps:
        _fail(
            where,
            "warmup_ratio",
            f"({config.warmup_ratio!r}) is read only when warmup_steps is 0, and warmup_steps is "
            f"{config.warmup_steps!r}: set one of them (warmup_steps below 1 is a ratio too)",
        )


def _check_truncation_mode(config: TrainConfig, where: dict[str, str]) -> None:
    """keep_end only where it applies: with truncation, and not with packing (TRL's SFTTrainer does not
    read truncation_mode when packing)."""
    if config.truncation_mode == "keep_start":
        return
    mode = f"({config.truncation_mode!r})"
    if not config.truncation:
        _fail(
            where,
            "truncation_mode",
            f"{mode} chooses what truncation keeps: it needs truncation: true (without it an over-long "
            "row is an error)",
        )
    if config.packing:
        _fail(
            where,
            "truncation_mode",
            f"{mode} cannot go with packing, which cuts a long example's end (bfd) or splits it (TRL ignores "
            "truncation_mode when packing): remove it",
        )


def _check_model_options(config: TrainConfig, where: dict[str, str], trains: bool = True) -> None:
    """``model_init_kwargs`` (TRL's from_pretrained options) and the LoRA options: a key fastalign's loader
    takes (dtype, attn_implementation) with a valid value given once, or an option it handles itself with
    the value that says what it does anyway; LoRA options only with use_peft; DoRA not over 4-bit weights.
    Anything else would be silently ignored, or clash with what fastalign does: an error. ``trains`` False
    (nothing trains): fp16 over float16 weights is allowed, having no gradient scaler to break."""

    for name, value in (config.model_init_kwargs or {}).items():
        if name in MODEL_INIT_KEYS:
            key = MODEL_INIT_KEYS[name]
            allowed = DTYPES if key == "dtype" else ATTN_IMPLEMENTATIONS
            if value not in allowed:
                _fail(
                    where, "model_init_kwargs", f"{name}: must be one of {', '.join(allowed)}, got {value!r}"
                )
            if model_option(config, key) != value:
                _fail(
                    where,
                    "model_init_kwargs",
                    f"{name}: {value!r}, but {key} is {model_option(config, key)!r}: give it once",
                )
        elif name in MODEL_INIT_OWN:
            same, instead = MODEL_INIT_OWN[name]
            if value != same:
                _fail(where, "model_init_kwargs", f"{name}: {value!r} is not what fastalign does ({instead})")
        else:
            _fail(
                where,
                "model_init_kwargs",
                f"{name}: fastalign takes {', '.join(MODEL_INIT_KEYS)} here, or {', '.join(MODEL_INIT_OWN)} "
                "with the value of what it does anyway; a model config attribute goes in its config.json",
            )
    attention, dtype = model_option(config, "attn_implementation"), model_option(config, "dtype")
    if attention in ("flash_attention_2", "flash_attention_3") and not (
        config.bf16 or config.fp16 or dtype in ("bfloat16", "float16")
    ):
        _fail(
            where,
            "attn_implementation",
            f"({attention}) computes in bf16 or fp16 only, on a CUDA GPU with its flash-attn package: set "
            "bf16 (or fp16, or dtype)",
        )
    if trains and dtype == "float16" and config.fp16 and not config.use_peft:
        _fail(
            where,
            "dtype",
            "float16 cannot train in full with fp16: its gradient scaler cannot unscale fp16 gradients",
        )
    lora = [key for key in field_names() if key.startswith("lora_")] + ["use_rslora", "use_dora"]
    for key in [] if config.use_peft else set_keys(config, lora):
        _fail(where, key, f"({getattr(config, key)!r}) is a LoRA option: it needs use_peft: true")
    if config.use_dora and config.quantization:
        _fail(
            where,
            "use_dora",
            f"cannot go with quantization ({config.quantization}): peft's DoRA reads the dense base weight "
            "(its norm) and cannot read fastalign's 4-bit layers; use plain LoRA (QLoRA) or no quantization",
        )


def _check_evaluation_and_saving(config: TrainConfig, where: dict[str, str], evaluates: bool = True) -> None:
    """Strategies, precision and the best model, as transformers' ``TrainingArguments`` checks them, and
    a step count or metric that the strategies would leave unread (an error, not silently ignored; held-out
    data without an evaluation only where the command ``evaluates``)."""

    if config.fp16 and config.bf16:
        _fail(where, "fp16", "and 'bf16' are both true: set at most one (transformers allows only one)")
    if config.eval_dataset_name and config.eval_split_ratio > 0:
        _fail(where, "eval_split_ratio", "holds out training rows, but eval_dataset_name is set: set one")
    has_eval_data = bool(config.eval_dataset_name) or config.eval_split_ratio > 0
    for key, asks in (
        ("eval_strategy", config.eval_strategy != "no"),
        ("eval_on_start", config.eval_on_start),
        ("load_best_model_at_end", config.load_best_model_at_end),
    ):
        if asks and not has_eval_data:
            _fail(
                where,
                key,
                f"({getattr(config, key)!r}) needs held-out data: set eval_dataset_name or eval_split_ratio",
            )
    if (
        evaluates
        and has_eval_data
        and config.eval_strategy == "no"
        and not (config.eval_on_start or config.load_best_model_at_end)
    ):
        held = "eval_dataset_name" if config.eval_dataset_name else "eval_split_ratio"
        _fail(
            where,
            held,
            "holds data out for evaluation, but eval_strategy is 'no': set eval_strategy steps or epoch",
        )
    defaults = TrainConfig()
    eval_reads_logging_steps = config.eval_strategy == "steps" and config.eval_steps is None
    for kind, read in (
        ("logging", config.logging_strategy == "steps" or eval_reads_logging_steps),
        ("eval", config.eval_strategy == "steps"),
        ("save", config.save_strategy == "steps"),
    ):
        key = f"{kind}_steps"
        if not read and getattr(config, key) != getattr(defaults, key):
            _fail(
                where,
                key,
                f"({getattr(config, key)!r}) is read only with {kind}_strategy steps, not "
                f"{getattr(config, f'{kind}_strategy')!r}",
            )
    if not config.load_best_model_at_end:
        for key in ("metric_for_best_model", "greater_is_better"):
            if getattr(config, key) is not None:
                _fail(
                    where, key, f"({getattr(config, key)!r}) is read only with load_best_model_at_end: true"
                )
        return
    if config.eval_strategy == "no":
        _fail(
            where,
            "load_best_model_at_end",
            "needs evaluations to pick the best: set eval_strategy (and save_strategy) steps or epoch",
        )
    if config.eval_strategy != config.save_strategy:
        _fail(
            where,
            "load_best_model_at_end",
            f"needs save_strategy ({config.save_strategy!r}) to match eval_strategy "
            f"({config.eval_strategy!r}): the best evaluation must be a saved checkpoint",
        )
    eval_steps = config.eval_steps if config.eval_steps is not None else config.logging_steps
    if config.eval_strategy == "steps" and not _multiple(config.save_steps, eval_steps):
        _fail(
            where,
            "load_best_model_at_end",
            f"needs save_steps ({config.save_steps!r}) to be a multiple of the "
            f"eval steps ({eval_steps!r}; both steps or both ratios), so that every checkpoint is evaluated",
        )


def _multiple(save_steps: float, eval_steps: float) -> bool:
    """Whether ``save_steps`` is a whole multiple of ``eval_steps``, both step counts or both ratios (a
    ratio and a count cannot be compared before the run's length is known), as transformers checks."""
    if (save_steps < 1) != (eval_steps < 1):
        return False
    return round(save_steps * 1_000_000) % round(eval_steps * 1_000_000) == 0
