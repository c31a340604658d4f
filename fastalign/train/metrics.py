"""Throughput figures of a training run: model FLOPs per token, the device's peak, peak memory."""

from __future__ import annotations

import resource

import torch

#: Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def training_flops_per_token(model: torch.nn.Module, sequence_length: int) -> float:
    """6·P for the matmul weights P a token goes through (embedding lookups excluded, the LM head
    included; of a mixture-of-experts layer's fused [experts, …] weights, its ``num_experts_per_tok``
    experts) plus the attention scores and values, 12·L·d·S, forward and backward — the usual MFU
    convention."""
    config = model.config
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    output = model.get_output_embeddings()
    if output is not None:
        embeddings.discard(id(output.weight))  # tied: the head's matmul does count
    matrices = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    top_k = getattr(config, "num_experts_per_tok", None)
    weights = sum(p.numel() * (top_k / p.shape[0] if p.dim() == 3 and top_k else 1) for p in matrices)
    attention = 12 * config.num_hidden_layers * config.hidden_size * sequence_length
    return 6.0 * weights + attention


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak, when it is a known GPU (None: MFU is not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by PyTorch, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
