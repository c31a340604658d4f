"""PreferenceLoss and KTOLoss against the papers' / TRL's formulas in float64, from hidden states."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastalign.losses import KTOLoss, PreferenceLoss
from fastalign.losses import preference as preference_module
from fastalign.ops.linear_sequence_objective import linear_sequence_objective as sweep
from fastalign.ops.preference import DPO_LOSS_TYPES, SMOOTHED_DPO_LOSS_TYPES
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, relative_error

P, T, D, V = 3, 6, 9, 23
BETA, SMOOTHING, TAU = 0.3, 0.1, 0.05


def make_batch(dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(2 * P, T, D, generator=gen) * scale).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) / D**0.5).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, V, (2 * P, T), generator=gen).to(DEVICE)
    lengths = torch.tensor([6, 2, 4, 5, 1, 3])  # padded completions of different lengths
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DEVICE)
    ref_hidden = hidden.detach() + 0.3 * torch.randn(hidden.shape, generator=gen).to(DEVICE, dtype)
    return hidden, weight, targets, mask, ref_hidden


def seq_logps64(hidden, weight, targets, mask):
    """float64 Σ log p over each sequence's masked tokens, and the token log-probs."""
    log_p = (hidden.double() @ weight.double().T).log_softmax(-1)
    tokens = log_p.gather(-1, targets[..., None]).squeeze(-1) * mask
    return tokens.sum(-1), tokens, mask.sum(-1).double()


def reference_loss(
    loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, nll, beta=BETA
):
    """TRL 1.16's DPO loss for one loss type (float64), written from its formulas (label smoothing only
    where TRL uses it; ipo and sigmoid_norm on per-token log-ratios; bco_pair without a reward shift)."""
    ls = SMOOTHING
    c, r = chosen - ref_chosen, rejected - ref_rejected
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    z = beta * logits
    if loss_type == "sigmoid":
        return -F.logsigmoid(z).mean()
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (c / chosen_len - r / rejected_len)).mean()
    if loss_type == "robust":
        return ((-F.logsigmoid(z) * (1 - ls) + F.logsigmoid(-z) * ls) / (1 - 2 * ls)).mean()
    if loss_type == "exo_pair":
        return (
            z.sigmoid() * (F.logsigmoid(z) - math.log(1 - ls))
            + (-z).sigmoid() * (F.logsigmoid(-z) - math.log(ls))
        ).mean()
    if loss_type == "hinge":
        return torch.relu(1 - z).mean()
    if loss_type == "ipo":
        return ((c / chosen_len - r / rejected_len - 1 / (2 * beta)) ** 2).mean()
    if loss_type == "bco_pair":
        return (-F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)).mean()
    if loss_type == "sppo_hard":
        return ((c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2).mean()
    if loss_type == "nca_pair":
        return (
            -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
        ).mean()
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            d = torch.sort(chosen - rejected)[0] - torch.sort(ref_chosen - ref_rejected)[0]
        else:
            d = torch.sort(c)[0] - torch.sort(r)[0]
        return (-F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls).mean()
    if loss_type == "apo_zero":
        return ((1 - torch.sigmoid(beta * c)) + torch.sigmoid(beta * r)).mean()
    if loss_type == "apo_down":
        return (torch.sigmoid(beta * c) + (1 - torch.sigmoid(beta * (c - r)))).mean()
    if loss_type == "discopop":
        modulation = torch.sigmoid(z / TAU)
        return (-F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation).mean()
    if loss_type == "sft":
        return nll
    raise AssertionError(loss_type)


def run_dpo(backend, dtype, loss_type, loss_weights=None, reference="hidden", seed=0, scale=1.0):
    hidden, weight, targets, mask, ref_hidden = make_batch(dtype, seed, scale)
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    loss_fn = PreferenceLoss(
        loss_type=loss_type,
        loss_weights=loss_weights,
        beta=BETA,
        label_smoothing=SMOOTHING if set(types) & set(SMOOTHED_DPO_LOSS_TYPES) else 0.0,
        discopop_tau=TAU,
        reference_free=reference == "free",
        backend=backend,
    )
    ref_seq, _, _ = seq_logps64(ref_hidden, weight.detach(), targets, mask)
    kwargs = {}
    if reference == "hidden":
        kwargs = dict(ref_hidden=ref_hidden, ref_weight=weight.detach())
    elif reference == "logps":
        kwargs = dict(ref_chosen_logps=ref_seq[:P].float(), ref_rejected_logps=ref_seq[P:].float())
    out = loss_fn(hidden, weight, targets, mask, **kwargs)
    out.loss.backward()

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    seq, tokens, lengths = seq_logps64(h64, w64, targets, mask)
    if reference == "free":
        ref_seq = torch.zeros_like(ref_seq)
    nll = -tokens[:P].sum() / lengths[:P].sum()
    weights = loss_weights or [1.0] * len(types)
    expected = sum(
        w * reference_loss(t, seq[:P], seq[P:], ref_seq[:P], ref_seq[P:], lengths[:P], lengths[P:], nll)
        for t, w in zip(types, weights, strict=True)
    )
    expected.backward()
    rewards = (BETA * (seq[:P] - ref_seq[:P]).detach(), BETA * (seq[P:] - ref_seq[P:]).detach())
    return out, expected, (hidden, weight), (h64, w64), rewards, seq.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_loss_types_match_float64(backend, loss_type, dtype):
    out, expected, (hidden, weight), (h64, w64), rewards, seq = run_dpo(backend, dtype, loss_type)
    assert_close_to_reference("loss", out.loss.detach(), expected.detach(), dtype)
    assert_close_to_reference("grad hidden", hidden.grad, h64.grad, dtype)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, dtype)
    if dtype == torch.bfloat16:
        return
    metrics = out.metrics
    torch.testing.assert_close(metrics["rewards/chosen"].double(), rewards[0].mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["rewards/rejected"].double(), rewards[1].mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        metrics["rewards/margins"].double(), (rewards[0] - rewards[1]).mean(), rtol=1e-5, atol=1e-6
    )
    assert metrics["rewards/accuracies"].item() == (rewards[0] > rewards[1]).double().mean().item()
    torch.testing.assert_close(metrics["logps/chosen"].double(), seq[:P].mean(), rtol=1e-5, atol=1e-6)
    assert ("nll_loss" in metrics) == (loss_type == "sft")


