"""What fastalign assumes about a causal LM's structure, in one place: its label convention, how to see
through a peft wrapper, where its decoder layers are and which module runs them, and where its dropout is."""

from __future__ import annotations

from torch import nn

#: The label of a position that is no training target: transformers' (and PyTorch's cross-entropy's)
#: ignore index, which collators write, the model shifts, and the fused losses skip.
IGNORE_INDEX = -100


def base_model(model: nn.Module) -> nn.Module:
    """``model`` itself, or the transformers model under a peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_body(model: nn.Module) -> nn.Module | None:
    """The decoder body of a transformers ``*ForCausalLM`` (or ``*ForSequenceClassification``), which
    returns the last hidden states: ``.model`` in most families, else the attribute its
    ``base_model_prefix`` names (GPT-2's ``transformer``); None where it has none."""
    body = getattr(model, "model", None)
    if isinstance(body, nn.Module):
        return body
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    return body if isinstance(body, nn.Module) and body is not model else None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM: the first ``nn.ModuleList`` named ``layers`` (peft-aware)."""
    return list(_layers(model)[1])


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module whose forward runs the decoder layers (``LlamaModel`` in a ``LlamaForCausalLM``): the
    parent of ``decoder_layers``' list. Its forward encloses every layer's call, and the checkpoint that
    transformers puts around each layer, whichever of the layer's methods that checkpoint wraps."""
    inner, (name, _) = base_model(model), _layers(model)
    return inner.get_submodule(name.rpartition(".")[0])


def _layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    inner = base_model(model)
    for name, module in inner.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, nn.ModuleList):
            return name, module
    raise ValueError(f"found no decoder layers (an nn.ModuleList named 'layers') in {type(inner).__name__}")


def disable_dropout(model: nn.Module) -> None:
    """Every ``nn.Dropout`` of ``model`` (the model's own and LoRA's) set to p = 0, as TRL's
    ``disable_dropout``: a policy compared with a reference, or with itself at sampling time, must not
    differ from it by dropout noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
