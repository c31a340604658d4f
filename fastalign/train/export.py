"""The final artefact of a run: a model ``from_pretrained`` loads, or a PEFT adapter."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fastalign.patching import unpatch_model
from fastalign.train.distributed import DistributedContext


def export_model(model: torch.nn.Module, tokenizer, output_dir: str | Path, ctx: DistributedContext) -> None:
    """safetensors weights (full model) or the adapter in PEFT format, plus the tokenizer, in
    ``output_dir``. Under FSDP2 every rank takes part in gathering the full state dict (on CPU);
    the main process writes it."""
    output_dir = Path(output_dir)
    is_peft = hasattr(model, "peft_config")
    state = None
    if ctx.enabled:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=is_peft)
        state = get_model_state_dict(model, options=options)
    if not ctx.is_main:
        return
    unpatch_model(model)  # a saved model is a plain transformers model
    model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