@pytest.mark.parametrize("reference", ["logps", "free"])
def test_reference_from_logps_or_none(backend, reference):
    out, expected, (hidden, _), (h64, _), _, _ = run_dpo(
        backend, torch.float32, "sigmoid", reference=reference
    )
    assert_close_to_reference("loss", out.loss.detach(), expected.detach(), torch.float32)
    assert_close_to_reference("grad hidden", hidden.grad, h64.grad, torch.float32)


def test_weighted_mix_of_loss_types(backend):
    mix, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    out, expected, (_, weight), (_, w64), _, _ = run_dpo(backend, torch.float32, mix, weights)
    assert_close_to_reference("loss", out.loss.detach(), expected.detach(), torch.float32)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, torch.float32)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "discopop", "nca_pair", "apo_down"])
def test_extreme_margins_stay_finite(backend, loss_type):
    out, expected, (hidden, weight), _, _, _ = run_dpo(backend, torch.float32, loss_type, scale=300.0)
    assert (
        torch.isfinite(out.loss) and torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    )
    if torch.isfinite(expected):
        # The margin is a difference of large, nearly equal log-prob sums: the fp32 matmul's rounding
        # (cuBLAS on CUDA sums in another order than the CPU) is amplified, so 1e-4 instead of 1e-5.
        assert relative_error(out.loss.detach(), expected.detach()) <= 1e-4


def test_equal_chosen_and_rejected(backend):
    hidden, weight, targets, mask, _ = make_batch(torch.float32)
    hidden = torch.cat([hidden[:P], hidden[:P]]).detach().requires_grad_()
    targets, mask = torch.cat([targets[:P], targets[:P]]), torch.cat([mask[:P], mask[:P]])
    out = PreferenceLoss(beta=BETA, reference_free=True, backend=backend)(hidden, weight, targets, mask)
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(math.log(2.0), device=DEVICE))
    assert out.metrics["rewards/margins"] == 0 and torch.isfinite(hidden.grad).all()


def _reference_free_inputs(hidden, weight, targets, mask):
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    seq, tokens, lengths = seq_logps64(h64, w64, targets, mask)
    nll = -tokens[:P].sum() / lengths[:P].sum()
    return h64, w64, seq, lengths, nll


