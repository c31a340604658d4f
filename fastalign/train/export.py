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
        state.pop(_tied_head_key(model), None)  # tied in, tied out: one copy, as save_pretrained writes
    if not ctx.is_main:
        return
    unpatch_model(model)  # a saved model is a plain transformers model
    model.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)


def _tied_head_key(model: torch.nn.Module) -> str | None:
    """The state-dict key of the LM head's weight when it is tied to the input embedding (a gathered
    full state dict holds it under both names), else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or head.weight is not base.get_input_embeddings().weight:
        return None
    prefix = "base_model.model." if base is not model else ""
    return prefix + next(name for name, module in base.named_modules() if module is head) + ".weight"


def merge_adapter(
    run_dir: str | Path, output_dir: str | Path | None = None, dtype: torch.dtype | None = None
) -> Path:
    """The run's LoRA adapter in ``run_dir`` merged into its base weights, saved in ``output_dir``
    (default ``<run_dir>/merged``) for ``from_pretrained``, in ``dtype`` (default: the base
    checkpoint's own dtype, fp32 for a built-in model).

    The base is rebuilt as the run trained it (read from ``fastalign_config.yaml``): with QLoRA, the
    4-bit weights, dequantized — the weights the adapter was trained against. The sum is formed in fp32
    and rounded once, to ``dtype``: a typical LoRA update (~1e-4) is below bf16's rounding step for
    weights of magnitude ~0.05, so adding it to bf16 weights in bf16 would lose most of what training
    learned (on SmolLM2-135M a bf16 merge scored worse than the untrained model)."""
    import peft

    from fastalign.quant import dequantize_model
    from fastalign.train.config import load_config
    from fastalign.train.loading import load_model_and_tokenizer
    from fastalign.train.policy import quant_options

    run_dir = Path(run_dir)
    if not (run_dir / "adapter_config.json").is_file():
        raise ValueError(f"{run_dir} holds no LoRA adapter (adapter_config.json): nothing to merge")
    config = load_config(run_dir / "fastalign_config.yaml")
    base, tokenizer = load_model_and_tokenizer(
        config.model_name_or_path, quant_options(config), revision=config.model_revision
    )
    dtype = dtype or checkpoint_dtype(base.config)
    model = peft.PeftModel.from_pretrained(base, run_dir)
    dequantize_model(model, torch.float32).to(torch.float32)
    merged = model.merge_and_unload().to(dtype)
    merged.config.use_cache = True
    output_dir = Path(output_dir) if output_dir is not None else run_dir / "merged"
    merged.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config declares for its weights (``dtype``, or ``torch_dtype`` as older
    configs name it); fp32 where it declares none."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32
