"""``fastalign train sft``: supervised fine-tuning from a ``TrainConfig``, one process or many.

Reads top to bottom: set up processes and seed; load model and tokenizer; patch, LoRA, memory
savers, sharding; tokenize and batch the data; optimizer and schedule; resume; train; export.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import get_scheduler

import fastalign
from fastalign.data import tokenize_sft_dataset
from fastalign.train import memory
from fastalign.train.batches import MicroBatches, evaluation_batches
from fastalign.train.callbacks import (
    JsonlMetrics,
    LossCurve,
    ProgressBar,
    TensorBoardMetrics,
    WandbMetrics,
)
from fastalign.train.checkpoint import resolve_resume_path
from fastalign.train.config import TrainConfig, save_config
from fastalign.train.distributed import init_distributed, shard_model, shutdown_distributed
from fastalign.train.engine import Callback, Engine, Schedule
from fastalign.train.export import export_model
from fastalign.train.loading import load_dataset_rows, load_model_and_tokenizer
from fastalign.train.metrics import peak_flops, training_flops_per_token
from fastalign.train.objectives import SFTObjective


def run_sft(config: TrainConfig, callbacks: list[Callback] | None = None) -> Path:
    """Train, save the final model (or adapter) in ``config.output_dir``, and return that path."""
    ctx = init_distributed()
    try:
        _seed_everything(config.seed)
        model, tokenizer = load_model_and_tokenizer(config.model_name_or_path)
        if config.use_liger_kernel:
            fastalign.patch_model(model)
        if config.use_peft:
            model = _add_lora(model, config)
        if config.gradient_checkpointing:
            memory.enable_activation_checkpointing(model)
        if config.activation_offloading:
            memory.enable_activation_offloading(model)
        model.to(ctx.device)
        model = shard_model(model, mixed_precision=config.bf16)

        train_examples, eval_examples = _tokenized_splits(config, tokenizer)
        batches = MicroBatches(
            train_examples, batch_size=config.per_device_train_batch_size,
            accumulation=config.gradient_accumulation_steps, pad_token_id=tokenizer.pad_token_id,
            seed=config.seed, packing_length=config.max_length if config.packing else None,
            rank=ctx.rank, world_size=ctx.world_size,
        )  # fmt: skip
        max_steps = (
            config.max_steps
            if config.max_steps > 0
            else max(1, int(config.num_train_epochs * batches.steps_per_epoch))
        )
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
            weight_decay=config.weight_decay, fused=ctx.device.type == "cuda",
        )  # fmt: skip
        warmup = config.warmup_steps or round(config.warmup_ratio * max_steps)
        scheduler = get_scheduler(
            config.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps
        )
        output_dir = Path(config.output_dir)
        engine = Engine(
            model, SFTObjective(), optimizer, scheduler, batches,
            Schedule(max_steps, config.max_grad_norm, config.logging_steps, config.eval_steps,
                     config.save_steps, config.save_total_limit),
            ctx, output_dir=output_dir,
            eval_batches=evaluation_batches(
                eval_examples, config.per_device_eval_batch_size, tokenizer.pad_token_id, ctx.rank,
                ctx.world_size,
            ),
            callbacks=_callbacks(config, output_dir) + list(callbacks or []),
            flops_per_token=training_flops_per_token(model, config.max_length),
            peak_flops=peak_flops(ctx.device),
            autocast_dtype=torch.bfloat16 if config.bf16 and not ctx.enabled else None,
        )  # fmt: skip
        if ctx.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, output_dir / "fastalign_config.yaml")
        resume_path = resolve_resume_path(config.resume_from_checkpoint, output_dir)
        if resume_path is not None:
            engine.resume(resume_path)
        engine.train()
        if eval_examples and not (config.eval_steps and engine.state.step % config.eval_steps == 0):
            engine.evaluate()  # a final evaluation, unless the last step just had one
        export_model(model, tokenizer, output_dir, ctx)
        return output_dir
    finally:
        shutdown_distributed()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _add_lora(model, config: TrainConfig):
    import peft

    targets = config.lora_target_modules
    lora = peft.LoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets, task_type="CAUSAL_LM",
    )  # fmt: skip
    return peft.get_peft_model(model, lora)


def _tokenized_splits(config: TrainConfig, tokenizer) -> tuple[list, list]:
    options = dict(
        max_length=config.max_length, truncation=config.truncation,
        completion_only_loss=config.completion_only_loss, assistant_only_loss=config.assistant_only_loss,
    )  # fmt: skip

    def tokenized(name: str) -> list:
        return tokenize_sft_dataset(load_dataset_rows(name), tokenizer, **options)

    examples = tokenized(config.dataset_name)
    if config.eval_dataset_name:
        return examples, tokenized(config.eval_dataset_name)
    if config.eval_split_ratio > 0:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed)).tolist()
        held_out = max(1, round(config.eval_split_ratio * len(examples)))
        return [examples[i] for i in order[held_out:]], [examples[i] for i in order[:held_out]]
    return examples, []


def _callbacks(config: TrainConfig, output_dir: Path) -> list[Callback]:
    callbacks: list[Callback] = [JsonlMetrics(output_dir / "metrics.jsonl"), ProgressBar()]
    if "tensorboard" in config.report_to:
        callbacks.append(TensorBoardMetrics(output_dir / "runs"))
    if "wandb" in config.report_to:
        callbacks.append(WandbMetrics(asdict(config)))
    if config.loss_curve_png:
        callbacks.append(LossCurve(output_dir / "loss_curve.png"))
    return callbacks
