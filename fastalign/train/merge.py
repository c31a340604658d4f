"""``fastalign merge``: a LoRA/QLoRA run's adapter added to its base weights, in fp32, saved as a model
``from_pretrained`` loads — never unpickling a file, and refusing an adapter that does not fit its base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fastalign.train.export import move_into_place


def merge_adapter(
    run_dir: str | Path,
    output_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    overwrite_output_dir: bool = False,
) -> Path:
    """The run's LoRA adapter in ``run_dir`` merged into its base weights, saved in ``output_dir``
    (default ``<run_dir>/merged``) for ``from_pretrained``, in ``dtype`` (default: the base
    checkpoint's own dtype, fp32 for a built-in model). An ``output_dir`` holding a model or run that no
    merge wrote is refused unless ``overwrite_output_dir``.

    The base is rebuilt as the run trained it (read from ``fastalign_config.yaml``): in the run's
    ``dtype``; with QLoRA, the 4-bit weights, dequantized — the weights the adapter was trained against;
    a reward model's adapter (peft's SEQ_CLS task) on a sequence-classification base; its tokenizer and
    the configs' special-token ids with the run's ``eos_token``, ``pad_token`` and ``chat_template_path``.
    peft merges what the adapter holds: LoRA's B·A at its scaling (lora_alpha/√r with rslora), DoRA's
    magnitude and direction, and the ``lora_modules_to_save`` copies in place of their modules. The sum
    is formed in fp32 and rounded once, to ``dtype``: a typical LoRA update (~1e-4) is below bf16's
    rounding step for weights of magnitude ~0.05, so adding it to bf16 weights in bf16 would lose most of
    what training learned (on SmolLM2-135M a bf16 merge scored worse than the untrained model).

    Every problem is a one-line ValueError naming the file: a missing run directory, adapter or
    fastalign_config.yaml; an unreadable adapter; pickle weights (``adapter_model.bin``, or a base with
    only ``pytorch_model.bin``), which are never unpickled (unpickling can run code); an adapter that
    does not fit the base (another model's run). The merged model is written next to ``output_dir`` and
    moved into place, so a failed merge leaves ``output_dir`` as it was.

    bitsandbytes is hidden unless the run was QLoRA (``fastalign.quant.bitsandbytes_import``)."""
    from transformers import AutoConfig

    from fastalign.data.tokenizer_options import override_tokenizer
    from fastalign.quant import dequantize_model
    from fastalign.quant.bitsandbytes_import import bitsandbytes_hidden
    from fastalign.train.config import load_config, model_option
    from fastalign.train.loading import (
        cast_parameters,
        checkpoint_dtype,
        load_model_and_tokenizer,
        resolve_model,
    )
    from fastalign.train.policy import model_dtype, peft_without_deprecation_warning, quant_options

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        problem = "is not a directory" if run_dir.exists() else "not found"
        raise ValueError(f"run directory {run_dir} {problem}")
    if not (run_dir / "adapter_config.json").is_file():
        raise ValueError(f"{run_dir} holds no LoRA adapter (adapter_config.json): nothing to merge")
    adapter_config = _merge_read_adapter_config(run_dir / "adapter_config.json")
    weights = run_dir / "adapter_model.safetensors"
    if not weights.is_file():
        if (run_dir / "adapter_model.bin").exists():
            raise ValueError(
                f"{run_dir / 'adapter_model.bin'} is a pickle file: only adapter_model.safetensors is "
                "loaded, never a pickle (unpickling can run code)"
            )
        raise ValueError(f"{weights} not found: the run directory has no adapter weights")
    adapter_shapes = _merge_tensor_shapes(weights)
    config_file = run_dir / "fastalign_config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{config_file} not found: merge rebuilds the run's base model from it")
    config = load_config(config_file)  # a ConfigError names the file and the key
    own = run_dir / "merged"
    output_dir = Path(output_dir) if output_dir is not None else own
    if output_dir.resolve() == run_dir.resolve():
        raise ValueError(f"output directory {output_dir} is the run directory: the merge would overwrite it")
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output directory {output_dir} is a file")
    _check_not_another_model(output_dir, overwrite_output_dir or output_dir.resolve() == own.resolve())

    with bitsandbytes_hidden(config.quantization is None):  # QLoRA: rebuilt with bitsandbytes
        import peft

        try:
            base_files = resolve_model(config.model_name_or_path, config.model_revision)
        except ValueError as error:
            raise ValueError(f"{config_file}: {error}") from None
        declared = adapter_config.get("base_model_name_or_path")  # what peft saw (None for a built-in model)
        if declared and not _merge_same_model(str(declared), config.model_name_or_path, base_files):
            raise ValueError(
                f"{run_dir / 'adapter_config.json'} names base model {declared!r}, but model_name_or_path in "
                f"{config_file} is {config.model_name_or_path!r}: the adapter comes from another run"
            )
        if isinstance(base_files, Path) and not any(
            (base_files / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")
        ):
            pickles = sorted(path.name for path in base_files.glob("*.bin"))
            found = f" (it holds {', '.join(pickles)})" if pickles else ""
            raise ValueError(
                f"base model {base_files} (model_name_or_path in {config_file}) has no safetensors weights"
                f"{found}: only safetensors are loaded, never pickle .bin files (unpickling can run code)"
            )
        # a reward model's adapter (peft's SEQ_CLS task) goes on a sequence-classification base
        task = "sequence_classification" if adapter_config.get("task_type") == "SEQ_CLS" else "causal_lm"
        try:
            base, tokenizer = load_model_and_tokenizer(
                config.model_name_or_path, quant_options(config), revision=config.model_revision, task=task
            )
            # the checkpoint's own dtype, read before loading rewrote it (fp32 weights are loaded)
            declared = checkpoint_dtype(
                AutoConfig.from_pretrained(base_files) if isinstance(base_files, Path) else base.config
            )
            # the tokenizer and special-token ids as the run trained with them (its EOS, PAD, template)
            override_tokenizer(tokenizer, base, config.eos_token, config.pad_token, config.chat_template_path)
        except (OSError, RuntimeError, SafetensorError) as error:
            raise ValueError(
                f"cannot load base model {config.model_name_or_path!r} (model_name_or_path in "
                f"{config_file}): {_merge_first_line(error)}"
            ) from None
        dtype = dtype or declared
        if model_option(config, "dtype") is not None:  # the base weights as the run rounded them
            cast_parameters(base, model_dtype(config, config.model_name_or_path))
        try:
            with peft_without_deprecation_warning():
                model = peft.PeftModel.from_pretrained(base, run_dir)
        except (RuntimeError, ValueError, KeyError, OSError, SafetensorError) as error:
            raise ValueError(
                f"adapter {weights} does not fit base model {config.model_name_or_path!r} "
                f"(model_name_or_path in {config_file}): {_merge_first_line(error)}"
            ) from None
        expected = {key: tuple(value.shape) for key, value in peft.get_peft_model_state_dict(model).items()}
        if expected != adapter_shapes:  # peft loads non-strictly: a missing tensor would stay untrained
            missing = sorted(expected.keys() - adapter_shapes.keys())
            extra = sorted(adapter_shapes.keys() - expected.keys())
            what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the base has no place for"
            raise ValueError(
                f"adapter {weights} does not fit base model {config.model_name_or_path!r} "
                f"(model_name_or_path in {config_file}): it {what}"
                f"{f' ({len(missing) + len(extra) - 1} more)' if len(missing) + len(extra) > 1 else ''}"
            )
        dequantize_model(model, torch.float32).to(torch.float32)
        merged = model.merge_and_unload().to(dtype)
        merged.config.use_cache = True
        _merge_save(merged, tokenizer, output_dir, run_dir)
        return output_dir


def _merge_read_adapter_config(path: Path) -> dict:
    """A readable adapter_config.json (a JSON object), or a one-line ValueError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {_merge_first_line(error)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _merge_same_model(declared: str, name: str, files: Path | str) -> bool:
    """Whether the base an adapter was saved with (peft's ``base_model_name_or_path``: the path training
    loaded) is the model a run's config names (as given, or the local files it resolves to)."""
    if declared in (name, str(files)):
        return True
    return isinstance(files, Path) and Path(declared).exists() and Path(declared).resolve() == files.resolve()


def _merge_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a safetensors file (its header only), or a one-line ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (OSError, SafetensorError) as error:
        raise ValueError(f"cannot read safetensors file {path}: {_merge_first_line(error)}") from None


def _merge_first_line(error: BaseException) -> str:
    """The telling line of a library error: a size mismatch of ``load_state_dict``, else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines if line.startswith("size mismatch")), lines[0])


#: What a merge writes beside the model: the run it merged (a later merge may replace what it wrote).
MARKER = "fastalign_merge.json"


def _check_not_another_model(output_dir: Path, allowed: bool) -> None:
    """A ValueError, before any merge work, where ``output_dir`` holds a LoRA adapter (another run:
    merging there would mix it with a full model, whatever ``allowed`` says), or a model or training run
    that no merge wrote (its ``config.json`` or ``fastalign_config.yaml`` without ``MARKER``), which the
    merge would replace."""
    if (output_dir / "adapter_config.json").exists():
        raise ValueError(
            f"output directory {output_dir} holds a LoRA adapter (adapter_config.json): merging there would "
            "mix it with a full model; choose another --output_dir"
        )
    if allowed or not output_dir.is_dir() or (output_dir / MARKER).exists():
        return
    names = ("fastalign_config.yaml", "config.json")
    found = next((name for name in names if (output_dir / name).exists()), None)
    if found is not None:
        raise ValueError(
            f"output directory {output_dir} holds another model or run ({found}), which the merge would "
            "replace: choose another --output_dir, or pass --overwrite_output_dir"
        )


def _merge_save(model, tokenizer, output_dir: Path, run_dir: Path) -> None:
    """Save into a temporary sibling directory, then move it into ``output_dir`` as the final export is
    (``move_into_place``: ``config.json`` last, an earlier merge's other weight shards removed, every
    other file kept). A failure is a ValueError and leaves ``output_dir`` loadable as it was."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = output_dir.with_name(f".{output_dir.name}.merge-tmp")
    shutil.rmtree(staging, ignore_errors=True)  # what a killed merge left
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"run_dir": str(run_dir.resolve())}) + "\n")
        move_into_place(staging, output_dir)
    except OSError as error:
        raise ValueError(f"cannot save the merged model to {output_dir}: {error.strerror or error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
