"""The training configuration: one flat set of options named as in TRL / transformers'
``TrainingArguments``, so YAML keys and ``--name value`` flags carry over from those tools."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml


@dataclass
class TrainConfig:
    """Every option of ``fastalign train``; a config names only what differs from these defaults."""

    # model and data
    model_name_or_path: str = "tiny-llama"  # a local directory (config + tokenizer) or a built-in tiny name
    dataset_name: str = "tiny-sft"  # a local JSONL/JSON/Parquet file or directory, or a built-in name
    eval_dataset_name: str | None = None
    eval_split_ratio: float = 0.0  # held-out fraction of dataset_name when no eval_dataset_name
    output_dir: str = "outputs/run"
    max_length: int = 512
    truncation: bool = False  # without it, an over-long example is an error naming its row
    packing: bool = False
    completion_only_loss: bool | None = None  # None: on for prompt-completion data
    assistant_only_loss: bool = False

    # schedule
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "cosine"  # constant, linear, cosine (each after warmup)
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # > 0 overrides warmup_ratio
    seed: int = 42

    # precision and memory
    bf16: bool = False
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    use_liger_kernel: bool = True  # patch_model the model (named as in transformers' TrainingArguments)

    # LoRA
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    # logging, evaluation, checkpoints
    logging_steps: int = 10
    eval_steps: int = 0  # 0: no evaluation during training
    save_steps: int = 0  # 0: only the final model
    save_total_limit: int = 2
    resume_from_checkpoint: str | None = None  # a checkpoint directory, or "latest" in output_dir
    report_to: list[str] = field(default_factory=list)  # "tensorboard", "wandb"
    loss_curve_png: bool = True  # write <output_dir>/loss_curve.png at the end (needs matplotlib)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """The resolved config as YAML, written atomically (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(asdict(config), sort_keys=False))
    os.replace(tmp, path)
