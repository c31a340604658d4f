"""``linear_sparse_divergence`` against TRL 1.16's server-distillation loss (the oracle: its
``_add_tail_bucket``, ``_jsd_divergence``, forward-KL path ``_compute_server_forward_kl_loss`` and top-1
path ``_compute_server_sparse_top_1_divergence_loss``, on the full [tokens, vocab] log-softmax), loss and
gradients; with k = V it equals full-logit distillation (``linear_divergence``); and the teacher's
scoring pass ``linear_topk_logprobs`` against ``torch.topk`` of the full log-softmax."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastalign.ops import linear_divergence
from fastalign.ops.sparse_divergence import linear_sparse_divergence, linear_topk_logprobs
from tests.helpers import require

N, D, V = 24, 16, 96


def server_trainer():
    require("trl")
    from trl.experimental.server_distillation import server_distillation_trainer as module

    return module


def make(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, requires_grad=True)
    weight = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    teacher_logits = torch.randn(N, V, generator=g) * 2
    valid = torch.ones(N, dtype=torch.bool)
    valid[::5] = False  # some tokens are not counted (prompt, padding)
    tokens = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, teacher_logits, valid, tokens


def leaves(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def assert_equals_trls(ours, theirs, k: int, add_tail: bool, tensors) -> None:
    """Loss and gradients of ``tensors`` equal TRL's; the loss is 0 exactly when k is 1 without the tail
    (one renormalised entry: why TRL adds the tail), positive otherwise."""
    trivial = k == 1 and not add_tail
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    assert (float(theirs.detach()) == 0) if trivial else (float(theirs.detach()) > 0)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(theirs, tensors), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)


def student_log_probs(hidden, weight, bias, temperature):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("add_tail", [True, False])
def test_forward_kl_equals_trls_server_path(k, add_tail):
    """β = 0: TRL's ``_compute_server_forward_kl_loss`` (batchmean over the completion tokens)."""
    trl = server_trainer()
    hidden, weight, bias, teacher_logits, valid, _ = make(k)
    temperature = 0.8
    teacher = torch.log_softmax(teacher_logits / temperature, -1).topk(k, dim=-1)
    fake = SimpleNamespace(
        loss_add_tail=add_tail, _reduce_divergence_loss=trl.ServerDistillationTrainer._reduce_divergence_loss
    )
    labels = torch.where(valid, 1, -100)[None]
    theirs = trl.ServerDistillationTrainer._compute_server_forward_kl_loss(
        fake,
        {"topk_logprobs": teacher.values[None], "topk_token_ids": teacher.indices[None]},
        student_log_probs(hidden, weight, bias, temperature)[None],
        labels,
    )
    ours = linear_sparse_divergence(
        hidden,
        weight,
        teacher.indices,
        teacher.values,
        valid=valid,
        beta=0.0,
        temperature=temperature,
        add_tail=add_tail,
        bias=bias,
        reduction="mean",
        workspace_bytes=8 * V * 4,  # chunks of 8 rows: several
    )
    assert_equals_trls(ours, theirs, k, add_tail, leaves(hidden, weight, bias))


