"""The head workspace budget (``fastalign.ops.head_workspace``): every chunked head keeps the buffers
of one chunk within it, measured by tracking the [.., V]-shaped tensors it allocates; results and
gradients are those of the float64 reference however small the budget; the budget's precedence
(keyword, setter, environment, default); and the memory planner sizes its chunk by the same rule.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastalign.ops import (
    head_workspace,
    linear_cross_entropy,
    linear_divergence,
    token_logprobs,
    token_objective,
)
from fastalign.ops.head_workspace import chunk_rows, head_workspace_bytes, set_head_workspace
from fastalign.ops.linear_cross_entropy import budget_chunk_rows
from fastalign.ops.linear_cross_entropy_chunks import logit_bytes
from fastalign.ops.linear_cross_entropy_torch import LogitTransform
from fastalign.ops.linear_pair_objective import linear_pair_objective
from fastalign.ops.preference import token_log_sum_sq_probs
from fastalign.ops.sparse_divergence import linear_sparse_divergence, linear_topk_logprobs
from fastalign.plan import plan_memory
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference
from tests.kernels.test_linear_cross_entropy import make_inputs, reference_loss

MiB = 2**20


class _ChunkBytes(TorchDispatchMode):
    """Peak bytes of the live tensors allocated under the mode with ``vocab`` in their shape (a chunk's
    logits, their copies and temporaries), leaving out weight-sized ones (``exclude`` numels: the
    weight gradient's accumulator, a CPU upcast of a weight), which the budget does not cover. A
    storage counts from the op that makes it until its last tensor is freed."""

    def __init__(self, vocab: int, exclude: set[int]):
        super().__init__()
        self.vocab, self.exclude = vocab, exclude
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [live tensors, bytes]
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            key, nbytes = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
            if key in self.storages:
                self.storages[key][0] += 1
            elif (
                key in inputs
                or self.vocab not in tensor.shape
                or tensor.numel() in self.exclude
                or not nbytes
            ):
                continue
            else:
                self.storages[key] = [1, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, key)
        return out


def _inputs(dtype, n, dim, vocab, seed=0):
    torch.manual_seed(seed)
    hidden = torch.randn(n, dim, device=DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, device=DEVICE) / dim**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=DEVICE)
    targets[::5] = -100
    return hidden, weight, targets


def _heads(backend, budget):
    """name → a step (fwd + bwd) of each chunked head on (hidden, weight, targets), ``budget`` bytes."""
    kw = {"backend": backend, "workspace_bytes": budget}

    def distill(h, w, t, beta=0.5, hard=0.0):
        teacher_h, teacher_w = h.detach().flip(0) + 0.1, w.detach() * 0.9
        linear_divergence(h, w, teacher_h, teacher_w, t, beta=beta, hard_label_weight=hard, **kw).backward()

    def entropy(h, w, t):
        logprobs, ent = token_logprobs(h, w, t, return_entropy=True, **kw)
        (logprobs.sum() + ent.sum()).backward()

    def pairs(h, w, t):  # one-token sequences: a pair (2 rows) fits a chunk
        n = h.shape[0] // 2 * 2

        def loss(sequences, sums):
            return (sums.chosen - sums.rejected).sigmoid().sum()

        head = linear_pair_objective(h[:n, None], w, t[:n, None], loss, return_aligned=True, **kw)
        head.loss.backward()

    def per_token_softcap(h, w, t):
        loss = linear_cross_entropy(h, w, t, reduction="none", softcap=5.0, temperature=0.7, **kw)
        loss.sum().backward()

    def stored_teacher(h, w, t, beta=0.5):  # offline distillation: 4 stored teacher log-probs a token
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, w.shape[0], (h.shape[0], 4), generator=generator).to(h.device)
        logprobs = torch.log_softmax(torch.randn(h.shape[0], 4, generator=generator), -1).to(h.device)
        linear_sparse_divergence(h, w, ids, logprobs, beta=beta, workspace_bytes=budget).backward()

    def teacher_topk(h, w, t):  # scoring the teacher: no gradient
        with torch.no_grad():
            linear_topk_logprobs(h, w, 4, vocab_slice=w.shape[0], workspace_bytes=budget)

    def objective(h, w, t):  # GRPO's per-token objective, its gradient formed in the forward pass
        def f(rows, logprobs):
            return logprobs.sum(), torch.ones_like(logprobs), torch.zeros(1, device=logprobs.device)

        token_objective(h, w, t, f, **kw).loss.backward()

    return {
        "cross_entropy": lambda h, w, t: linear_cross_entropy(h, w, t, **kw).backward(),
        "softcap_per_token": per_token_softcap,
        "entropy": entropy,
        "jsd": distill,
        "forward_kl_ce": lambda h, w, t: distill(h, w, t, beta=0.0, hard=0.5),
        "log_sum_sq": lambda h, w, t: token_log_sum_sq_probs(h, w, t, **kw),
        "pairs_wpo": pairs,
        "sparse_forward_kl": lambda h, w, t: stored_teacher(h, w, t, beta=0.0),
        "sparse_jsd": stored_teacher,
        "teacher_topk": teacher_topk,
        "token_objective": objective,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [331, 1000])
def test_every_head_keeps_one_chunk_within_the_budget(backend, dtype, vocab):
    """Guards the budget itself: each head's largest set of live [.., V] buffers ≤ ``workspace_bytes``
    while walking several chunks (budgets of 3 to 15 rows at these vocabularies)."""
    n, dim = 61, 24
    budget = 3 * vocab * 40 + 7
    for name, step in _heads(backend, budget).items():
        hidden, weight, targets = _inputs(dtype, n, dim, vocab)
        with _ChunkBytes(vocab, exclude={vocab * dim}) as tracker:
            step(hidden, weight, targets)
        assert 0 < tracker.peak <= budget, f"{name}: {tracker.peak} bytes live > budget {budget}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_budget_changes_no_result(backend, dtype):
    """Guards the numerics under many chunks: a budget of one row per chunk (odd sizes, ignored tokens,
    a fully ignored sequence) gives the float64 reference's loss and gradients."""
    hidden, weight, bias, targets = make_inputs(dtype, bias=True)
    targets[1] = -100
    loss = linear_cross_entropy(hidden, weight, targets, bias, backend=backend, workspace_bytes=1)
    loss.backward()
    ref, leaves = reference_loss(hidden, weight, bias, targets)
    ref.backward()
    assert_close_to_reference("loss", loss.detach(), ref.detach(), dtype)
    for name, tensor, leaf in zip(("hidden", "weight", "bias"), (hidden, weight, bias), leaves, strict=True):
        assert_close_to_reference(f"grad {name}", tensor.grad, leaf.grad, dtype)


def test_budget_precedence(monkeypatch):
    """Guards the configuration: keyword > ``set_head_workspace`` > environment > device default, and
    bad values are refused with the name of what set them."""
    monkeypatch.delenv(head_workspace.ENV_VAR, raising=False)
    assert head_workspace_bytes("cuda") == 256 * MiB and head_workspace_bytes("cpu") == 32 * MiB
    monkeypatch.setenv(head_workspace.ENV_VAR, "64")
    assert head_workspace_bytes("cuda") == 64 * MiB
    set_head_workspace(8)
    try:
        assert head_workspace_bytes("cuda") == 8 * MiB
        assert head_workspace_bytes("cuda", workspace_bytes=1234) == 1234
    finally:
        set_head_workspace(None)
    assert head_workspace_bytes("cpu") == 64 * MiB
    monkeypatch.setenv(head_workspace.ENV_VAR, "lots")
    with pytest.raises(ValueError, match=head_workspace.ENV_VAR):
        head_workspace_bytes("cpu")
    with pytest.raises(ValueError, match="workspace_bytes"):
        head_workspace_bytes("cpu", workspace_bytes=0)


def test_the_issue_shape_and_the_process_wide_budget(monkeypatch):
    """Guards the default at the issue's shape (bf16, V 128,256: 1,040 rows of 256 MiB) and that the
    environment variable reaches an op's chunks."""
    assert chunk_rows(128256, 2, 256 * MiB) == 1040
    assert chunk_rows(256000, 2, 256 * MiB) == 512
    assert chunk_rows(10**9, 2, 256 * MiB) == 1  # never 0 rows
    hidden, weight, targets = _inputs(torch.float32, 40, 8, 997)
    monkeypatch.setenv(head_workspace.ENV_VAR, str(997 * 4 * 3 / MiB))  # 3 rows of fp32 logits
    with _ChunkBytes(997, exclude={997 * 8}) as tracker:
        linear_cross_entropy(hidden, weight, targets, backend="torch").backward()
    assert 0 < tracker.peak <= 997 * 4 * 3


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("bf16", [True, False])
def test_planner_chunk_is_the_heads(device, bf16, monkeypatch):
    """Guards planner/code agreement: the planner's loss-head term holds the chunk the ops size (bf16
    in place on CUDA's Triton path; the PyTorch path on CPU, with its fp32 copies), under the default
    and a set budget."""
    monkeypatch.delenv(head_workspace.ENV_VAR, raising=False)
    vocab, h, tokens = 128256, 4096, 8192
    dtype = torch.bfloat16 if bf16 else torch.float32
    for budget_mib in (None, 64):
        set_head_workspace(budget_mib)
        try:
            plan = plan_memory("llama-3-8b", method="lora", seq_len=tokens, bf16=bf16, device=device)
            if device == "cpu":
                head = torch.empty(vocab, 1, dtype=dtype)
                identity = LogitTransform(None, 1.0)
                per_logit = logit_bytes(dtype, "torch", identity, False, head.device)
                rows = budget_chunk_rows(head, dtype, "torch", identity, False)
            else:  # Triton: the gradient in place, bf16 operands to CUDA's fp32 sum
                per_logit = dtype.itemsize
                rows = chunk_rows(vocab, per_logit, head_workspace_bytes("cuda"))
        finally:
            set_head_workspace(None)
        a = dtype.itemsize
        assert plan.loss_head == rows * vocab * per_logit + tokens * h * a + 24 * tokens, (device, budget_mib)


def test_a_trained_low_precision_head_on_cuda_chunks_up_to_half_its_accumulator(monkeypatch):
    """Guards the trained-head rule: a bf16 head weight that trains on CUDA holds an fp32 accumulator of
    4·V·D bytes anyway, so its default budget is half that (4,096 rows of Llama-3's head, the fastest
    chunk at no extra peak on the H100); a frozen head, an fp32 one, the CPU, and any budget set by hand
    keep the budget as it is. The planner's full fine-tuning in bf16 on CUDA agrees."""
    monkeypatch.delenv(head_workspace.ENV_VAR, raising=False)
    head = torch.empty(128256, 4096, dtype=torch.bfloat16, device="meta")
    trained = head.clone().requires_grad_()
    assert head_workspace_bytes("cuda", weight=trained) == 2 * 128256 * 4096
    assert chunk_rows(128256, 2, head_workspace_bytes("cuda", weight=trained)) == 4096
    assert head_workspace_bytes("cuda", weight=head) == 256 * MiB  # frozen: LoRA, a reference
    assert head_workspace_bytes("cuda", weight=trained.float()) == 256 * MiB
    assert head_workspace_bytes("cpu", weight=trained) == 32 * MiB
    assert head_workspace_bytes("cuda", workspace_bytes=MiB, weight=trained) == MiB
    full = plan_memory("llama-3-8b", method="full", seq_len=16384, bf16=True, device="cuda")
    lora = plan_memory("llama-3-8b", method="lora", seq_len=16384, bf16=True, device="cuda")
    extra = 4 * 128256 * 4096  # the accumulator the full plan also holds
    assert full.loss_head - lora.loss_head == extra + (4096 - 1040) * 128256 * 2
