"""``linear_sparse_divergence`` against TRL 1.16's server-distillation loss (the oracle: its
``_add_tail_bucket``, ``_jsd_divergence``, forward-KL path ``_compute_server_forward_kl_loss`` and top-1
path ``_compute_server_sparse_top_1_divergence_loss``, on the full [tokens, vocab] log-softmax), loss and
gradients, stored teacher log-probs of −inf included (masked as TRL masks them); with k = V it equals
full-logit distillation (``linear_divergence``); the teacher's scoring pass ``linear_topk_logprobs``
against ``torch.topk`` of the full log-softmax; its tail draws against a
float64 inverse CDF and a chi-square test, and the loss on them (``tail_sample_support``) against the
dense KL to the estimate and, averaged over draws, full-logit distillation's gradient."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fastalign.ops import linear_divergence
from fastalign.ops.sparse_divergence import (
    linear_sparse_divergence,
    linear_topk_logprobs,
    tail_sample_support,
)
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


def student_log_probs(hidden, weight, bias, temperature, softcap=None):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    if softcap is not None:  # Gemma-2's final-logit softcap
        logits = softcap * torch.tanh(logits / softcap)
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


@pytest.mark.parametrize("add_tail", [True, False])
def test_a_final_logit_softcap_equals_trls_server_path_on_the_capped_logits(add_tail):
    """The student's logits capped (s·tanh(x/s), here 1.0 where they spread over a few units) before the
    temperature, as a Gemma-2 student's model computes them for TRL: loss and gradients."""
    trl = server_trainer()
    k, temperature, cap = 8, 0.8, 1.0
    hidden, weight, bias, teacher_logits, valid, _ = make(k)
    teacher = torch.log_softmax(teacher_logits / temperature, -1).topk(k, dim=-1)
    fake = SimpleNamespace(
        loss_add_tail=add_tail, _reduce_divergence_loss=trl.ServerDistillationTrainer._reduce_divergence_loss
    )
    labels = torch.where(valid, 1, -100)[None]
    stored = {"topk_logprobs": teacher.values[None], "topk_token_ids": teacher.indices[None]}
    student = student_log_probs(hidden, weight, bias, temperature, cap)
    theirs = trl.ServerDistillationTrainer._compute_server_forward_kl_loss(
        fake, stored, student[None], labels
    )
    ours = linear_sparse_divergence(
        hidden, weight, teacher.indices, teacher.values, valid=valid, temperature=temperature,
        add_tail=add_tail, bias=bias, reduction="mean", workspace_bytes=8 * V * 8, softcap=cap,
    )  # fmt: skip
    uncapped = student_log_probs(hidden, weight, bias, temperature)
    assert (uncapped - student).abs().max() > 0.1  # the cap changes the distribution
    assert_equals_trls(ours, theirs, k, add_tail, leaves(hidden, weight, bias))
    with torch.no_grad():  # the teacher's scoring pass caps as well
        top = linear_topk_logprobs(
            hidden, weight, k, bias=bias, temperature=temperature, vocab_slice=16, softcap=cap
        )
    torch.testing.assert_close(top.logprobs, student.detach().topk(k, dim=-1).values)


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


