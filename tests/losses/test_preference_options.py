"""DPO's LD-DPO (``ld_alpha``), f-DPO (``f_divergence_type``) and WPO (``use_weighting``) options, the
logged ``entropy``, and KTO's ``apo_zero_unpaired``, against float64 formulas written from TRL 1.16's
definitions, from hidden states on both backends (``tests/parity`` runs TRL itself)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastalign.losses import KTOLoss, PreferenceLoss
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference
from tests.losses.test_preference import BETA, P, make_batch

ALPHA = 0.3  # f_alpha_divergence_coef


def scores64(logratios, kind):
    """f'(t), t = π/π_ref (the f-DPO paper's table)."""
    t = logratios.exp()
    if kind == "reverse_kl":
        return logratios
    if kind == "js_divergence":
        return (2 * t / (1 + t)).log()
    return (t ** (ALPHA - 1) - 1) / (ALPHA - 1)  # alpha_divergence


def expected_dpo(hidden, weight, targets, mask, ref_hidden, loss_type, ld_alpha, kind, weighting):
    """float64: the loss, the entropy metric and logps/chosen."""
    lengths = mask.sum(-1)
    chosen_len, rejected_len = lengths.chunk(2)
    shared = torch.minimum(chosen_len, rejected_len).repeat(2)
    position = torch.arange(mask.shape[1], device=mask.device)[None]
    ld = torch.where(position < shared[:, None], 1.0, ld_alpha if ld_alpha is not None else 1.0) * mask

    def logps(states, head):
        log_p = (states.double() @ head.double().T).log_softmax(-1)
        tokens = log_p.gather(-1, targets[..., None]).squeeze(-1) * mask
        return tokens, log_p

    tokens, log_p = logps(hidden, weight)
    ref_tokens, _ = logps(ref_hidden, weight.detach())  # the reference carries no gradient
    seq, ref_seq = (tokens * ld).sum(-1), (ref_tokens * ld).sum(-1)
    c, r = (scores64(lr, kind) for lr in (seq - ref_seq).chunk(2))
    if loss_type == "ipo":
        losses = (c / chosen_len - r / rejected_len - 1 / (2 * BETA)) ** 2
    else:
        losses = -F.logsigmoid(BETA * (c - r))
    if weighting:
        log_sum_sq = (2 * log_p).logsumexp(-1)
        w = (((tokens - log_sum_sq) * mask).sum(-1) / lengths).exp().detach()
        losses = losses * w[:P] * w[P:]
    entropy = (-(log_p.exp() * log_p).sum(-1) * mask).sum() / lengths.sum()
    return losses.mean(), entropy, seq[:P].mean()


CASES = [
    ("sigmoid", 0.4, "js_divergence", True),
    ("ipo", 0.0, "alpha_divergence", True),
    ("sigmoid", 0.5, "reverse_kl", False),
    ("sigmoid", None, "reverse_kl", True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("loss_type", "ld_alpha", "kind", "weighting"), CASES)
def test_dpo_options_match_float64(backend, dtype, loss_type, ld_alpha, kind, weighting):
    hidden, weight, targets, mask, ref_hidden = make_batch(dtype)
    loss_fn = PreferenceLoss(
        loss_type=loss_type,
        beta=BETA,
        ld_alpha=ld_alpha,
        f_divergence_type=kind,
        f_alpha_divergence_coef=ALPHA if kind == "alpha_divergence" else 0.5,
        use_weighting=weighting,
        backend=backend,
    )
    out = loss_fn(hidden, weight, targets, mask, ref_hidden=ref_hidden, ref_weight=weight.detach())
    out.loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    loss, entropy, chosen = expected_dpo(
        h64, w64, targets, mask, ref_hidden, loss_type, ld_alpha, kind, weighting
    )
    loss.backward()
    assert_close_to_reference("loss", out.loss.detach(), loss.detach(), dtype)
    assert_close_to_reference("grad hidden", hidden.grad, h64.grad, dtype)
    assert_close_to_reference("grad weight", weight.grad, w64.grad, dtype)
    assert_close_to_reference("entropy", out.metrics["entropy"], entropy.detach(), dtype)
    assert_close_to_reference("logps/chosen", out.metrics["logps/chosen"], chosen.detach(), dtype)


def test_ld_alpha_one_is_plain_dpo_and_zero_drops_the_tails(backend):
    hidden, weight, targets, mask, _ = make_batch(torch.float32)
    run = {
        alpha: PreferenceLoss(ld_alpha=alpha, reference_free=True, backend=backend)(
            hidden, weight, targets, mask
        )
        for alpha in (None, 1.0, 0.0)
    }
    assert torch.equal(run[None].loss, run[1.0].loss)
    assert not torch.allclose(run[None].loss, run[0.0].loss)


def test_apo_zero_unpaired_is_kto_without_a_kl_point(backend):
    """1 − σ(β·ratio) for desirable completions, σ(β·ratio) for undesirable ones (no KL term)."""
    hidden, weight, targets, mask, _ = make_batch(torch.float32)
    labels = torch.tensor([True, False, True, True, False, False], device=DEVICE)
    ref = torch.randn(2 * P, generator=torch.Generator().manual_seed(1)).to(DEVICE) - 8
    out = KTOLoss(loss_type="apo_zero_unpaired", beta=BETA, undesirable_weight=1.5, backend=backend)(
        hidden, weight, targets, labels, mask, ref_logps=ref
    )
    log_p = (hidden.detach().double() @ weight.detach().double().T).log_softmax(-1)
    seq = (log_p.gather(-1, targets[..., None]).squeeze(-1) * mask).sum(-1)
    ratio = seq - ref.double()
    losses = torch.where(labels, 1 - torch.sigmoid(BETA * ratio), 1.5 * torch.sigmoid(BETA * ratio))
    assert out.loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    assert out.metrics["kl"].item() == 0
    with pytest.raises(ValueError, match="no KL term"):
        KTOLoss(loss_type="apo_zero_unpaired")(
            hidden, weight, targets, labels, mask, ref_logps=ref, kl_logps=ref
        )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(objective="cpo", ld_alpha=0.5), "ld_alpha"),
        (dict(objective="simpo", use_weighting=True), "use_weighting"),
        (dict(ld_alpha=1.5), "ld_alpha"),
        (dict(ld_alpha=math.nan), "ld_alpha"),
        (dict(f_divergence_type="kl"), "f_divergence_type"),
        (dict(f_divergence_type="forward_kl", loss_type="nca_pair"), "f_divergence_type"),
        (dict(f_divergence_type="forward_kl", loss_type="sft"), "f_divergence_type"),
        (dict(f_alpha_divergence_coef=0.2, f_divergence_type="js_divergence"), "f_alpha_divergence_coef"),
        (dict(use_weighting=True, loss_type="aot_unpaired"), "use_weighting"),
    ],
)
def test_refused_options_name_themselves(options, match):
    with pytest.raises(ValueError, match=match):
        PreferenceLoss(**options)
