"""The training options: ``TrainConfig``'s fields (named as in TRL / transformers' ``TrainingArguments``,
so YAML keys and ``--name value`` flags carry over from those tools), the values some of them take, and
how an objective reads its options from a config (``options_from``)."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    learning_rate: float | None = None  # None: the objective's TRL default (sft 2e-5, reward 1e-4, ppo
    # 5e-5, online_dpo 5e-7, the others 1e-6)
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
    use_liger_kernel: bool = True  # patch_model the model (named as in transformers' TrainingArguments);
    # false: its own layers, the fused loss head only (any causal LM, also one outside fastalign's table)
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
    beta: float | None = None  # None: the objective's TRL default (0.1; grpo 0.0, rloo 0.05, distill 1.0)
    loss_type: list[str] | None = None  # None: nll (sft; or dft), sigmoid (dpo, cpo), kto (kto), dapo (grpo);
    # dpo takes several
    loss_weights: list[float] | None = None  # one per dpo loss_type (a weighted sum)
    label_smoothing: float = 0.0  # dpo: the share of preference labels assumed flipped (robust DPO)
    max_prompt_length: int | None = None  # a prompt limit of its own (TRL 1.16 has none); longer prompts
    # fail unless truncation
    disable_dropout: bool | None = None  # None: the objective's TRL default (true for the preference
    # objectives and kto, false for grpo, rloo and distill); sft does not read it
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
    scale_rewards: str = "group"  # group, batch, none (TRL's true and false: group and none)
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


def field_names() -> list[str]:
    """Every ``TrainConfig`` key, in the fields' order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


def set_keys(config: object, keys) -> list[str]:
    """Those of ``keys`` that ``config`` (a ``TrainConfig``, or options read from one under its key names)
    sets away from ``TrainConfig``'s defaults (a saved config lists every key: naming one at its default
    sets nothing)."""
    defaults = TrainConfig()
    return [key for key in keys if getattr(config, key) != getattr(defaults, key)]


def model_option(config: TrainConfig, key: str) -> str | None:
    """``dtype`` or ``attn_implementation`` as the run loads the model: the key, or where it is null, the
    same option in ``model_init_kwargs`` (``checks`` refuses the two disagreeing)."""
    if getattr(config, key) is not None:
        return getattr(config, key)
    kwargs = config.model_init_kwargs or {}
    return next((value for name, value in kwargs.items() if MODEL_INIT_KEYS.get(name) == key), None)


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