@pytest.mark.parametrize("beta", [0.5, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
def test_top1_jsd_equals_trls_server_path(beta, add_tail):
    """β > 0 (TRL: top-1 only): the support is the teacher's top-1 token and the completion's token
    (masked where they are the same), TRL's ``_compute_server_sparse_top_1_divergence_loss``."""
    trl = server_trainer()
    hidden, weight, bias, teacher_logits, valid, tokens = make(3)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top1 = teacher_lp.topk(1, dim=-1)
    tokens[:6] = top1.indices[:6, 0]  # some completion tokens are the teacher's top-1
    actual = teacher_lp.gather(1, tokens[:, None]).squeeze(1)
    cls = trl.ServerDistillationTrainer
    fake = SimpleNamespace(beta=beta, loss_add_tail=add_tail, reverse_kl_top_1_mode="sampled")
    fake._reduce_divergence_loss = cls._reduce_divergence_loss
    fake._get_reverse_kl_top_1_tokens = lambda scores, completion: cls._get_reverse_kl_top_1_tokens(
        fake, scores, completion
    )
    fake._compute_sparse_top_1_divergence_loss = lambda **kw: cls._compute_sparse_top_1_divergence_loss(
        fake, **kw
    )
    labels = torch.where(valid, tokens, -100)[None]
    theirs = cls._compute_server_sparse_top_1_divergence_loss(
        fake,
        {
            "topk_logprobs": top1.values[None],
            "topk_token_ids": top1.indices[None],
            "actual_logprobs": actual[None],
        },
        student_log_probs(hidden, weight, bias, 1.0)[None],
        tokens[None],
        labels,
    )
    if beta == 1:  # TRL's support is the completion's token alone
        ids, lp, mask = tokens[:, None], actual[:, None], None
    else:
        ids = torch.stack([top1.indices[:, 0], tokens], -1)
        lp = torch.stack([top1.values[:, 0], actual], -1)
        mask = torch.stack([torch.ones_like(valid), tokens != top1.indices[:, 0]], -1)
    ours = linear_sparse_divergence(
        hidden, weight, ids, lp, mask, valid, beta=beta, add_tail=add_tail, bias=bias, reduction="mean"
    )
    trivial = beta == 1 and not add_tail  # the support is one token: 0
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    assert (float(theirs.detach()) == 0) if trivial else (float(theirs.detach()) > 0)
    tensors = leaves(hidden, weight, bias)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(theirs, tensors), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("add_tail", [True, False])
def test_jsd_on_top_k_equals_trls_functions(k, add_tail):
    """The generalized JSD (β 0.3) on a top-k support: TRL's ``_add_tail_bucket`` and
    ``_jsd_divergence`` composed as its server path composes them, summed over the counted tokens."""
    trl = server_trainer()
    hidden, weight, bias, teacher_logits, valid, _ = make(10 + k, bias=False)
    beta, temperature = 0.3, 1.5
    teacher = torch.log_softmax(teacher_logits / temperature, -1).topk(k, dim=-1)
    s = student_log_probs(hidden, weight, bias, temperature).gather(1, teacher.indices)
    t = teacher.values
    mask = torch.ones_like(t, dtype=torch.bool)
    if add_tail:
        s, support = trl._add_tail_bucket(s, mask)
        t, _ = trl._add_tail_bucket(t, mask)
    else:
        support = mask
        s, t = s - s.logsumexp(-1, keepdim=True), t - t.logsumexp(-1, keepdim=True)
    theirs = trl._jsd_divergence(s, t, beta, support).sum(-1)[valid].sum()
    ours = linear_sparse_divergence(
        hidden,
        weight,
        teacher.indices,
        teacher.values,
        valid=valid,
        beta=beta,
        temperature=temperature,
        add_tail=add_tail,
    )
    assert_equals_trls(ours, theirs, k, add_tail, leaves(hidden, weight, bias))


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_k_equal_to_the_vocabulary_is_full_logit_distillation(beta):
    """Without the tail, the support of every token id is the whole distribution: the loss and its
    gradients are ``linear_divergence``'s on the teacher's full head."""
    g = torch.Generator().manual_seed(7)
    hidden, weight, bias, _, valid, _ = make(7)
    teacher_hidden, teacher_weight = torch.randn(N, 8, generator=g), torch.randn(V, 8, generator=g)
    teacher = torch.log_softmax(teacher_hidden @ teacher_weight.t(), -1).topk(V, dim=-1)
    labels = torch.where(valid, 1, -100)
    full = linear_divergence(
        hidden, weight, teacher_hidden, teacher_weight, labels, beta=beta, student_bias=bias, reduction="sum"
    )
    ours = linear_sparse_divergence(
        hidden, weight, teacher.indices, teacher.values, valid=valid, beta=beta, add_tail=False, bias=bias
    )
    assert float(ours.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    tensors = leaves(hidden, weight, bias)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(full, tensors), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)


def test_entropy_and_no_gradient_inputs():
    hidden, weight, _, teacher_logits, valid, _ = make(1, bias=False)
    teacher = torch.log_softmax(teacher_logits, -1).topk(4, dim=-1)
    with torch.no_grad():
        loss, entropy = linear_sparse_divergence(
            hidden, weight, teacher.indices, teacher.values, valid=valid, return_entropy=True, temperature=2.0
        )
        lp = student_log_probs(hidden, weight, None, 2.0)
    torch.testing.assert_close(entropy[valid], -(lp.exp() * lp).sum(-1)[valid])
    assert (entropy[~valid] == 0).all() and not loss.requires_grad
    with pytest.raises(ValueError, match="support_ids must be token ids"):
        linear_sparse_divergence(hidden, weight, teacher.indices + V, teacher.values)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_topk_logprobs_equal_the_full_log_softmax(k):
    """Slices of 16 ids (six of them) merged into a running top-k equal ``topk`` of the whole row."""
    hidden, weight, bias, _, _, tokens = make(k)
    with torch.no_grad():
        full = student_log_probs(hidden, weight, bias, 0.7)
    out = linear_topk_logprobs(
        hidden.detach(), weight.detach(), k, tokens, bias=bias.detach(), temperature=0.7, vocab_slice=16
    )
    ref = full.topk(k, dim=-1)
    torch.testing.assert_close(out.logprobs, ref.values)
    torch.testing.assert_close(full.gather(1, out.ids), ref.values)  # ids of ties may differ
    rest = (
        student_log_probs(hidden, weight, bias, 0.7).double().detach().scatter(1, ref.indices, -torch.inf)
    ).logsumexp(-1)
    torch.testing.assert_close(out.tail, rest.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.token_logprobs, full.gather(1, tokens[:, None]).squeeze(1))