@pytest.mark.parametrize(
    "variant",
    ["simpo", "cpo-sigmoid", "cpo-hinge", "cpo-ipo", "orpo", "simpo+0.3", "cpo-sigmoid+0.02", "cpo-ipo+-0.4"],
)
def test_reference_free_objectives(backend, variant):
    """Each formula as TRL 1.16 writes it, in float64; ``+α``: AlphaPO's rewards (1 − p^−α)/α, which
    TRL's CPO trainer computes as ``exp(logp).pow(-α)`` (exact in float64 here; in float32 it underflows
    for summed log-probs below about −103, where fastalign's exp(−α·logp) does not)."""
    hidden, weight, targets, mask, _ = make_batch(torch.float32, seed=2)
    variant, _, shape = variant.partition("+")
    objective, _, loss_type = variant.partition("-")
    gamma, alpha, shape = 0.4, 0.7, float(shape or 0)
    loss_fn = PreferenceLoss(
        objective=objective,
        loss_type=loss_type or "sigmoid",
        beta=BETA,
        label_smoothing=SMOOTHING if variant in ("simpo", "cpo-sigmoid") else 0.0,
        gamma=gamma,
        cpo_alpha=alpha,
        alpha=shape,
        backend=backend,
    )
    out = loss_fn(hidden, weight, targets, mask)
    out.loss.backward()
    h64, w64, seq, lengths, nll = _reference_free_inputs(hidden, weight, targets, mask)
    means = seq / lengths
    if shape:  # AlphaPO, as TRL's CPO trainer writes it: both the sums and the means it compares
        seq, means = ((1 - torch.exp(x).pow(-shape)) / shape for x in (seq, means))
    mean_c, mean_r = means[:P], means[P:]
    if objective == "simpo":
        logits = (mean_c - mean_r) - gamma / BETA
        expected = (
            -F.logsigmoid(BETA * logits) * (1 - SMOOTHING) - F.logsigmoid(-BETA * logits) * SMOOTHING
        ).mean() + alpha * nll  # TRL's SimPO is CPO's loss type: the chosen NLL included
    elif objective == "cpo":
        if loss_type == "ipo":
            expected = ((mean_c - mean_r - 1 / (2 * BETA)) ** 2).mean()
        elif loss_type == "hinge":
            expected = torch.relu(1 - BETA * (seq[:P] - seq[P:])).mean()
        else:
            z = BETA * (seq[:P] - seq[P:])
            expected = (-F.logsigmoid(z) * (1 - SMOOTHING) - F.logsigmoid(-z) * SMOOTHING).mean()
        expected = expected + alpha * nll
    else:
        log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
        expected = nll - (BETA * F.logsigmoid(log_odds)).mean()
        torch.testing.assert_close(
            out.metrics["log_odds_chosen"].double(), log_odds.mean().detach(), rtol=1e-5, atol=1e-6
        )
    expected.backward()
    assert_close_to_reference("loss", out.loss.detach(), expected.detach(), torch.float32)
    assert_close_to_reference("grad hidden", hidden.grad, h64.grad, torch.float32)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, torch.float32)
    torch.testing.assert_close(out.metrics["nll_loss"].double(), nll.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "chunk_size", [None, 2, 1], ids=["completions-per-chunk", "completion-per-chunk", "per-token-logprobs"]
)
def test_kto_matches_formula(backend, chunk_size, monkeypatch):
    """The gradient formed in the forward per chunk of whole completions (several, or one; odd lengths),
    and per-token log-probs when a completion spans more than 4 chunks (chunk_size 1), all equal the
    formula in float64."""
    hidden, weight, targets, mask, _ = make_batch(torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    labels = torch.tensor([True, False, True, True, False, False], device=DEVICE)
    ref_logps = (torch.randn(2 * P, generator=gen) - 8).to(DEVICE)
    kl_logps, ref_kl = (
        (torch.randn(5, generator=gen) - 8).to(DEVICE),
        (torch.randn(5, generator=gen) - 8.5).to(DEVICE),
    )
    loss_fn = KTOLoss(
        beta=BETA, desirable_weight=1.3, undesirable_weight=0.7, chunk_size=chunk_size, backend=backend
    )
    swept = []
    monkeypatch.setattr(
        preference_module, "linear_sequence_objective", lambda *a, **k: swept.append(1) or sweep(*a, **k)
    )
    out = loss_fn(
        hidden, weight, targets, labels, mask, ref_logps=ref_logps, kl_logps=kl_logps, ref_kl_logps=ref_kl
    )
    out.loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    seq, _, lengths = seq_logps64(h64, w64, targets, mask)
    log_p = (h64 @ w64.T).log_softmax(-1)
    entropy = (-(log_p.exp() * log_p).sum(-1) * mask).sum() / lengths.sum()
    kl = (kl_logps - ref_kl).double().mean().clamp(min=0)
    ratio = seq - ref_logps.double()
    chosen = 1 - torch.sigmoid(BETA * (ratio[labels] - kl))
    rejected = 1 - torch.sigmoid(BETA * (kl - ratio[~labels]))
    expected = torch.cat([1.3 * chosen, 0.7 * rejected]).mean()
    expected.backward()
    assert_close_to_reference("loss", out.loss.detach(), expected.detach(), torch.float32)
    assert_close_to_reference("grad hidden", hidden.grad, h64.grad, torch.float32)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, torch.float32)
    assert swept == ([] if chunk_size == 1 else [1])  # 6 tokens: over 4 chunks of 1, within 4 of 2
    torch.testing.assert_close(out.metrics["kl"].double(), kl)
    torch.testing.assert_close(out.metrics["entropy"].double(), entropy.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        out.metrics["logps/rejected"].double(), seq[~labels].mean().detach(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        out.metrics["rewards/chosen"].double(), (BETA * ratio[labels]).mean().detach(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_under_autocast_the_head_runs_in_its_dtype(backend, objective):
    """Under bf16 autocast over fp32 hidden states and weight (the trainer's single-process bf16), the
    loss and gradients are those of the same call on bf16 casts, as ``F.linear`` would run the head."""
    hidden, weight, targets, mask, _ = make_batch(torch.float32, seed=5)
    labels = torch.tensor([True, False, True, True, False, False], device=DEVICE)
    zeros = torch.zeros(P, device=DEVICE)

    def run(cast: bool):
        h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
        inputs = (h.bfloat16(), w.bfloat16()) if cast else (h, w)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=not cast):
            if objective == "dpo":
                out = PreferenceLoss(backend=backend)(
                    *inputs, targets, mask, ref_chosen_logps=zeros, ref_rejected_logps=zeros
                )
            else:
                out = KTOLoss(backend=backend)(
                    *inputs,
                    targets,
                    labels,
                    mask,
                    ref_logps=torch.zeros(2 * P, device=DEVICE),
                    kl_logps=zeros,
                    ref_kl_logps=zeros,
                )
        out.loss.backward()
        return out.loss, h.grad, w.grad

    for got, expected in zip(run(cast=False), run(cast=True), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_bad_input():
    hidden, weight, targets, mask, ref_hidden = make_batch(torch.float32)
    with pytest.raises(ValueError, match=r"valid: .*sigmoid"):
        PreferenceLoss(loss_type="dpo")
    with pytest.raises(ValueError, match="beta must be > 0"):
        PreferenceLoss(beta=0.0)
    with pytest.raises(ValueError, match="loss_weights"):
        PreferenceLoss(loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="objective"):
        PreferenceLoss(objective="ppo")
    loss_fn = PreferenceLoss()
    with pytest.raises(ValueError, match="must be even"):
        loss_fn(hidden[:-1], weight, targets[:-1], mask[:-1], ref_hidden=ref_hidden[:-1], ref_weight=weight)
    with pytest.raises(ValueError, match="ref_chosen_logps must have shape"):
        loss_fn(
            hidden,
            weight,
            targets,
            mask,
            ref_chosen_logps=torch.zeros(P + 1),
            ref_rejected_logps=torch.zeros(P),
        )
    with pytest.raises(ValueError, match="reference is missing"):
        loss_fn(hidden, weight, targets, mask)
    mask = mask.clone()
    mask[4] = False
    with pytest.raises(ValueError, match="sequence 4 of the batch has no loss tokens"):
        loss_fn(hidden, weight, targets, mask, ref_hidden=ref_hidden, ref_weight=weight)
