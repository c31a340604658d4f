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
down from 4,096 rows under the earlier 1 GiB: at 16,384 tokens, 16 chunks instead of 4. Each GEMM of
M ≈ 1,000 still runs near peak on an H100, but a trained head pays the fp32 weight gradient's
read-modify-write (8·V·D bytes) once per chunk: the chunk sweep of benchmarks/RESULTS.md (H100, bf16,
16,384 × 4,096 × 128,256, 2026-11-22) measured 96.2 ms fwd+bwd at 1,024 rows against 82.7 ms at 4,096,
with the same 2,004 MiB peak (the fp32 accumulator's; the logits chunk lies below it). So the budget
saves memory where no such accumulator exists (a frozen head: LoRA, QLoRA, a reference model) and costs
~15% time where one does. The 256 MiB default itself is not yet measured on a GPU. On CPU (32 MiB) the
chunks of an fp32 head keep their earlier size (SmolLM2-135M measured 13% slower at 16 MiB).
"""

from __future__ import annotations

import os

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


def head_workspace_bytes(device_type: str, workspace_bytes: int | None = None) -> int:
    """The budget in bytes: ``workspace_bytes``, else ``set_head_workspace``'s, else the environment
    variable's, else the default of ``device_type``."""
    if workspace_bytes is not None:
        return _positive_bytes("workspace_bytes", workspace_bytes)
    if _budget_override is not None:
        return _budget_override
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            mib = float(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a number of MiB, got {env!r}") from None
        return _positive_bytes(ENV_VAR, mib * MiB)
    return DEFAULT_HEAD_WORKSPACE_BYTES.get(device_type, DEFAULT_HEAD_WORKSPACE_BYTES["cpu"])


def chunk_rows(vocab: int, bytes_per_logit: int, budget: int) -> int:
    """Tokens per chunk: the most rows whose ``vocab`` elements at ``bytes_per_logit`` bytes each fit
    ``budget``, a multiple of 16 (tensor-core tiles) when there are 16 or more, and at least 1 (a
    vocabulary too large for the budget runs one row at a time, over it)."""
    rows = budget // (vocab * bytes_per_logit)
    return max(1, rows - rows % 16 if rows >= 16 else rows)
