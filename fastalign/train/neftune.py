"""NEFTune (Jain et al. 2023, https://huggingface.co/papers/2310.05914): uniform noise on the input
embeddings while training, transformers' ``neftune_noise_alpha``.

The noise is drawn as transformers' ``neftune_post_forward_hook`` draws it (the same random numbers for
the same generator state): for embeddings of shape [B, L, H], uniform in ±alpha / sqrt(L * H), where L
is the row length as batched (padding, or a packed row's every example, included). It is added by a
forward hook on the input embedding layer and only while that layer is in training mode: evaluation
and generation (both run the model in eval mode) see the embeddings as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def neftune_noise(output: torch.Tensor, alpha: float) -> torch.Tensor:
    """``output`` (embeddings [B, L, H]) plus uniform noise in ±alpha / sqrt(L * H)."""
    # sqrt of an integer tensor, in float32: the bound transformers computes, bit for bit
    bound = alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2)))
    return output + torch.zeros_like(output).uniform_(-float(bound), float(bound))


def enable_neftune(model: nn.Module, alpha: float | None) -> RemovableHandle | None:
    """Noise on ``model``'s input embeddings in training mode (a PEFT model's base embeddings: peft
    forwards ``get_input_embeddings``); None does nothing. The handle removes the hook."""
    if alpha is None:
        return None
    embeddings = model.get_input_embeddings()

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return neftune_noise(output, alpha) if module.training else output

    return embeddings.register_forward_hook(hook)
