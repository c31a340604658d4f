"""The model a run trains, and its frozen reference: in the dtype and with the attention kernel asked for,
patched, with LoRA and the activation-memory savers when asked for, on the device, sharded with FSDP2
under ``torchrun``; on the CPU the policy's layers hand freed heap memory back to the OS as they train."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from transformers import AutoConfig
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_torch_tf32_available

import fastalign
from fastalign.builtin.models import ModelTask
from fastalign.errors import one_line
from fastalign.quant import QuantOptions
from fastalign.train import host_memory, memory
from fastalign.train.config import SHARED_DEFAULTS, ConfigError, TrainConfig, model_option
from fastalign.train.distributed import DistributedContext, shard_model
from fastalign.train.loading import (
    cast_parameters,
    checkpoint_dtype,
    load_model_and_tokenizer,
    materialize_model,
    resolve_model,
)


def prepare_policy(
    model: torch.nn.Module,
    config: TrainConfig,
    ctx: DistributedContext,
    *,
    needs_fused_head: bool,
    task: ModelTask = "causal_lm",
    row_tokens: int | None = None,
    rows_per_example: int = 1,
) -> torch.nn.Module:
    """Patched (every fused kernel with ``use_liger_kernel``; else only the fused loss head when the
    objective's loss needs it, i.e. all but SFT and reward), LoRA, activation checkpointing/offloading, on
    the device, sharded; on the CPU, trimming glibc's heaps between layers (``host_memory``). ``task``:
    what the model was loaded as (``load_model_and_tokenizer``); a reward model (sequence_classification)
    has no LM head to fuse, and its LoRA is peft's SEQ_CLS. A 4-bit skeleton
    (``load_model_and_tokenizer(..., materialize=False)``) is filled from its checkpoint last, once
    sharded, so that each rank only ever holds its shard of it.

    First the run's ``dtype`` and ``attn_implementation`` (``set_model_options``) and ``tf32``. LoRA
    variants that read the base weights when they are added (DoRA: the magnitude starts as each row's
    norm; ``lora_modules_to_save``: a trainable copy of each module) get a filled model: under torchrun each
    rank then holds the whole model while it loads. ``row_tokens``: the longest row one forward takes
    (``Objective.sequence_length``; None: ``max_length``) and ``rows_per_example`` the rows it takes per
    example of the batch (``Objective.rows_per_example``: 2 for a preference pair), which size activation
    offloading's host pool and its automatic keep-on-device plan."""
    set_tf32(config.tf32)
    set_model_options(model, config.model_name_or_path, config, ctx.device)
    _patch(model, config, ctx.device, needs_fused_head, lm_head=task == "causal_lm")
    if config.use_peft:
        if config.use_dora or config.lora_modules_to_save:
            _fill(model, config.model_name_or_path, config, ctx.device)
        model = _add_lora(model, config, task)
        if config.use_liger_kernel:  # the adapters are new: they get the in-place update as well
            fastalign.patching.patch_lora_layers(model)
    if config.gradient_checkpointing:
        memory.enable_activation_checkpointing(model)
    # On a GPU, a run whose layer inputs outgrow the host stops here, before training
    if config.activation_offloading:
        row_tokens = _row_tokens(config, row_tokens)
        rows = config.per_device_train_batch_size * rows_per_example
        tokens = row_tokens * rows if ctx.device.type == "cuda" else None
        keep = offload_keep_on_device(model, config, ctx, row_tokens, rows)
        try:
            residual = _residual_bytes(model, config, ctx)
            memory.enable_activation_offloading(
                model, tokens=tokens, keep_on_device=keep, residual_bytes=residual,
                host_processes=ctx.local_world_size,
            )  # fmt: skip
        except ValueError as error:  # more layers than the model has
            raise ConfigError(f"config key 'activation_offloading_keep_on_device': {error}") from None
    model = _place(model, config.model_name_or_path, config, ctx)
    if ctx.device.type == "cpu":  # its layers hand what they free back to the OS as they train
        host_memory.release_between_layers(model)
    return model


def offload_keep_on_device(
    model: torch.nn.Module,
    config: TrainConfig,
    ctx: DistributedContext,
    row_tokens: int | None = None,
    rows: int | None = None,
) -> int:
    """``activation_offloading_keep_on_device``: a number as given; "auto": on CUDA the most layers whose
    saved tensors the memory planner finds room for on this GPU (``fastalign.plan``, for forwards of
    ``rows`` (None: per_device_train_batch_size) rows of ``row_tokens`` (None: max_length)), 0 on the
    CPU (offloading is a no-op there) and where the planner does not know the model's family. Without
    ``use_liger_kernel`` it plans the model's own (larger) activations.
    Bytes the planner underestimated would be an out-of-memory error: it is within a few % of H100
    measurements, and fills only ``AUTO_KEEP_SHARE`` of the GPU (as ``fastalign plan`` shows)."""
    keep = config.activation_offloading_keep_on_device
    if keep != "auto":
        return keep
    if ctx.device.type != "cuda":
        return 0
    from fastalign.plan import PlanError, plan_memory

    method = "qlora" if config.quantization else "lora" if config.use_peft else "full"
    base_dtype = _planner_dtype(config)
    device_memory = torch.cuda.get_device_properties(ctx.device).total_memory
    try:
        plan = plan_memory(
            model.config, method=method, gpus=ctx.world_size,
            seq_len=_row_tokens(config, row_tokens),
            batch_size=rows or config.per_device_train_batch_size,
            checkpointing=config.gradient_checkpointing,
            offload_activations=True, lora_r=config.lora_r, lora_dropout=config.lora_dropout,
            gpu_memory_bytes=device_memory, bf16=config.bf16,
            base_dtype=base_dtype, device="cuda",
            fused_loss_head=config.use_liger_kernel, suggest=False,
            tiled_mlp_mib=config.tiled_mlp_budget_mib if config.tiled_mlp else 0,
        )  # fmt: skip
    except PlanError:
        return 0
    return plan.offload_keep_on_device


def _row_tokens(config: TrainConfig, row_tokens: int | None) -> int:
    """The longest row of a forward: as given, else ``max_length`` (TRL's where the config leaves it null)."""
    if row_tokens is not None:
        return row_tokens
    return SHARED_DEFAULTS["max_length"] if config.max_length is None else config.max_length


def _planner_dtype(config: TrainConfig) -> str:
    """The planner's name for the weights' dtype: "bf16" for any 2-byte float (fp16 weights take the
    bytes bf16 ones do), else "fp32"."""
    two_bytes = model_dtype(config, config.model_name_or_path) in (torch.bfloat16, torch.float16)
    return "bf16" if two_bytes else "fp32"


def _residual_bytes(model: torch.nn.Module, config: TrainConfig, ctx: DistributedContext) -> int:
    """Bytes per element of the layer inputs in training, as the memory planner counts them (under FSDP2
    with ``bf16``, 2 although the weights are fp32 until sharded)."""
    from fastalign.plan.planner import residual_stream_bytes

    method = "qlora" if config.quantization else "lora" if config.use_peft else "full"
    base_dtype = _planner_dtype(config)
    return residual_stream_bytes(method, ctx.world_size, config.bf16, base_dtype)


def _place(model: torch.nn.Module, name_or_path: str, config: TrainConfig, ctx: DistributedContext):
    """On the device and sharded; a 4-bit skeleton is filled from its checkpoint only once sharded."""
    skeleton = any(param.is_meta for param in model.parameters())
    if not skeleton:
        model.to(ctx.device)
    model = shard_model(model, mixed_precision=config.bf16)
    if skeleton:
        _fill(model, name_or_path, config, ctx.device)
    return model


def _fill(model: torch.nn.Module, name_or_path: str, config: TrainConfig, device: torch.device) -> None:
    """A skeleton filled from its checkpoint in the run's dtype (a filled model stays as it is)."""
    revision = config.model_revision if name_or_path == config.model_name_or_path else None
    materialize_model(
        model,
        name_or_path,
        quant_options(config),
        device,
        config.seed,
        revision=revision,
        dtype=model_dtype(config, name_or_path),
    )


def autocast_dtype(config: TrainConfig, ctx: DistributedContext) -> torch.dtype | None:
    """bf16 or fp16 autocast over fp32 weights in a single process (fp16 with the engine's gradient
    scaler); under FSDP2 the bf16 policy casts instead, and fp16 is refused: the scaler would decide to
    skip a step on each rank's gradient shards alone, and the ranks would drift apart."""
    if config.fp16:
        if ctx.enabled:
            raise ConfigError(
                "config key 'fp16' works in a single process only, not under torchrun (FSDP2): use bf16"
            )
        return torch.float16
    return torch.bfloat16 if config.bf16 and not ctx.enabled else None


def quant_options(config: TrainConfig) -> QuantOptions | None:
    """The 4-bit quantization the config asks for, if any."""
    if not config.quantization:
        return None
    rest = model_dtype(config, config.model_name_or_path)  # the frozen unquantized rest
    return QuantOptions(
        quant_type=config.quantization,
        double_quant=config.bnb_4bit_use_double_quant,
        dtype=torch.bfloat16 if config.bf16 and model_option(config, "dtype") is None else rest,
    )


def model_dtype(config: TrainConfig, name_or_path: str) -> torch.dtype:
    """The dtype the weights of model ``name_or_path`` are loaded in: ``dtype`` (or model_init_kwargs'),
    "auto" the dtype its checkpoint declares (fp32 for a built-in model); unset, fp32: TRL's default
    (``create_model_from_path``), where transformers 5 alone would take the checkpoint's."""
    dtype = model_option(config, "dtype")
    if dtype == "auto":
        revision = config.model_revision if name_or_path == config.model_name_or_path else None
        resolved = resolve_model(name_or_path, revision)
        if isinstance(resolved, str):  # a built-in model: random fp32 weights
            return torch.float32
        return checkpoint_dtype(AutoConfig.from_pretrained(resolved))
    return getattr(torch, dtype or "float32")


def set_model_options(
    model: torch.nn.Module, name_or_path: str, config: TrainConfig, device: torch.device
) -> None:
    """What ``from_pretrained(dtype=..., attn_implementation=...)`` would have made of the model just
    loaded (a skeleton or a built-in model, in fp32, transformers' default attention): its floating
    parameters in ``model_dtype`` when a dtype is asked for (buffers such as RoPE's stay fp32, as
    from_pretrained keeps them), and the attention kernel switched by transformers'
    ``set_attn_implementation``, which checks that the model supports it. A flash kernel must be
    installed (transformers would otherwise fetch one from the Hub); flex attention has no CPU backward.
    The policy and its frozen reference both go through here, so they load alike."""
    if model_option(config, "dtype") is not None:
        cast_parameters(model, model_dtype(config, name_or_path))
    attention = model_option(config, "attn_implementation")
    if attention is None:
        return
    package, available = _FLASH.get(attention, (None, None))
    if available is not None and not available():
        raise ConfigError(
            f"config key 'attn_implementation' ({attention!r}) needs the {package} package and a CUDA GPU: "
            "one of them is missing here"
        )
    if attention == "flex_attention" and device.type == "cpu":
        raise ConfigError(
            "config key 'attn_implementation' ('flex_attention') cannot train on the CPU: PyTorch's flex "
            "attention has no CPU backward; use sdpa or eager"
        )
    try:
        model.set_attn_implementation(attention)
    except (ValueError, ImportError) as error:
        raise ConfigError(f"config key 'attn_implementation' ({attention!r}): {one_line(error)}") from None


#: The package each flash attention kernel needs, and transformers' check that it is usable here (without
#: its fallback, which would fetch a kernel from the Hub instead).
_FLASH = {
    "flash_attention_2": ("flash-attn", is_flash_attn_2_available),
    "flash_attention_3": ("flash-attn-3", is_flash_attn_3_available),
}


def set_tf32(tf32: bool | None) -> None:
    """transformers' ``tf32``: true lets fp32 matmuls and convolutions use TF32 tensor cores (Ampere or
    newer CUDA GPUs: elsewhere an error, never ignored); false keeps them IEEE fp32; None leaves torch's
    default."""
    if tf32 is None:
        return
    if tf32 and not is_torch_tf32_available():
        raise ConfigError(
            "config key 'tf32' needs a CUDA GPU of the Ampere generation or newer (compute capability 8.0+), "
            "and there is none here"
        )
    torch.backends.fp32_precision = "tf32" if tf32 else "ieee"


#: The config keys that name a model a run loads frozen (the key an error about it names).
_MODEL_KEYS = ("ref_model_name_or_path", "teacher_model_name_or_path", "model_name_or_path")


def load_frozen_model(name_or_path: str, config: TrainConfig, ctx: DistributedContext) -> torch.nn.Module:
    """A reference model: quantized, patched and sharded as the policy, frozen, in eval mode.

    A Hub id is resolved once (at ``model_revision`` when it is the policy's model, else at main), so
    that its skeleton and the weights filled into it come from one snapshot."""
    revision = config.model_revision if name_or_path == config.model_name_or_path else None
    key = next((key for key in _MODEL_KEYS if getattr(config, key) == name_or_path), "model_name_or_path")
    path = str(resolve_model(name_or_path, revision, key=key))
    model, _ = load_model_and_tokenizer(path, quant_options(config), ctx.device, materialize=False)
    set_model_options(model, path, config, ctx.device)
    _patch(model, config, ctx.device, needs_fused_head=True, lm_head=True, name_or_path=path)
    model.requires_grad_(False).eval()
    return _place(model, path, config, ctx)


def _patch(
    model: torch.nn.Module,
    config: TrainConfig,
    device: torch.device,
    needs_fused_head: bool,
    *,
    lm_head: bool,
    name_or_path: str | None = None,
) -> None:
    """``lm_head``: whether the model has an LM head (a reward model's body is patched all the same).
    A model type outside fastalign's table trains with ``use_liger_kernel: false`` only: its own layers, and
    the fused head where the objective needs it, found by the head's structure and proven equal on the
    model's weights (``generic``), which are filled first for it (``name_or_path``: the model's, default
    the policy's)."""
    supported = _in_table(model)
    if config.use_liger_kernel and not supported:
        raise ConfigError(
            f"config key 'use_liger_kernel': model_type {model.config.model_type!r} is not one fastalign's "
            "kernels are patched into (docs/patching.md lists them); set use_liger_kernel: false to train it "
            "with its own layers and fastalign's fused loss head"
        )
    if config.use_liger_kernel:
        tiles = dict(tiled_mlp=config.tiled_mlp, tiled_mlp_budget_mib=config.tiled_mlp_budget_mib)
        fastalign.patch_model(model, loss=lm_head, **tiles)
        if config.tiled_mlp and not fastalign.patching.patched_pieces(model).get("mlp"):
            raise ConfigError(  # tiling is the fused gated MLP's: accepted and ignored would be a bug
                f"config key 'tiled_mlp': {model.config.model_type}'s MLP is not one fastalign patches "
                "(a gated MLP), so there is nothing to tile"
            )
    elif needs_fused_head:  # the model's own layers; the objective's loss is computed in the fused head
        if not supported:
            _fill(model, name_or_path or config.model_name_or_path, config, device)
        patch_fused_head(model)
        if lm_head and "loss" not in fastalign.patching.patched_pieces(model):
            pieces = dict(rms_norm=False, rope=False, mlp=False)
            why = fastalign.patching.generic.generic_report(model, **pieces).summary()
            raise ConfigError(
                f"config key 'model_name_or_path': {model.config.model_type!r}'s LM head is not one that "
                f"fastalign's fused loss head reproduces ({why}), and the objective computes its loss there"
            )


def _in_table(model: torch.nn.Module) -> bool:
    return model.config.model_type in fastalign.patching.SUPPORTED_MODEL_TYPES


def patch_fused_head(model: torch.nn.Module) -> None:
    """The fused loss head alone (``use_liger_kernel: false``), the model's layers its own; for a model
    type outside the table, found by its structure and proven equal (``generic``: its weights loaded)."""
    generic = not _in_table(model)
    fastalign.patch_model(model, rms_norm=False, rope=False, mlp=False, linear=False, generic=generic)


@contextlib.contextmanager
def peft_without_deprecation_warning() -> Iterator[None]:
    """peft's wrapping of a model (``get_peft_model``, ``PeftModel.from_pretrained``) without the
    FutureWarning it causes on every LoRA run: it reads transformers' deprecated alias
    ``is_gradient_checkpointing`` (for ``is_activation_checkpointing``), peft's to change, nothing a user
    can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def _trains_tied_embedding(model, config: TrainConfig) -> bool:
    """Whether the model ties its head to its input embedding and LoRA trains one of them (a module to
    save, or a target): peft's ``ensure_weight_tying`` is asked for then only, as peft warns that it has
    nothing to tie otherwise."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    targets = [] if config.lora_target_modules == ["all-linear"] else config.lora_target_modules
    trained = [*(config.lora_modules_to_save or ()), *targets]  # all-linear leaves the head out
    return any(name.split(".")[-1] in EMBEDDING_LAYER_NAMES for name in trained)


#: peft's task type of each model task.
_PEFT_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def _add_lora(model, config: TrainConfig, task: ModelTask):
    """peft's LoRA as TRL's ModelConfig builds it: ``lora_r``, ``lora_alpha`` (scaled by 1/√r with
    ``use_rslora``), ``lora_dropout``, ``lora_target_modules``, DoRA with ``use_dora``, and
    ``lora_modules_to_save`` wrapped as trainable copies. A reward model gets peft's task type SEQ_CLS
    (TRL's ``lora_task_type`` for reward modelling), which adds its new ``score`` head to the modules
    to save: the head trains in full beside the adapters, and is saved with them. peft skips a
    modules_to_save name that matches nothing; here that is an error. A model that ties its head to its
    input embedding keeps them tied (peft's ``ensure_weight_tying``) when one of them trains in full:
    untied, the copy saved with the adapter would be tied back over when the merged model loads."""
    import peft

    targets = config.lora_target_modules
    lora = peft.LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        use_rslora=config.use_rslora,
        use_dora=config.use_dora,
        modules_to_save=list(config.lora_modules_to_save or []) or None,  # peft extends it for SEQ_CLS
        ensure_weight_tying=_trains_tied_embedding(model, config),
        task_type=_PEFT_TASK_TYPES[task],
    )
    try:
        with peft_without_deprecation_warning():
            model = peft.get_peft_model(model, lora)
    except ValueError as error:  # e.g. target modules not found: name the config key
        raise ConfigError(f"config key 'lora_target_modules' ({', '.join(targets)}): {error}") from None
    wrapper = peft.utils.ModulesToSaveWrapper
    wrapped = [name for name, module in model.named_modules() if isinstance(module, wrapper)]
    for name in config.lora_modules_to_save or ():
        if not any(path == name or path.endswith(f".{name}") for path in wrapped):
            raise ConfigError(
                f"config key 'lora_modules_to_save': {name!r} names no module of "
                f"{type(model.get_base_model()).__name__}"
            )
    return model
