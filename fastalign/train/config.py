"""The training configuration: one flat set of options named as in TRL / transformers'
``TrainingArguments``, so YAML keys and ``--name value`` flags carry over from those tools."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from fastalign.data.packing import PACKING_STRATEGIES
from fastalign.data.sft import TRUNCATION_MODES
from fastalign.ops.grpo import ADVANTAGE_ESTIMATORS, SCALE_REWARDS
from fastalign.ops.preference import F_DIVERGENCE_TYPES

#: How the objectives that sample draw their completions (``fastalign.train.rollout``).
GENERATION_ENGINES = ("fastalign", "generate")


@dataclass
class TrainConfig:
    """Every option of ``fastalign train``; a config names only what differs from these defaults."""

    # model and data
    model_name_or_path: str = "tiny-llama"  # a local directory (config + tokenizer), a built-in tiny name,
    # or a Hugging Face Hub id ("org/name", safetensors only) resolved through the Hugging Face cache
    model_revision: str | None = None  # branch, tag or commit of a Hub model_name_or_path; None: main
    dtype: str | None = None  # the weights' dtype: float32 (TRL's default), bfloat16, float16, or auto (the
    # checkpoint's); None: float32, but QLoRA keeps its frozen unquantized rest in bfloat16 under bf16
    attn_implementation: str | None = None  # eager, sdpa, flex_attention, flash_attention_2/_3 (each needs
    # its package); None: transformers' default (sdpa)
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained options, as TRL's: dtype (torch_dtype)
    # and attn_implementation, or a value that is what fastalign does anyway (device_map: null, ...)
    dataset_name: str | None = None  # a local JSONL/JSON/Parquet file or directory, a built-in name, or a
    # Hub dataset id; None: the objective's built-in tiny data set (tiny-sft, tiny-preference, tiny-kto, ...)
    dataset_config: str | None = None  # configuration (subset) of a Hub dataset; None: its default
    dataset_train_split: str = "train"  # the split of a Hub dataset_name that trains
    dataset_test_split: str = "test"  # the split of a Hub eval_dataset_name (which may be dataset_name)
    dataset_revision: str | None = None  # branch, tag or commit of a Hub dataset; None: main
    eval_dataset_name: str | None = None  # held-out data (a file, built-in or Hub id); None: none
    eval_split_ratio: float = 0.0  # held-out fraction of dataset_name when no eval_dataset_name
    output_dir: str = "outputs/run"  # where checkpoints, metrics and the final model go
    max_length: int | None = None  # None: TRL's for the objective (1024; online_dpo 512); grpo, rloo and
    # ppo read none (nor do TRL's configs): max_prompt_length and max_completion_length bound their rows
    truncation: bool = False  # without it, an over-long example is an error naming its row
    truncation_mode: str = "keep_start"  # sft, dpo: which end of an over-long row truncation keeps
    # (keep_start or keep_end; TRL's SFTConfig / DPOConfig)
    packing: bool = False  # sft: pack examples into rows of max_length tokens
    completion_only_loss: bool | None = None  # None: on for prompt-completion data
    assistant_only_loss: bool = False  # sft: loss on the assistant turns of conversations only

    # data: columns, tokens, chat templates, packing, embedding noise (TRL's SFTConfig / GRPOConfig and
    # transformers' TrainingArguments names)
    dataset_text_field: str = "text"  # sft: the column of standard language-modeling rows
    eos_token: str | None = None  # a token of the vocabulary that replaces the tokenizer's EOS (appended to
    # standard text and completions, where generation stops); None: the tokenizer's
    pad_token: str | None = None  # a token of the vocabulary that pads; None: the tokenizer's (else EOS)
    chat_template_path: str | None = None  # a .jinja/.j2 file or a local tokenizer directory whose chat
    # template replaces the tokenizer's (a directory's EOS too, as TRL's clone_chat_template)
    chat_template_kwargs: dict[str, Any] | None = None  # template variables for every conversational row,
    # e.g. {enable_thinking: false}; a row's own chat_template_kwargs column wins, its tools column is passed
    packing_strategy: str = "bfd"  # with packing: bfd, bfd_split or wrapped (fastalign.data.packing)
    neftune_noise_alpha: float | None = None  # NEFTune: uniform noise on the input embeddings in training

    # schedule
    max_steps: int = -1  # > 0 overrides num_train_epochs; -1: train num_train_epochs (0 is an error)
    num_train_epochs: float = 3.0  # transformers' default
    per_device_train_batch_size: int = 8  # examples per micro-batch and process
    per_device_eval_batch_size: int = 8  # examples per evaluation batch and process
    train_sampling_strategy: str | None = None  # random (reshuffled each epoch) or sequential (the data's
    # order), transformers' names; None: the objective's TRL default (kto sequential, the others random;
    # grpo, rloo and distill read shuffle_dataset instead, as TRL's samplers)
    shuffle_dataset: bool = True  # grpo, rloo, distill: false reads the prompts in the data's order (TRL's
    # GRPOConfig, RLOOConfig and DistillationConfig name for train_sampling_strategy sequential)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    learning_rate: float | None = None  # None: the objective's TRL default (sft 2e-5, the others 1e-6)
    weight_decay: float = 0.0  # decoupled weight decay (not of biases and norm weights)
    adam_beta1: float = 0.9  # Adam's β1
    adam_beta2: float = 0.999  # Adam's β2
    adam_epsilon: float = 1e-8  # Adam's ε
    max_grad_norm: float = 1.0  # > 0 (clip_grad_norm_ with 0 would zero every gradient)
    optim: str = "adamw_torch_fused"  # adamw_torch_fused, adamw_torch, adamw_8bit, paged_adamw_8bit,
    # adafactor or sgd (transformers' names)
    lr_scheduler_type: str = "linear"  # linear, cosine, cosine_with_restarts, polynomial, constant,
    # constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr or
    # warmup_stable_decay (transformers' names and default), after warmup
    lr_scheduler_kwargs: dict[str, Any] | None = None  # the schedule's own options, e.g. {min_lr_rate: 0.1}
    warmup_ratio: float = 0.0  # warmup as a share of the run's steps, when warmup_steps is 0
    warmup_steps: float = 0  # >= 1: steps; in (0, 1): a ratio of the run's steps; 0: warmup_ratio decides
    seed: int = 42  # in [0, 2**32), as numpy and transformers' set_seed take

    # precision and memory
    bf16: bool = False  # bf16 autocast (mixed precision)
    fp16: bool = False  # fp16 autocast with a gradient scaler (one process; not with bf16), as transformers
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward pass
    activation_offloading: bool = False  # keep saved activations in host memory between passes
    activation_offloading_keep_on_device: int | str = "auto"  # the last N layers keep theirs on the GPU;
    # "auto": on CUDA the most that fit by fastalign's memory planner (fastalign plan), 0 elsewhere
    tiled_mlp: bool = False  # run each gated MLP (LoRA included) in token tiles in forward and backward
    # (needs use_liger_kernel): at long context a layer's MLP working set is a tile's, not the sequence's
    tiled_mlp_budget_mib: float = 256  # one tile's working set in MiB, which sizes the tiles
    use_liger_kernel: bool = True  # patch_model the model (named as in transformers' TrainingArguments)
    tf32: bool | None = None  # TF32 matmuls on Ampere+ CUDA GPUs (true needs one); None: torch's default

    # LoRA
    use_peft: bool = False  # train LoRA adapters over frozen base weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scaling lora_alpha/r)
    lora_dropout: float = 0.05  # dropout on LoRA's input
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # modules LoRA adapts
    # (all-linear: every linear layer but the output head)
    use_rslora: bool = False  # rank-stabilized LoRA: scaling lora_alpha/√r instead of lora_alpha/r
    use_dora: bool = False  # DoRA: a trained magnitude per output row over LoRA's direction (not with
    # quantization: peft's DoRA cannot read fastalign's 4-bit weights)
    lora_modules_to_save: list[str] | None = None  # modules trained in full and saved with the adapter,
    # e.g. [lm_head, embed_tokens]

    # 4-bit base weights (QLoRA: needs use_peft), bitsandbytes' layout and names
    quantization: str | None = None  # nf4 or fp4: the decoder layers' linear layers in 4 bits
    bnb_4bit_use_double_quant: bool = True  # quantize the per-block scales too

    # preference training: dpo, orpo, simpo, cpo (TRL's DPOConfig / CPOConfig / ORPOConfig) and kto
    beta: float | None = None  # None: the objective's TRL default (0.1; grpo 0.0, rloo 0.05)
    loss_type: list[str] | None = None  # None: sigmoid (dpo, cpo), kto (kto), dapo (grpo); dpo takes several
    loss_weights: list[float] | None = None  # one per dpo loss_type (a weighted sum)
    label_smoothing: float = 0.0  # dpo: the share of preference labels assumed flipped (robust DPO)
    max_prompt_length: int | None = None  # a prompt limit of its own (TRL 1.16 has none); longer prompts
    # fail unless truncation
    disable_dropout: bool | None = None  # None: the objective's TRL default (true for the preference
    # objectives and kto, false for grpo and rloo); sft does not read it
    ref_model_name_or_path: str | None = None  # None: the policy's initial weights (or LoRA disabled)
    precompute_ref_log_probs: bool = False  # reference log-probs once before training, then no reference
    sync_ref_model: bool = False  # TR-DPO: the reference follows the policy every ref_model_sync_steps
    ref_model_mixup_alpha: float = 0.6  # TR-DPO: the reference's update weight at each sync
    ref_model_sync_steps: int = 512  # TR-DPO: steps between reference syncs
    cpo_alpha: float = 1.0  # cpo, simpo: weight of the chosen NLL (as TRL's CPOConfig)
    simpo_gamma: float = 0.5  # simpo: target reward margin
    alpha: float = 0.0  # cpo, simpo: AlphaPO's reward shape, (1 - p^-alpha) / alpha of each completion's
    # log-prob's p (0: the log-prob itself; TRL's CPOConfig; its loss_type alphapo is simpo with cpo_alpha 0)
    discopop_tau: float = 0.05  # dpo loss_type discopop: the temperature of its log-ratio modulation
    desirable_weight: float = 1.0  # kto
    undesirable_weight: float = 1.0  # kto
    ld_alpha: float | None = None  # dpo, LD-DPO: weight of the tokens past the pair's shorter completion
    f_divergence_type: str = "reverse_kl"  # dpo, f-DPO: forward_kl, js_divergence, alpha_divergence
    f_alpha_divergence_coef: float = 0.5  # dpo: α of f_divergence_type alpha_divergence
    use_weighting: bool = False  # dpo, WPO: weight each pair by its policy probabilities

    # reward (TRL's RewardConfig)
    center_rewards_coefficient: float | None = None  # weight of the mean squared (r_chosen + r_rejected)
    # pushing rewards towards zero mean (Eisenstein et al. 2023; TRL recommends 0.01); None: no such term

    # grpo / rloo (TRL's GRPOConfig / RLOOConfig)
    reward_funcs: list[str] = field(default_factory=list)  # built-ins, or import paths "module:function",
    # TRL's "module.function" (a module of the current directory too) or "path/file.py:function": the
    # module or file is imported (its code runs) when the run starts, so name
    # only code you trust; nothing else is imported, and a missing function is an error naming the file;
    # or a reward model (a one-label sequence classifier, e.g. from `fastalign train reward`): a local
    # directory or a Hub id "org/name", scoring prompt + completion (metric name: its last path part)
    reward_weights: list[float] | None = None  # one weight per reward_funcs entry; None: all 1
    num_generations: int | None = None  # completions per prompt (None: TRL's, grpo 8, rloo 2);
    # per_device_train_batch_size counts completions
    num_generations_eval: int | None = None  # completions per evaluation prompt; None: num_generations
    max_completion_length: int = 512  # tokens sampled per completion at most
    temperature: float | None = None  # sampling temperature; None: TRL's (online_dpo 0.9, else 1.0)
    top_p: float = 1.0  # nucleus sampling (1: none)
    top_k: int = 0  # 0: no top-k filtering
    min_p: float | None = None  # None: no min-p filtering
    repetition_penalty: float = 1.0  # 1: none
    generation_kwargs: dict[str, Any] | None = None  # more GenerationConfig options, over the ones above
    log_completions: bool = False  # write each generation's prompts, completions, rewards and advantages
    # to <output_dir>/completions.jsonl at the logging steps
    epsilon: float = 0.2  # the policy ratio's lower clip (1 − ε)
    epsilon_high: float | None = None  # the ratio's upper clip (1 + ε_high); None: epsilon
    delta: float | None = None  # cap of the ratio above the clipping range (two-sided GRPO); None: none
    scale_rewards: str = "group"  # group, batch, none
    advantage_estimator: str = "grpo"  # grpo, rloo
    num_iterations: int = 1  # optimizer steps on each generation batch
    steps_per_generation: int | None = None  # micro-batches per generation; None: gradient_accumulation_steps
    importance_sampling_level: str = "token"  # token, sequence
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio (TRL's default; token level)
    top_entropy_quantile: float = 1.0  # grpo: the policy term of the top-ρ entropy tokens only (1: all)
    mask_truncated_completions: bool = False  # no loss on completions that reached the length limit
    normalize_advantages: bool = False  # rloo: advantages standardised over the generation batch
    reward_clip_range: list[float] | None = None  # rloo: [low, high] the rewards are clamped to
    use_vllm: bool = False  # TRL's vLLM generation: not available (refused); generation_engine samples
    generation_engine: str = "fastalign"  # how completions are sampled: fastalign (the prompt prefilled
    # once per group, ended rows dropped; generate's tokens and distribution) or generate (model.generate)

    # online_dpo (TRL's OnlineDPOConfig): two sampled completions of each prompt, ranked by reward_funcs
    # (reward_weights), make a DPO pair (beta, loss_type sigmoid or ipo); the sampling options above apply
    max_new_tokens: int | None = None  # online_dpo: tokens sampled per completion; None: TRL's 64
    missing_eos_penalty: float | None = None  # online_dpo, ppo: subtracted from the score of a completion
    # that did not end (no EOS within max_new_tokens; ppo: max_completion_length); None: no penalty

    # distill (TRL's DistillationConfig, with GKDConfig's lmbda and seq_kd): the student learns the teacher's
    # next-token distributions (generalized JSD: beta 0 forward KL, 1 reverse KL; at temperature) on the
    # completions of prompt-completion (or messages) rows, or on ones it samples (max_completion_length)
    teacher_model_name_or_path: str | None = None  # distill: the teacher (a directory, built-in or Hub id)
    lmbda: float | None = None  # distill: the share of micro-batches whose completions the student samples
    # (None: 1, TRL's DistillationTrainer: all; GKD's default 0.5; 0 with teacher_logprobs_path)
    seq_kd: bool = False  # distill: the teacher samples the other micro-batches' completions (GKD's)

    # offline distillation (TRL's ServerDistillationConfig loss on what fastalign teacher-logprobs stored)
    teacher_logprobs_path: str | None = None  # distill: a directory of the teacher's top-k log-probs of the
    # data's completions; the teacher is then never loaded (lmbda 0)
    loss_top_k: int | None = None  # distill with teacher_logprobs_path: the teacher's top-k support of the
    # divergence (None: the stored k; with beta > 0 TRL's 1)
    loss_add_tail: bool = True  # distill with teacher_logprobs_path: a bucket for the mass outside the top-k
    loss_tail_samples: bool | None = None  # distill with teacher_logprobs_path: train on the tail draws the
    # files hold (teacher-logprobs --tail_samples; fastalign's, not TRL's: an unbiased estimate of the tail's
    # shape, beta 0 and the stored k); None: where they hold some; false: TRL's tail bucket alone

    # ppo (TRL's former PPOConfig / OnPolicyConfig, trl 0.11-0.19): the sampling options, reward_funcs,
    # ref_model_name_or_path and missing_eos_penalty above apply; max_completion_length is its response_length
    value_model_path: str | None = None  # ppo: the critic's body (a sequence classifier with a new score
    # head on every token); None: model_name_or_path. With use_peft the critic is a second adapter with a
    # value head on the policy's base model (one model for policy, critic and reference): None or that model
    num_ppo_epochs: int = 4  # ppo: optimizer passes over each generation batch
    num_mini_batches: int = 1  # ppo: optimizer steps per pass (of gradient_accumulation_steps micro-batches)
    whiten_rewards: bool = False  # ppo: per-token rewards scaled to unit variance over the generation batch
    kl_coef: float = 0.05  # ppo: weight of the per-token KL to the reference folded into the rewards
    kl_estimator: str = "k1"  # ppo: k1 (log π − log π_ref) or k3 (non-negative)
    cliprange: float = 0.2  # ppo: the policy ratio's clip range
    vf_coef: float = 0.1  # ppo: weight of the value loss
    cliprange_value: float = 0.2  # ppo: how far a new value may move from the rollout's before it is clipped
    gamma: float = 1.0  # ppo: discount
    lam: float = 0.95  # ppo: GAE's λ

    # mixture-of-experts router (TRL's SFT/DPO/KTO/GRPO/RLOO configs): the load-balancing loss of a MoE
    # model (one whose config has output_router_logits) is added with this weight; None: the model
    # config's router_aux_loss_coef; 0 turns it off. An error for a model without a router.
    router_aux_loss_coef: float | None = None  # MoE load-balancing loss weight; None: the model's

    # logging, evaluation, checkpoints
    # When to log, evaluate and save, as transformers' TrainingArguments: a strategy ("no", "steps" every
    # <x>_steps, "epoch" at each epoch's end); "steps" and "epoch" also act at the run's last step. A
    # <x>_steps >= 1 is a number of steps, one in (0, 1) a ratio of the run's steps (rounded up).
    logging_strategy: str = "steps"  # when to log: no, steps or epoch
    logging_steps: float = 10  # log every N steps (or a ratio of the run)
    eval_strategy: str = "no"  # steps/epoch need eval_dataset_name or eval_split_ratio
    eval_steps: float | None = None  # None: logging_steps
    eval_on_start: bool = False  # evaluate before the first step (a sanity check)
    save_strategy: str = "steps"  # when to save a checkpoint: no, steps or epoch
    save_steps: float = 500  # save every N steps (or a ratio of the run)
    save_total_limit: int | None = None  # keep the newest N checkpoints (and the best); None: all
    load_best_model_at_end: bool = False  # the exported model is the best checkpoint's (needs evaluation)
    metric_for_best_model: str | None = None  # an evaluation metric, "eval_" prefix optional; None: "loss"
    greater_is_better: bool | None = None  # None: false for a metric ending in "loss", else true
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or "latest" in output_dir (true,
    # transformers' word for it, is taken as latest; false as null)
    overwrite_output_dir: bool = False  # a non-empty output_dir is refused unless resuming; true: one that
    # holds a fastalign run (fastalign_config.yaml) is emptied, all of it, once the new run has loaded
    report_to: list[str] = field(default_factory=list)  # tensorboard and/or wandb, as transformers takes
    # it: one name or a list; "none" (or []): none; "all": those of the two that are installed
    loss_curve_png: bool = True  # write <output_dir>/loss_curve.png at the end (needs matplotlib)

    def __post_init__(self) -> None:
        self.report_to = _report_to(self.report_to)


def _report_to(value: str | Sequence[str]) -> list[str]:
    """``report_to`` as transformers' ``TrainingArguments`` reads it: a name or a list of names, "none"
    for none and "all" for every integration installed (of fastalign's: ``REPORT_TO``). Anything else is
    left for the value check to name."""
    names = [value] if isinstance(value, str) else list(value)
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [name for name in REPORT_TO if importlib.util.find_spec(name) is not None]
    return names


class ConfigError(ValueError):
    """A config problem, said in one line that names the key (and the file), so a CLI can print it as is."""


#: Optimizers, by transformers' ``optim`` names (made in ``fastalign.train.optim``).
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd")
#: Every ``lr_scheduler_type`` of ``transformers.get_scheduler`` but those that step on a metric
#: (reduce_lr_on_plateau, greedy): a run's schedule is a function of the step.
LR_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
)  # fmt: skip
#: When to log, evaluate and save (transformers' ``IntervalStrategy``).
STRATEGIES = ("no", "steps", "epoch")
_STEPS_OR_RATIO = "a whole number of steps, or a ratio of the run's steps in (0, 1)"


def _steps_or_ratio(value: float | None) -> bool:
    """A ``<x>_steps`` value: whole steps >= 1 or a ratio in (0, 1), as transformers (0 is no longer
    fastalign's old "never": the strategies say that); None (eval_steps unset) passes."""
    return value is None or (value > 0 and (value < 1 or float(value).is_integer()))


#: Where metrics can be reported besides ``metrics.jsonl``.
REPORT_TO = ("tensorboard", "wandb")
#: ``dtype`` values (TRL's ModelConfig choices): a torch dtype by name, or "auto": the checkpoint's own.
DTYPES = ("auto", "bfloat16", "float16", "float32")
#: ``attn_implementation`` values: transformers' attention kernels (the flash ones need their package).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
#: ``model_init_kwargs`` keys that are TrainConfig keys too (``torch_dtype``: transformers' older name).
MODEL_INIT_KEYS = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation"}
#: ``model_init_kwargs`` keys for what fastalign's loader does itself: key → (the one value that says what
#: it does anyway, accepted as a no-op; what to do instead of any other value).
MODEL_INIT_OWN = {
    "revision": (None, "set model_revision"),
    "trust_remote_code": (False, "fastalign never runs a checkpoint's own code (transformers' models only)"),
    "device_map": (None, "fastalign places the model itself (one device per process; FSDP2 under torchrun)"),
    "quantization_config": (None, "set quantization (nf4 or fp4, with use_peft)"),
    "load_in_4bit": (False, "set quantization (nf4 or fp4, with use_peft)"),
    "load_in_8bit": (False, "8-bit base weights are not supported; quantization takes nf4 or fp4"),
    "use_cache": (False, "training runs without a KV cache; generation turns it on itself"),
    "use_safetensors": (True, "only safetensors weights are ever loaded"),
    "low_cpu_mem_usage": (True, "checkpoints are always streamed in layer by layer"),
}

#: transformers' ``train_sampling_strategy`` values fastalign runs: the order training reads the data in.
SAMPLING_STRATEGIES = ("random", "sequential")

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NULL = ("none", "null")
_ON_THE_COMMAND_LINE = "on the command line"
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


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    reads: Collection[str] | None = None,
) -> TrainConfig:
    """Defaults, then the YAML mapping at ``path``, then ``--key value`` / ``--key=value`` overrides.

    Keys and types come from the ``TrainConfig`` fields, so a new field is configurable with no other change;
    every problem is a one-line ``ConfigError`` naming the key and where it was set. ``reads``: the keys of
    a command that runs a model without training it (``fastalign teacher-logprobs``): any other key set
    away from its default is refused first (``refuse_unread``), and the checks that only a training run
    needs are left out (held-out data without an ``eval_strategy``, ``quantization`` without
    ``use_peft``).
    """
    values: dict[str, tuple[object, str | None]] = {}  # key → (raw value, file it came from; None: a flag)
    if path is not None:
        values |= {key: (value, str(path)) for key, value in _read_yaml(Path(path)).items()}
    values |= {key: (value, None) for key, value in _parse_flags(overrides)}

    hints = typing.get_type_hints(TrainConfig)
    kinds = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.init}
    kwargs: dict[str, object] = {}
    where: dict[str, str] = {}
    for key, (raw, source) in values.items():
        where[key] = _ON_THE_COMMAND_LINE if source is None else f"in {source}"
        if key not in kinds:
            close = difflib.get_close_matches(key, list(kinds), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} ({where[key]}){hint}")
        if source is None and kinds[key] in (int, float, bool) and str(raw).lower() in _NULL:
            continue  # --save_steps null: a number or switch the config file set goes back to its default
        if key == "resume_from_checkpoint" and str(raw).lower() in ("true", "false"):
            raw = "latest" if str(raw).lower() == "true" else None  # transformers' bool form
        try:
            kwargs[key] = _coerce(raw, kinds[key], from_flag=source is None)
        except _Mismatch:
            raise ConfigError(
                f"config key {key!r} ({where[key]}) must be {_describe(kinds[key])}, "
                f"got {raw!r} ({type(raw).__name__})"
            ) from None
    config = TrainConfig(**kwargs)
    if reads is not None:
        refuse_unread(config, reads, where)
    _check(config, where, trains=reads is None)
    return config