def teacher_with_neginf(cause: str, k: int, temperature: float, seed: int = 4):
    """A teacher's top-k [N, k] (values, indices) with −inf log-probs in some rows: ``masked``, row i
    has 1 + i % 12 finite logits (fewer than k in most rows: a −inf bias, a masked vocabulary; the
    other top-k entries are −inf at arbitrary ids); ``fp16``, some top-k log-probs are below −65,504
    and a float16 store overflows them to −inf."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 2
    if cause == "masked":
        finite = 1 + torch.arange(N)[:, None] % 12
        logits = logits.masked_fill(torch.arange(V)[None] >= finite, float("-inf"))
    else:
        # every third row: 3 logits near the top, 5 so far below that their log-probs overflow float16
        logits[::3, 3:] = float("-inf")
        logits[::3, 40:45] = logits[::3, :3].amax(-1, keepdim=True) - 7e4 * temperature
    top = torch.log_softmax(logits / temperature, -1).topk(k, dim=-1)
    values = top.values.half().float() if cause == "fp16" else top.values
    assert torch.isneginf(values).any() and not values.isnan().any()
    assert cause == "masked" or torch.isfinite(top.values).all()
    return values, top.indices


@pytest.mark.parametrize("cause", ["masked", "fp16"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
@pytest.mark.parametrize("add_tail", [True, False])
def test_neginf_teacher_logprobs_are_off_the_support_as_trls(cause, beta, add_tail):
    """Stored teacher log-probs of −inf (fewer than k finite logits, or an fp16 overflow) are masked
    as TRL's forward-KL path masks them (``valid = teacher_topk_logprobs > -inf`` before the tail bucket
    or the renormalisation): β 0 ``_compute_server_forward_kl_loss`` itself, β 0.3 its composition with
    that ``valid`` and ``_jsd_divergence``; loss and gradients equal, none NaN."""
    trl = server_trainer()
    k, temperature = 8, 0.9
    hidden, weight, bias, _, valid, _ = make(30)
    t, ids = teacher_with_neginf(cause, k, temperature)
    student = student_log_probs(hidden, weight, bias, temperature)
    if beta == 0:
        fake = SimpleNamespace(
            loss_add_tail=add_tail,
            _reduce_divergence_loss=trl.ServerDistillationTrainer._reduce_divergence_loss,
        )
        theirs = trl.ServerDistillationTrainer._compute_server_forward_kl_loss(
            fake,
            {"topk_logprobs": t[None], "topk_token_ids": ids[None]},
            student[None],
            torch.where(valid, 1, -100)[None],
        )
    else:
        support = t > float("-inf")
        s = torch.where(support, student.gather(1, ids), float("-inf"))
        tt = torch.where(support, t, float("-inf"))
        if add_tail:
            s, mask = trl._add_tail_bucket(s, support)
            tt, _ = trl._add_tail_bucket(tt, support)
        else:
            mask = support
            s, tt = s - s.logsumexp(-1, keepdim=True), tt - tt.logsumexp(-1, keepdim=True)
        theirs = trl._jsd_divergence(s, tt, beta, mask).sum(-1)[valid].sum() / valid.sum()
    ours = linear_sparse_divergence(
        hidden,
        weight,
        ids,
        t,
        valid=valid,
        beta=beta,
        temperature=temperature,
        add_tail=add_tail,
        bias=bias,
        reduction="mean",
        workspace_bytes=8 * V * 4,
    )
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    assert math.isfinite(float(theirs.detach())) and float(theirs.detach()) > 0
    tensors = leaves(hidden, weight, bias)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(theirs, tensors), strict=True):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("beta", [0.5, 1.0])
@pytest.mark.parametrize("add_tail", [True, False])
def test_a_neginf_support_entry_is_as_if_masked(beta, add_tail):
    """TRL's top-1 path refuses a completion token whose teacher log-prob is −inf (β > 0; ``train
    distill`` refuses such a row the same way); the op itself takes the entry off the support: loss and
    gradients those of the support mask that leaves it out, finite (not the +inf of p_s·(log p_s + inf))."""
    hidden, weight, bias, teacher_logits, valid, tokens = make(31)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top1 = teacher_lp.argmax(-1)
    tokens = torch.where(tokens == top1, (tokens + 1) % V, tokens)
    actual = teacher_lp.gather(1, tokens[:, None]).squeeze(1)
    actual[1::2] = float("-inf")
    if beta == 1:
        ids, lp, mask = tokens[:, None], actual[:, None], torch.ones(N, 1, dtype=torch.bool)
    else:
        ids, lp = torch.stack([top1, tokens], -1), torch.stack([teacher_lp.amax(-1), actual], -1)
        mask = torch.ones(N, 2, dtype=torch.bool)
    options = dict(valid=valid, beta=beta, add_tail=add_tail, bias=bias)
    ours = linear_sparse_divergence(hidden, weight, ids, lp, mask, **options)
    masked = linear_sparse_divergence(hidden, weight, ids, lp, mask & (lp > float("-inf")), **options)
    assert math.isfinite(float(ours.detach()))
    assert float(ours.detach()) == pytest.approx(float(masked.detach()), rel=1e-6)
    tensors = leaves(hidden, weight, bias)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(masked, tensors), strict=True):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, ref)


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


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_under_autocast_the_head_runs_as_on_inputs_in_the_autocast_dtype(beta):
    """A bf16 run over fp32 weights (autocast): the op casts the head's inputs as ``F.linear`` would, and
    the loss and gradients are those of the op on bf16 inputs (the fp32 logits of a bf16 product), not a
    bf16 chunk written into fp32 buffers."""
    hidden, weight, bias, teacher_logits, valid, _ = make(2)
    valid[-3:] = False  # padding rows at the end, as a batch has them
    teacher = torch.log_softmax(teacher_logits, -1).topk(6, dim=-1)
    options = dict(valid=valid, beta=beta, bias=bias, temperature=0.9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_sparse_divergence(hidden, weight, teacher.indices, teacher.values, **options)
    cast = [t.to(torch.bfloat16) for t in (hidden, weight, bias)]
    expected = linear_sparse_divergence(
        cast[0], cast[1], teacher.indices, teacher.values, **(options | {"bias": cast[2]})
    )
    assert ours.dtype == torch.float32 and float(ours) > 0
    torch.testing.assert_close(ours, expected)
    tensors = leaves(hidden, weight, bias)
    for mine, ref in zip(grads_of(ours, tensors), grads_of(expected, tensors), strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, ref.float())


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


def tail_reference(hidden, weight, bias, temperature, top_ids):
    """The float64 tail distribution of each row (its top-k ids left out, renormalised) and its
    cumulative sum in vocabulary order, [N, V] each."""
    logits = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    probs = torch.softmax(logits / temperature, dim=-1).scatter(1, top_ids, 0.0)
    tail = probs / probs.sum(-1, keepdim=True)
    return tail, tail.cumsum(-1)


@pytest.mark.parametrize(
    ("k", "vocab_slice", "bias", "temperature"),
    [(5, 16, True, 0.7), (1, 7, False, 1.3), (40, 1000, True, 1.0)],
)
def test_tail_draws_are_the_inverse_cdf_of_the_tail(k, vocab_slice, bias, temperature):
    """Draw i of a row is the first tail id (vocabulary order, top-k left out) whose cumulative tail
    probability exceeds uniforms[:, i], as a float64 dense reference finds it: the same id wherever the
    uniform is not within float32 rounding of an interval's edge, and an id whose interval holds it
    (within that rounding) everywhere; never a top-k id nor one of zero probability. The top-k, tail and
    token log-probs are M = 0's, bit for bit (23 rows in chunks of 5, slices of 7 ids with a short last
    one)."""
    hidden, weight, b, _, _, tokens = make(20 + k, bias=bias)
    hidden, weight, b = hidden.detach()[:23], weight.detach(), None if b is None else b.detach()
    m = 13
    uniforms = torch.rand(23, m, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    workspace = 5 * min(V, vocab_slice) * 8  # 5 rows a chunk
    options = dict(bias=b, temperature=temperature, vocab_slice=vocab_slice, workspace_bytes=workspace)
    plain = linear_topk_logprobs(hidden, weight, k, tokens[:23], **options)
    out = linear_topk_logprobs(hidden, weight, k, tokens[:23], **options, tail_samples=m, uniforms=uniforms)
    assert plain.sample_ids.shape == (23, 0) and out.sample_ids.shape == (23, m)
    for name in ("ids", "logprobs", "tail", "token_logprobs"):
        torch.testing.assert_close(getattr(out, name), getattr(plain, name), rtol=0, atol=0)
    tail, cumulative = tail_reference(hidden, weight, b, temperature, out.ids)
    expected = torch.searchsorted(cumulative, uniforms, right=True).clamp(max=V - 1)
    tol = 1e-5
    after = cumulative.gather(1, out.sample_ids)
    before = after - tail.gather(1, out.sample_ids)
    assert ((before - tol <= uniforms) & (uniforms < after + tol)).all()
    after_ref = cumulative.gather(1, expected)
    near_edge = ((uniforms - after_ref).abs() < tol) | (
        (uniforms - after_ref + tail.gather(1, expected)).abs() < tol
    )
    assert ((out.sample_ids == expected) | near_edge).all() and near_edge.float().mean() < 0.01
    assert (tail.gather(1, out.sample_ids) > 0).all()
    assert not (out.sample_ids[:, :, None] == out.ids[:, None, :]).any()


def test_tail_draws_follow_the_tail_distribution():
    """Chi-square goodness of fit: 20,000 draws of each of 3 rows against the row's tail probabilities
    (cells expected fewer than 5 draws pooled), below the 1e-4 critical value (Wilson–Hilferty)."""
    hidden, weight, bias, _, _, _ = make(5)
    hidden, weight, bias = hidden.detach()[:3], weight.detach(), bias.detach()
    m = 20000
    uniforms = torch.rand(3, m, generator=torch.Generator().manual_seed(0))
    out = linear_topk_logprobs(
        hidden, weight, 8, bias=bias, temperature=1.5, vocab_slice=16, tail_samples=m, uniforms=uniforms
    )
    tail, _ = tail_reference(hidden, weight, bias, 1.5, out.ids)
    for row in range(3):
        observed = torch.bincount(out.sample_ids[row], minlength=V).double()
        expected = tail[row] * m
        big = expected >= 5
        o = torch.cat([observed[big], observed[~big].sum()[None]])
        e = torch.cat([expected[big], expected[~big].sum()[None]])
        chi2 = float(((o - e) ** 2 / e.clamp_min(1e-12)).sum())
        df = int(big.sum())  # cells − 1, the pooled cell included
        z = 3.72  # the normal quantile of 1 − 1e-4
        critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        assert chi2 < critical, (row, chi2, critical, df)


@pytest.mark.parametrize("k", [3, 5])
def test_a_row_with_an_empty_tail_draws_id_0_and_the_support_masks_it(k):
    """Where the top-k hold all the mass (every other logit −inf: a −inf bias), the tail is −inf, its
    draws are id 0 and ``tail_sample_support`` masks them; the other rows' draws are kept once each,
    with log(r·c/M). With fewer finite logits (3) than k (5), the scoring pass stores the 3 first, then
    k − 3 log-probs of −inf (at ids of −inf logits), the tail −inf and a masked token's log-prob −inf,
    no NaN; the loss on that top-5 (with the draws, the tail bucket alone, or neither) is, loss and
    gradients, the top-3's: the −inf entries are off the support."""
    hidden, weight, _, _, _, tokens = make(2, bias=False)
    hidden, weight, tokens = hidden.detach()[:4], weight.detach(), tokens[:4]
    bias = torch.full((V,), float("-inf"))
    bias[10:13] = 0.0
    uniforms = torch.rand(4, 6, generator=torch.Generator().manual_seed(1))
    tokens[0] = 11  # the others' tokens have a −inf logit
    empty = linear_topk_logprobs(
        hidden, weight, k, tokens, bias=bias, vocab_slice=16, tail_samples=6, uniforms=uniforms
    )
    assert not any(t.isnan().any() for t in (empty.logprobs, empty.tail, empty.token_logprobs))
    assert torch.isneginf(empty.tail).all() and (empty.sample_ids == 0).all()
    assert (empty.ids[:, :3].sort().values == torch.tensor([10, 11, 12])).all()
    assert torch.isfinite(empty.logprobs[:, :3]).all() and torch.isneginf(empty.logprobs[:, 3:]).all()
    assert torch.isfinite(empty.token_logprobs[0]) and torch.isneginf(empty.token_logprobs[1:]).all()
    _, _, mask = tail_sample_support(empty.ids, empty.logprobs, empty.tail, empty.sample_ids)
    assert mask[:, :k].all() and not mask[:, k:].any()
    student = torch.randn(4, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    for draws, add_tail in ((True, True), (False, True), (False, False)):
        losses = []
        for top in (k, 3):
            ids, lp = empty.ids[:, :top], empty.logprobs[:, :top]
            support = tail_sample_support(ids, lp, empty.tail, empty.sample_ids) if draws else (ids, lp, None)
            loss = linear_sparse_divergence(student, weight, *support, beta=0.0, add_tail=add_tail)
            losses.append((loss, *grads_of(loss, [student])))
        (loss, grad), (loss3, grad3) = losses
        assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
        torch.testing.assert_close(loss, loss3)
        torch.testing.assert_close(grad, grad3)
    draws = torch.tensor([[5, 7, 5, 9, 5, 7]])
    ids, logprobs, mask = tail_sample_support(
        torch.tensor([[1, 2]]), torch.tensor([[-0.5, -1.5]]), torch.tensor([-2.0]), draws
    )
    assert ids.tolist() == [[1, 2, 5, 7, 5, 9, 5, 7]]
    assert mask.tolist() == [[True, True, True, True, False, True, False, False]]
    torch.testing.assert_close(logprobs[0, 2:][mask[0, 2:]], -2.0 + torch.log(torch.tensor([3, 2, 1]) / 6))


def teacher_with_draws(seed: int, rows: int, m: int, k: int, temperature: float, replicas: int = 1):
    """A teacher head (hidden [rows, 8], weight [V, 8]) and its top-k with m tail draws of each of
    ``replicas`` copies of its rows (each copy its own uniforms)."""
    g = torch.Generator().manual_seed(seed)
    t_hidden, t_weight = torch.randn(rows, 8, generator=g), torch.randn(V, 8, generator=g) * 0.6
    uniforms = torch.rand(rows * replicas, m, generator=g)
    top = linear_topk_logprobs(
        t_hidden.repeat(replicas, 1), t_weight, k, temperature=temperature, tail_samples=m, uniforms=uniforms
    )
    return t_hidden, t_weight, top


def test_loss_with_tail_draws_is_the_dense_kl_to_the_estimate():
    """For one draw, the loss on [top-k | draws] with log(r·c/M) and the tail bucket (~0) equals, loss
    and gradients, the float64 dense KL(T̂ ‖ S): T̂ the teacher's top-k probabilities, r·c/M at the
    drawn ids, 0 elsewhere; S the student's whole softmax at the temperature."""
    hidden, weight, bias, _, valid, _ = make(11)
    temperature, m, k = 0.9, 6, 5
    _, _, top = teacher_with_draws(3, N, m, k, temperature)
    ids, logprobs, mask = tail_sample_support(top.ids, top.logprobs, top.tail, top.sample_ids)
    ours = linear_sparse_divergence(
        hidden,
        weight,
        ids,
        logprobs,
        mask,
        valid,
        beta=0.0,
        temperature=temperature,
        bias=bias,
        workspace_bytes=5 * V * 4,
    )
    estimate = torch.zeros(N, V, dtype=torch.float64).scatter(1, top.ids, top.logprobs.double().exp())
    estimate.scatter_add_(1, top.sample_ids, (top.tail.double().exp() / m)[:, None].expand(N, m).contiguous())
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    student = torch.log_softmax((h64 @ w64.t() + b64) / temperature, -1)
    kl = torch.where(estimate > 0, estimate * (estimate.clamp_min(1e-300).log() - student), 0.0).sum(-1)
    dense = kl[valid].sum()
    assert float(ours.detach()) == pytest.approx(float(dense.detach()), rel=1e-5)
    for mine, ref in zip(
        grads_of(ours, leaves(hidden, weight, bias)), grads_of(dense, [h64, w64, b64]), strict=True
    ):
        torch.testing.assert_close(mine.double(), ref, rtol=1e-4, atol=1e-6)


def test_tail_draws_estimate_full_logit_distillations_gradient():
    """Averaged over 400 independent draws, the gradient of the loss on [top-k | draws] w.r.t. the
    student's hidden states is full-logit forward KL's (``linear_divergence``, β 0): every element within
    5 standard errors (the draws' own spread over √400), their mean square near 1 (counting a repeated
    draw more than once, unmerged, fails both); the tail bucket's gradient (TRL's, no draws) is many
    standard errors off."""
    replicas, rows, m, k, temperature = 400, 4, 8, 4, 1.2
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(rows, D, generator=g), torch.randn(V, D, generator=g) * 0.5
    t_hidden, t_weight, top = teacher_with_draws(6, rows, m, k, temperature, replicas)
    ids, logprobs, mask = tail_sample_support(top.ids, top.logprobs, top.tail, top.sample_ids)
    copies = hidden.repeat(replicas, 1).requires_grad_()
    loss = linear_sparse_divergence(copies, weight, ids, logprobs, mask, beta=0.0, temperature=temperature)
    (per_draw,) = torch.autograd.grad(loss, copies)
    per_draw = per_draw.reshape(replicas, rows, D).double()
    leaf = hidden.clone().requires_grad_()
    full = linear_divergence(
        leaf,
        weight,
        t_hidden,
        t_weight,
        torch.ones(rows, dtype=torch.long),
        beta=0.0,
        temperature=temperature,
        reduction="sum",
    )
    (exact,) = torch.autograd.grad(full, leaf)
    error = per_draw.mean(0) - exact.double()
    standard_error = (per_draw.var(0) / replicas + 1e-12).sqrt()
    z = error / standard_error
    assert z.abs().max() < 5 and 0.5 < float((z**2).mean()) < 2  # ~N(0, 1) where unbiased
    bucket = linear_sparse_divergence(
        leaf, weight, top.ids[:rows], top.logprobs[:rows], beta=0.0, temperature=temperature
    )
    (bucket_grad,) = torch.autograd.grad(bucket, leaf)
    assert ((bucket_grad.double() - exact.double()).abs() / standard_error).max() > 20
