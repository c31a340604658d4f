"""The workspace budget of the chunked LM heads, and the one rule that turns it into tokens per chunk.

Every head that walks the tokens in chunks of C rows (``linear_cross_entropy``, ``token_logprobs``,
``token_objective``, ``linear_divergence``, ``linear_sequence_objective`` / ``linear_pair_objective``,
``token_log_sum_sq_probs``, and the losses built on them) holds, per chunk, buffers of C·V elements: the
logits chunk, and whatever else its row math keeps next to it (fp32 copies of low-precision logits, the
gradient chunk, the teacher's logits, ...). Each head states those bytes per element of a chunk
(``bytes_per_logit``); ``chunk_rows`` takes as many rows as keep C·V·bytes_per_logit within the budget.
The memory planner (``fastalign.plan.planner``) sizes its loss-head term with the same function.

The budget, in bytes, is the first of: the op's ``workspace_bytes=`` keyword, ``set_head_workspace``,
the environment variable ``FASTALIGN_HEAD_WORKSPACE_MIB`` (MiB, read at each call), or the device's
default: 256 MiB on CUDA, 32 MiB on CPU.

What the budget does not bound: the per-token outputs and statistics (a few fp32 per token), the gradient
of the hidden states ([N, D]), and, when a bf16/fp16 head weight is trained, the fp32 accumulator of its
gradient (4·V·D bytes: 2,004 MiB for Llama-3's 128,256 × 4,096 head), which the chunk size cannot
change.

Cost: 256 MiB is ~1,000 rows per chunk of bf16 logits at V = 128,256 (2 B × 128,256 × 1,000 ≈ 256 MB),
down from 4,096 rows under the earlier 1 GiB. That saves memory where the chunk is the workspace (a
frozen head: LoRA, QLoRA, a reference model). A trained bf16/fp16 head on CUDA holds an fp32 accumulator
of its gradient (4·V·D bytes) anyway and re-reads and re-writes it once per chunk, so small chunks there
cost time and save nothing: its default budget is half that accumulator (``accumulator_budget``: 4,096
rows of Llama-3's head, as measured fastest at no extra peak in the H100 chunk sweep of
benchmarks/RESULTS.md). The 256 MiB default on a frozen head is not yet measured on a GPU. On CPU (32 MiB)
the chunks of an fp32 head keep their earlier size (SmolLM2-135M measured 13% slower at 16 MiB).
"""

from __future__ import annotations

import os

import torch

MiB = 2**20

#: The budget of each device type when nothing else sets one, in bytes.
DEFAULT_HEAD_WORKSPACE_BYTES = {"cpu": 32 * MiB, "cuda": 256 * MiB}
#: The environment variable of the process-wide budget, in MiB.
ENV_VAR = "FASTALIGN_HEAD_WORKSPACE_MIB"

_budget_override: int | None = None


def _positive_bytes(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return int(value)


def set_head_workspace(mib: float | None) -> None:
    """Set the process-wide budget of every chunked head to ``mib`` MiB (None: back to the environment
    variable or the device default). An op's ``workspace_bytes=`` still takes precedence."""
    global _budget_override
    _budget_override = None if mib is None else _positive_bytes("the head workspace", mib * MiB)


def head_workspace_bytes(
    device_type: str, workspace_bytes: int | None = None, weight: torch.Tensor | None = None
) -> int:
    """The budget in bytes: ``workspace_bytes``, else ``set_head_workspace``'s, else the environment
    variable's, else the default of ``device_type`` — raised, for a trained bf16/fp16 head ``weight`` on
    CUDA, to half its fp32 gradient accumulator (``accumulator_budget``)."""
    if workspace_bytes is not None:
        return _positive_bytes("workspace_bytes", workspace_bytes)
    configured = configured_head_workspace_bytes()
    if configured is not None:
        return configured
    default = DEFAULT_HEAD_WORKSPACE_BYTES.get(device_type, DEFAULT_HEAD_WORKSPACE_BYTES["cpu"])
    trained_low_precision = (
        weight is not None and weight.requires_grad and weight.dtype in (torch.bfloat16, torch.float16)
    )
    if device_type == "cuda" and trained_low_precision:
        return max(default, accumulator_budget(weight.numel()))
    return default


def configured_head_workspace_bytes() -> int | None:
    """The process-wide budget the user set, in bytes: ``set_head_workspace``'s, else
    ``FASTALIGN_HEAD_WORKSPACE_MIB``'s; None when neither is set (the device default applies)."""
    if _budget_override is not None:
        return _budget_override
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            mib = float(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a number of MiB, got {env!r}") from None
        return _positive_bytes(ENV_VAR, mib * MiB)
    return None


def accumulator_budget(head_elements: int) -> int:
    """The default budget of a trained low-precision head on CUDA: 2 bytes per head element, half the fp32
    accumulator of its gradient (4·V·D bytes) that it holds anyway. Chunks that size cost no peak memory
    (the H100 chunk sweep of benchmarks/RESULTS.md: 2,004 MiB at every chunk from 256 to 4,096 rows of
    Llama-3's head, 3,007 MiB at 8,192) and keep the speed of large chunks (82.7 ms at 4,096 rows against
    96.2 ms at 1,024): each chunk re-reads and re-writes that accumulator."""
    return 2 * head_elements


def chunk_rows(vocab: int, bytes_per_logit: int, budget: int) -> int:
    """Tokens per chunk: the most rows whose ``vocab`` elements at ``bytes_per_logit`` bytes each fit
    ``budget``, a multiple of 16 (tensor-core tiles) when there are 16 or more, and at least 1 (a
    vocabulary too large for the budget runs one row at a time, over it)."""
    rows = budget // (vocab * bytes_per_logit)
    return max(1, rows - rows % 16 if rows >= 16 else rows)