def refuse_unread(config: TrainConfig, reads: Collection[str], where: dict[str, str] | None = None) -> None:
    """The keys ``config`` sets away from their defaults that a command which trains nothing would ignore
    (it reads only ``reads``): one ``ConfigError`` naming them all, and where each was set, so that a
    training key (an optimizer's, a loss's, LoRA's) is never taken as honoured."""
    where = where or {}
    unread = [key for key in set_keys(config, _field_names()) if key not in reads]
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


def save_config(config: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML that ``load_config`` reads back equal, written atomically.

    Atomic (a temporary file in the same directory, renamed into place) so that a crash or a concurrent
    reader never sees half a file next to a checkpoint.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    try:
        tmp.write_text(yaml.safe_dump(asdict(config), sort_keys=False), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _DuplicateKey(Exception):
    def __init__(self, key: object, first: int, second: int) -> None:
        super().__init__(key, first, second)
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping naming a key twice (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[object, int] = {}
        for key_node, _ in node.value:  # the keys as written, before merges (``<<``) are flattened in
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise _DuplicateKey(key, lines[key], line)
                lines[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                pass
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"cannot read config {path}: {reason}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as error:
        raise ConfigError(
            f"config key {error.key!r} is set twice in {path}, at line {error.first} and line {error.second} "
            "(YAML would keep the last silently); keep one"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"invalid YAML in config {path}{at}: {problem}") from None
    if data is None:  # an empty file (or only comments): the defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values, got {type(data).__name__}")
    return {str(key): value for key, value in data.items()}


def _parse_flags(flags: Sequence[str]) -> list[tuple[str, str]]:
    """``["--max-steps", "5", "--bf16=true"]`` as ``[("max_steps", "5"), ("bf16", "true")]``, with
    HfArgumentParser's (TRL's scripts') two short forms: a bool key alone is true (``--use_peft``), and
    a list key takes the values that follow it (``--lora_target_modules q_proj v_proj``)."""
    hints = typing.get_type_hints(TrainConfig)
    pairs, items = [], list(flags)
    while items:
        flag = items.pop(0)
        key, sep, value = flag[2:].partition("=")
        if not flag.startswith("--") or not key:
            raise ConfigError(
                f"expected an option like --learning_rate 1e-4 ({_ON_THE_COMMAND_LINE}), got {flag!r}"
            )
        key = key.replace("-", "_")
        kind = hints.get(key)
        if not sep:
            if (not items or items[0].startswith("--")) and kind is bool:
                value = "true"
            elif not items or items[0].startswith("--"):
                raise ConfigError(f"option --{key} needs a value ({_ON_THE_COMMAND_LINE})")
            else:
                value = items.pop(0)
                if list in (typing.get_origin(kind), *map(typing.get_origin, typing.get_args(kind))):
                    while items and not items[0].startswith("--"):
                        value += f",{items.pop(0)}"
        pairs.append((key, value))
    return pairs


class _Mismatch(Exception):
    """A value that is not of the field's type (``load_config`` words the error)."""


def _coerce(raw: object, kind: Any, *, from_flag: bool) -> object:
    """``raw`` as a value of type ``kind``: YAML values as typed, flag values (always text) parsed."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (raw is None or (from_flag and str(raw).lower() in _NULL)):
            return None
        for arg in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(raw, arg, from_flag=from_flag)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is dict:  # a YAML mapping, or JSON text on the command line
        if from_flag and isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError:
                raise _Mismatch from None
        if isinstance(raw, dict) and all(isinstance(key, str) for key in raw):
            return dict(raw)
        raise _Mismatch
    if origin is list:
        (item_kind,) = args or (str,)
        if isinstance(raw, str):  # "q_proj, v_proj" (a flag, or YAML written the same way)
            return [
                _coerce(item.strip(), item_kind, from_flag=True) for item in raw.split(",") if item.strip()
            ]
        if isinstance(raw, list):
            return [_coerce(item, item_kind, from_flag=from_flag) for item in raw]
        raise _Mismatch
    if isinstance(raw, bool):  # before int: bool is an int subclass, and True is no number
        if kind is bool:
            return raw
        raise _Mismatch
    if kind is bool:
        if from_flag and isinstance(raw, str) and raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise _Mismatch
    if kind is int:
        return _as_int(raw)
    if kind is float:
        try:
            number = float(raw) if isinstance(raw, (int, float, str)) else math.nan
        except ValueError:
            raise _Mismatch from None
        if math.isnan(number):
            raise _Mismatch
        return number
    if kind is str:
        if isinstance(raw, str):  # no str(raw): YAML ``output_dir: 1.10`` would come out as "1.1"
            return raw
        raise _Mismatch
    raise TypeError(f"TrainConfig field type {kind!r} has no coercion; add one to fastalign.train.config")


def _as_int(raw: object) -> int:
    """An int, never silently truncated: 1.5 and "1.5" fail, 1000.0 and "1e3" (YAML 1.1 text) are 1000."""
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
        try:
            raw = float(raw)
        except ValueError:
            raise _Mismatch from None
    if isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        return int(raw)
    raise _Mismatch


_WORDS = {
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(kind: Any, plural: bool = False) -> str:
    """A field type in words, for error messages: ``str | None`` → "a string or null"."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(arg) for arg in args if arg is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is list:
        return f"a list of {_describe(args[0] if args else str, plural=True)}"
    if origin is dict:
        return "a mapping of names to values (JSON on the command line)"
    singular, many = _WORDS.get(kind, (str(kind), str(kind)))
    return many if plural else singular


def check_config(config: TrainConfig) -> None:
    """The value checks of ``load_config`` for a config built in code (``TrainConfig(...)`` skips them):
    a one-line ``ConfigError`` naming the first key whose value cannot work."""
    _check(config, {})


def _fail(where: dict[str, str], key: str, message: str) -> typing.NoReturn:
    """A one-line ``ConfigError``: the key, where it was set (when it was), and ``message``."""
    raise ConfigError(f"config key {key!r}{f' ({where[key]})' if key in where else ''} {message}")


def _check(config: TrainConfig, where: dict[str, str], trains: bool = True) -> None:
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


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


#: key → (the key or condition it needs, in words; whether the config has it): an option that only
#: means something beside another, refused when set (away from its default) without it.
_NEEDS: dict[str, tuple[str, Callable[[TrainConfig], bool]]] = {
    **{
        key: ("quantization (nf4 or fp4)", lambda config: config.quantization is not None)
        for key in _field_names()
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


def set_keys(config: object, keys) -> list[str]:
    """Those of ``keys`` that ``config`` (a ``TrainConfig``, or options read from one under its key names)
    sets away from ``TrainConfig``'s defaults (a saved config lists every key: naming one at its default
    sets nothing)."""
    defaults = TrainConfig()
    return [key for key in keys if getattr(config, key) != getattr(defaults, key)]


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


def model_option(config: TrainConfig, key: str) -> str | None:
    """``dtype`` or ``attn_implementation`` as the run loads the model: the key, or where it is null, the
    same option in ``model_init_kwargs`` (``_check_model_options`` refuses the two disagreeing)."""
    if getattr(config, key) is not None:
        return getattr(config, key)
    kwargs = config.model_init_kwargs or {}
    return next((value for name, value in kwargs.items() if MODEL_INIT_KEYS.get(name) == key), None)


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
    lora = [key for key in _field_names() if key.startswith("lora_")] + ["use_rslora", "use_dora"]
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


OptionsT = TypeVar("OptionsT")


#: TRL's defaults of keys whose TrainConfig default is None because one trainer's differs (OnlineDPOConfig:
#: max_length 512, temperature 0.9): every other objective that reads them takes these.
SHARED_DEFAULTS = {"max_length": 1024, "temperature": 1.0}


def options_from(config: TrainConfig, cls: type[OptionsT], **defaults: Any) -> OptionsT:
    """``cls`` (an objective's options dataclass) with each field read from the config key of its name; a
    key the config leaves None takes the objective's default from ``defaults`` (TRL's, which differ by
    objective), else ``SHARED_DEFAULTS``'."""
    defaults = SHARED_DEFAULTS | defaults
    values = {}
    for option in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(config, option.name)
        values[option.name] = defaults[option.name] if value is None and option.name in defaults else value
    return cls(**values)
