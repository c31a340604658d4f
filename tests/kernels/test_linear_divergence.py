"""fastalign.ops.linear_divergence, both backends, against TRL's generalized JSD on float64 logits.

The Triton backend runs under the interpreter on CPU (see conftest.py) and on CUDA where present.
Sizes are odd on purpose (N, V, Ds, Dt not multiples of any tile, Ds ≠ Dt) and chunks are small so that
every call walks several chunks and a ragged last one.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

from fastalign.ops import linear_divergence
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, relative_error, require

BATCH, SEQ, STUDENT_DIM, TEACHER_DIM, VOCAB = 2, 9, 13, 19, 101
CHUNK = 8
IGNORE = -100


@functools.cache
def trl_generalized_jsd_loss():
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (a staticmethod on full logits)."""
    require("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "importing from trl.experimental"
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss


def make_inputs(dtype, *, ignore_every=4, teacher_dtype=None):
    """Student (grad) and teacher (no grad) heads with biases, labels with every 4th token ignored."""
    teacher_dtype = teacher_dtype or dtype

    def head(dim, dt, grad):
        hidden = torch.randn(BATCH, SEQ, dim, device=DEVICE).to(dt)
        weight = (torch.randn(VOCAB, dim, device=DEVICE) * 2 / dim**0.5).to(dt)
        bias = (torch.randn(VOCAB, device=DEVICE) * 0.1).to(dt)
        return [t.requires_grad_(grad) for t in (hidden, weight, bias)]

    student = head(STUDENT_DIM, dtype, True)
    teacher = head(TEACHER_DIM, teacher_dtype, False)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device=DEVICE)
    if ignore_every:
        labels.view(-1)[::ignore_every] = IGNORE
    return student, teacher, labels


def call(student, teacher, labels, **kwargs):
    return linear_divergence(
        student[0],
        student[1],
        teacher[0],
        teacher[1],
        labels,
        student_bias=student[2],
        teacher_bias=teacher[2],
        **{"chunk_size": CHUNK} | kwargs,
    )


def reference(
    student,
    teacher,
    labels,
    *,
    beta=0.5,
    temperature=1.0,
    hard_label_weight=0.0,
    reduction="mean",
    student_softcap=None,
    teacher_softcap=None,
):
    """float64: TRL's per-element generalized JSD summed over the vocabulary, the cross-entropy at T=1,
    and the reduction over non-ignored tokens, on the logits capped where a softcap is given (s·tanh(x/s),
    as Gemma-2's model computes them). Returns the loss and the float64 student leaves."""

    def capped(logits, softcap):
        return logits if softcap is None else softcap * torch.tanh(logits / softcap)

    leaves = [t.detach().double().requires_grad_() for t in student]
    student_logits = capped(F.linear(*leaves), student_softcap)
    teacher_logits = capped(F.linear(*(t.detach().double() for t in teacher)), teacher_softcap)
    jsd = trl_generalized_jsd_loss()(
        student_logits, teacher_logits, beta=beta, temperature=temperature, reduction="none"
    ).sum(-1)
    flat_labels = labels.reshape(-1)
    ce = F.cross_entropy(student_logits.flatten(0, 1), flat_labels, reduction="none", ignore_index=IGNORE)
    valid = labels != IGNORE
    token_loss = torch.where(valid, (1 - hard_label_weight) * jsd + hard_label_weight * ce.view_as(jsd), 0.0)
    if reduction == "none":
        return token_loss, leaves
    total = token_loss.sum()
    return (total / max(int(valid.sum()), 1) if reduction == "mean" else total), leaves


def check(out, ref, student, leaves, dtype, upstream=None):
    """Loss and the gradients of the student's hidden states, weight and bias against float64."""
    assert out.dtype == torch.float32
    assert_close_to_reference("loss", out.detach(), ref.detach(), dtype)
    (out * upstream if upstream is not None else out).sum().backward()
    (ref * upstream.double() if upstream is not None else ref).sum().backward()
    for name, tensor, leaf in zip(("hidden", "weight", "bias"), student, leaves, strict=True):
        assert tensor.grad is not None and tensor.grad.dtype == tensor.dtype, name
        assert_close_to_reference(f"grad {name}", tensor.grad, leaf.grad, dtype)


