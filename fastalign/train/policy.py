"""The model a run trains, and its frozen reference: patched, with LoRA and the activation-memory
savers when asked for, on the device, sharded with FSDP2 under ``torchrun``."""

from __future__ import annotations

import torch

import fastalign
from fastalign.quant import QuantOptions
from fastalign.train import memory
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext, shard_model
from fastalign.train.loading import load_model_and_tokenizer, materialize_model, resolve_model


def prepare_policy(
    model: torch.nn.Module, config: TrainConfig, ctx: DistributedContext, *, needs_fused_head: bool
) -> torch.nn.Module:
    """Patched (every fused kernel with ``use_liger_kernel``; else only the fused loss head when the
    objective's loss needs it, i.e. all but SFT), LoRA, activation checkpointing/offloading, on the
    device, sharded. A 4-bit skeleton (``load_model_and_tokenizer(..., materialize=False)``) is filled
    from its checkpoint last, once sharded, so that each rank only ever holds its shard of it."""
    _patch(model, config, needs_fused_head)
    if config.use_peft:
        model = _add_lora(model, config)
    if config.gradient_checkpointing:
        memory.enable_activation_checkpointing(model)
    if config.activation_offloading:
        memory.enable_activation_offloading(model)
    return _place(model, config.model_name_or_path, config, ctx)


def _place(model: torch.nn.Module, name_or_path: str, config: TrainConfig, ctx: DistributedContext):
    """On the device and sharded; a 4-bit skeleton is filled from its checkpoint only once sharded."""
    skeleton = any(param.is_meta for param in model.parameters())
    if not skeleton:
        model.to(ctx.device)
    model = shard_model(model, mixed_precision=config.bf16)
    if skeleton:
        revision = config.model_revision if name_or_path == config.model_name_or_path else None
        materialize_model(
            model, name_or_path, quant_options(config), ctx.device, config.seed, revision=revision
        )
    return model


def autocast_dtype(config: TrainConfig, ctx: DistributedContext) -> torch.dtype | None:
    """bf16 autocast over fp32 weights in a single process; under FSDP2 the policy casts instead."""
    return torch.bfloat16 if config.bf16 and not ctx.enabled else None


def quant_options(config: TrainConfig) -> QuantOptions | None:
    """The 4-bit quantization the config asks for, if any."""
    if not config.quantization:
        return None
    return QuantOptions(
        quant_type=config.quantization,
        double_quant=config.bnb_4bit_use_double_quant,
        dtype=torch.bfloat16 if config.bf16 else torch.float32,  # the frozen unquantized rest
    )


def load_frozen_model(name_or_path: str, config: TrainConfig, ctx: DistributedContext) -> torch.nn.Module:
    """A reference model: quantized, patched and sharded as the policy, frozen, in eval mode.

    A Hub id is resolved once (at ``model_revision`` when it is the policy's model, else at main), so
    that its skeleton and the weights filled into it come from one snapshot."""
    revision = config.model_revision if name_or_path == config.model_name_or_path else None
    key = "ref_model_name_or_path" if name_or_path == config.ref_model_name_or_path else "model_name_or_path"
    path = str(resolve_model(name_or_path, revision, key=key))
    model, _ = load_model_and_tokenizer(path, quant_options(config), ctx.device, materialize=False)
    _patch(model, config, needs_fused_head=True)
    model.requires_grad_(False).eval()
    return _place(model, path, config, ctx)


def _patch(model: torch.nn.Module, config: TrainConfig, needs_fused_head: bool) -> None:
    if config.use_liger_kernel:
        fastalign.patch_model(model)
    elif needs_fused_head:
        fastalign.patch_model(model, rms_norm=False, rope=False, mlp=False)


def _add_lora(model, config: TrainConfig):
    import peft

    targets = config.lora_target_modules
    lora = peft.LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as error:  # e.g. target modules not found: name the config key
        raise ConfigError(f"config key 'lora_target_modules' ({', '.join(targets)}): {error}") from None