@pytest.mark.parametrize("hard_label_weight", [0.0, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_every_divergence_matches_float64(backend, beta, temperature, hard_label_weight):
    student, teacher, labels = make_inputs(torch.float32)
    options = {"beta": beta, "temperature": temperature, "hard_label_weight": hard_label_weight}
    out = call(student, teacher, labels, backend=backend, **options)
    ref, leaves = reference(student, teacher, labels, **options)
    check(out, ref, student, leaves, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("caps", [(1.5, None), (None, 1.0), (1.5, 2.0)], ids=["student", "teacher", "both"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_final_logit_softcaps_match_float64(backend, reduction, caps, dtype):
    """Gemma-2's softcap on the student's logits, the teacher's, or both (the logits here spread over
    several units, so the caps bend them), with the hard-label term, which takes the capped logits too."""
    student, teacher, labels = make_inputs(dtype)
    options = dict(beta=0.5, temperature=2.0, hard_label_weight=0.3, reduction=reduction)
    caps = dict(zip(("student_softcap", "teacher_softcap"), caps, strict=True))
    out = call(student, teacher, labels, backend=backend, **options, **caps)
    ref, leaves = reference(student, teacher, labels, **options, **caps)
    uncapped, _ = reference(student, teacher, labels, **options)
    assert (uncapped - ref).abs().max() > 0.05  # the caps change the loss
    upstream = torch.rand(out.shape, device=DEVICE) if reduction == "none" else None
    check(out, ref, student, leaves, dtype, upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_dtypes_match_float64(backend, reduction, dtype):
    student, teacher, labels = make_inputs(dtype)
    options = {"beta": 0.3, "temperature": 2.0, "hard_label_weight": 0.5}
    out = call(student, teacher, labels, backend=backend, reduction=reduction, **options)
    ref, leaves = reference(student, teacher, labels, reduction=reduction, **options)
    upstream = torch.rand(labels.shape, device=DEVICE) * 2 - 1 if reduction == "none" else None
    if reduction == "none":
        assert out.shape == labels.shape and (out[labels == IGNORE] == 0).all()
    check(out, ref, student, leaves, dtype, upstream)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_equals_trl_generalized_jsd_loss_on_full_logits(backend, beta):
    """TRL's own call as GKD makes it: [B, S, V] fp32 logits, labels masking with -100, batchmean."""
    student, teacher, labels = make_inputs(torch.float32)
    student_logits = F.linear(*student)
    with torch.no_grad():
        teacher_logits = F.linear(*teacher)
    trl = trl_generalized_jsd_loss()(student_logits, teacher_logits, labels, beta=beta, temperature=2.0)
    trl.backward()
    trl_grads = [t.grad.clone() for t in student]
    for t in student:
        t.grad = None
    ours = call(student, teacher, labels, backend=backend, beta=beta, temperature=2.0)
    ours.backward()
    torch.testing.assert_close(ours, trl.float(), rtol=1e-5, atol=1e-6)
    for name, tensor, expected in zip(("hidden", "weight", "bias"), student, trl_grads, strict=True):
        torch.testing.assert_close(tensor.grad, expected, rtol=1e-4, atol=1e-6, msg=f"grad {name}")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_trl_distillation_trainer_divergence(beta):
    """The per-token divergence of TRL's DistillationTrainer (its chunked function, PyTorch tiles)."""
    require("trl")
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    student, teacher, _ = make_inputs(torch.float32, ignore_every=0)
    flat = [t.detach().flatten(0, -2) if t.dim() == 3 else t.detach() for t in (*student, *teacher)]
    trl, _ = ChunkedDivergenceFunction.apply(*flat, beta, 1.5)
    ours = linear_divergence(
        flat[0], flat[1], flat[3], flat[4], student_bias=flat[2], teacher_bias=flat[5],
        beta=beta, temperature=1.5, reduction="none", backend="torch",
    )  # fmt: skip
    torch.testing.assert_close(ours, trl, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_student_entropy_equals_trl_distillation_trainers(backend, beta, reduction):
    """``return_entropy``: TRL's DistillationTrainer ``entropy`` (its chunked function's second output,
    of the student at the temperature) at counted tokens, 0 at ignored ones; the loss is unchanged."""
    require("trl")
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    student, teacher, labels = make_inputs(torch.float32)
    flat = [t.detach().flatten(0, -2) if t.dim() == 3 else t.detach() for t in (*student, *teacher)]
    _, trl_entropy = ChunkedDivergenceFunction.apply(*flat, beta, 1.5)
    options = {"beta": beta, "temperature": 1.5, "reduction": reduction, "backend": backend}
    loss, entropy = call(student, teacher, labels, return_entropy=True, **options)
    assert entropy.shape == labels.shape and not entropy.requires_grad
    valid = labels != IGNORE
    torch.testing.assert_close(entropy[valid], trl_entropy.view(labels.shape)[valid], rtol=1e-5, atol=1e-6)
    assert (entropy[~valid] == 0).all()
    torch.testing.assert_close(loss, call(student, teacher, labels, **options))


def test_without_labels_every_token_counts(backend):
    student, teacher, labels = make_inputs(torch.float32, ignore_every=0)
    without = call(student, teacher, None, backend=backend)
    with_all = call(student, teacher, labels, backend=backend)
    torch.testing.assert_close(without, with_all)


def test_ignored_tokens_reach_nothing(backend):
    """NaN hidden states at ignored tokens (both models) change neither the loss nor a gradient, and a
    fully ignored batch is a zero loss with zero gradients."""
    student, teacher, labels = make_inputs(torch.float32)
    ignored = labels == IGNORE
    clean = call(student, teacher, labels, backend=backend, hard_label_weight=0.5)
    clean.backward()
    clean_grads = [t.grad.clone() for t in student]
    for t in student:
        t.grad = None
    with torch.no_grad():
        student[0][ignored] = float("nan")
        teacher[0][ignored] = float("inf")
    dirty = call(student, teacher, labels, backend=backend, hard_label_weight=0.5)
    dirty.backward()
    torch.testing.assert_close(dirty, clean)
    for tensor, expected in zip(student, clean_grads, strict=True):
        torch.testing.assert_close(tensor.grad, expected)

    for t in student:
        t.grad = None
    labels.fill_(IGNORE)
    out = call(student, teacher, labels, backend=backend)
    out.backward()
    assert out.item() == 0.0
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in student)


def test_teacher_is_a_constant_and_dtypes_may_differ():
    """No gradient reaches a teacher that requires one; a bf16 teacher with an fp32 student works."""
    student, teacher, labels = make_inputs(torch.float32, teacher_dtype=torch.bfloat16)
    for t in teacher:
        t.requires_grad_()
    out = call(student, teacher, labels, backend="torch", beta=0.0)
    out.backward()
    assert all(t.grad is None for t in teacher)
    ref, _ = reference(student, teacher, labels, beta=0.0)
    assert_close_to_reference("loss", out.detach(), ref.detach(), torch.bfloat16)


def test_default_chunking_and_autocast():
    """The default chunk size runs; under autocast both heads run in the autocast dtype."""
    student, teacher, labels = make_inputs(torch.float32)
    plain = linear_divergence(student[0], student[1], teacher[0], teacher[1], labels, backend="torch")
    bf16 = [t.to(torch.bfloat16) for t in (student[0], student[1], teacher[0], teacher[1])]
    expected = linear_divergence(*bf16, labels, backend="torch")
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        autocast = linear_divergence(student[0], student[1], teacher[0], teacher[1], labels, backend="torch")
    torch.testing.assert_close(autocast, expected)
    autocast.backward()
    assert student[0].grad.dtype == torch.float32 and torch.isfinite(plain)


def _error(**overrides) -> str:
    student, teacher, labels = make_inputs(torch.float32)
    args = {
        "student_hidden": student[0],
        "student_weight": student[1],
        "teacher_hidden": teacher[0],
        "teacher_weight": teacher[1],
        "labels": labels,
    } | overrides
    with pytest.raises(ValueError) as info:
        linear_divergence(**args)
    return str(info.value)


def test_input_errors():
    student, teacher, labels = make_inputs(torch.float32)
    message = _error(teacher_weight=torch.randn(VOCAB + 1, TEACHER_DIM))
    assert f"({VOCAB}, {STUDENT_DIM})" in message and f"({VOCAB + 1}, {TEACHER_DIM})" in message
    assert "needs labels" in _error(labels=None, hard_label_weight=0.5)
    assert "beta must be in [0, 1]" in _error(beta=1.5)
    assert "hard_label_weight must be in [0, 1]" in _error(hard_label_weight=-0.1)
    assert "temperature" in _error(temperature=0.0)
    assert "reduction" in _error(reduction="batchmean")
    assert "teacher_weight dtype" in _error(teacher_weight=teacher[1].double())
    assert "leading (token) dimensions" in _error(teacher_hidden=teacher[0][:, :-1])
    assert "labels shape" in _error(labels=labels[:, :-1])
    bad = labels.clone()
    bad[0, 1] = VOCAB
    assert "outside the vocabulary" in _error(labels=bad, hard_label_weight=0.5)
    assert "empty input" in _error(
        student_hidden=student[0][:, :0], teacher_hidden=teacher[0][:, :0], labels=labels[:, :0]
    )


def test_bf16_logits_are_not_rounded(backend):
    """Between nearly equal heads the divergence (here 1.6e-4) is of the order of bf16's rounding of the
    logits: built in fp32 (as TRL's DistillationTrainer builds them) it is within 1e-3 of float64 (fp32
    cancellation leaves ~6e-5), where bf16 logits put it 2% off."""
    student, _, labels = make_inputs(torch.bfloat16)
    teacher = [(t.detach().float() + 0.01 * torch.randn_like(t.float())).to(torch.bfloat16) for t in student]
    out = call(student, teacher, labels, backend=backend)
    ref, _ = reference(student, teacher, labels)
    assert relative_error(out.detach(), ref.detach()) < 1e-3
