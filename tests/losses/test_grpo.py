"""GRPOLoss against TRL's formulas in float64: loss, metrics, gradients of hidden states and head."""

from __future__ import annotations

import pytest
import torch

from fastalign.losses import GRPOLoss
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference

PROMPTS, G, T, D, V = 2, 3, 7, 11, 37
B = PROMPTS * G
MAX_LEN = 9
TEMPERATURE = 0.8


def make_batch(dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) / D**0.5).to(DEVICE, dtype).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    lengths = torch.tensor([7, 3, 5, 0, 6, 1])  # ragged, one fully masked completion
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DEVICE, torch.int64)
    advantages = torch.randn(B, generator=gen).to(DEVICE)
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T / TEMPERATURE
        logp = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = (logp + torch.randn(B, T, generator=gen).to(DEVICE, torch.float64) * 0.3).float()
    ref = (logp + torch.randn(B, T, generator=gen).to(DEVICE, torch.float64) * 0.2).float()
    return hidden, weight, ids, mask, advantages, old, ref


def trl_reference(
    hidden,
    weight,
    ids,
    mask,
    advantages,
    old,
    ref,
    *,
    loss_type,
    level,
    beta,
    epsilon,
    epsilon_high,
    delta=None,
    num_items_in_batch=None,
    use_bias_correction_kl=True,
    top_entropy_quantile=1.0,
):
    """TRL GRPOTrainer._compute_loss, written out in float64 from hidden states (its entropy mask's
    quantile over the fp32 entropies, as TRL's ``get_high_entropy_mask``)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    log_probs = (h @ w.T / TEMPERATURE).log_softmax(-1)
    per_token_logps = log_probs.gather(-1, ids[..., None]).squeeze(-1)
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    mask = mask.double()
    old = per_token_logps.detach() if old is None else old.double()
    log_ratio = per_token_logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    adv = advantages.double().unsqueeze(1)
    ratio = coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if top_entropy_quantile < 1.0:
        values = entropies.detach()[mask.bool()].float()
        threshold = torch.quantile(values, 1 - top_entropy_quantile) if values.numel() else float("inf")
        per_token_loss = per_token_loss * ((entropies.detach().float() >= threshold) & mask.bool())
    if beta != 0.0:
        ref = ref.double()
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_LEN)
    else:
        normalizer = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = (per_token_loss * mask).sum() / normalizer
    count = mask.sum().clamp(min=1.0)

    def masked_batch_mean(x):
        return x.mean() if x.shape[1] == 1 else (x * mask).sum() / count

    metrics = {"entropy": masked_batch_mean(entropies.detach())}
    if beta != 0.0:
        metrics["kl"] = masked_batch_mean(per_token_kl.detach())
    if loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_batch_mean(((coef_1 > epsilon_high) & (adv > 0)).double())
    else:
        low = (coef_1 < 1 - epsilon) & (adv < 0)
        high = (coef_1 > 1 + epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = masked_batch_mean(low.double())
        metrics["clip_ratio/high_mean"] = masked_batch_mean(high.double())
        metrics["clip_ratio/region_mean"] = masked_batch_mean((low | high).double())

        def masked_seq_mean(x):  # TRL's: a completion's flag at sequence level, NaN without tokens
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        low_shares, high_shares = masked_seq_mean(low.double()), masked_seq_mean(high.double())
        metrics["clip_ratio/low_min"] = low_shares[~low_shares.isnan()].min()
        metrics["clip_ratio/high_max"] = high_shares[~high_shares.isnan()].max()
    loss.backward()
    return loss, metrics, h.grad, w.grad


@pytest.mark.parametrize("with_old", [False, True], ids=["no-old", "old"])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_matches_trl_formulas_fp32(backend, loss_type, level, beta, with_old):
    hidden, weight, ids, mask, advantages, old, ref = make_batch(torch.float32)
    epsilon_high = 1.4 if loss_type == "cispo" else 0.28
    options = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high)
    # TRL's default bias-corrected KL (at sequence level the completion's ratio weighs its tokens' KL)
    options["use_bias_correction_kl"] = True
    count = 40 if loss_type in ("dapo", "cispo") else None  # the step's token count: dapo/cispo only
    loss_fn = GRPOLoss(
        **options,
        importance_sampling_level=level,
        temperature=TEMPERATURE,
        max_completion_length=MAX_LEN,
        backend=backend,
    )
    old = old if with_old else None
    out = loss_fn(
        hidden,
        weight,
        ids,
        mask,
        advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        num_items_in_batch=count,
    )
    out.loss.backward()
    ref_loss, ref_metrics, ref_h, ref_w = trl_reference(
        hidden, weight, ids, mask, advantages, old, ref, level=level, num_items_in_batch=count, **options
    )
    assert_close_to_reference("loss", out.loss.detach(), ref_loss.detach(), torch.float32)
    assert set(out.metrics) == set(ref_metrics)
    for name, value in ref_metrics.items():
        torch.testing.assert_close(out.metrics[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)
    assert_close_to_reference("grad hidden", hidden.grad, ref_h, torch.float32)
    assert_close_to_reference("grad weight", weight.grad, ref_w, torch.float32)
    assert out.per_token_logps.shape == (B, T) and not out.per_token_logps.requires_grad


def assert_matches_trl_formulas_bf16(backend, seed: int, options: dict) -> None:
    """A bf16 batch at token level: ``GRPOLoss(**options)``'s loss and gradients are TRL's formulas' within
    bf16's tolerance."""
    hidden, weight, ids, mask, advantages, old, ref = make_batch(torch.bfloat16, seed=seed)
    loss_fn = GRPOLoss(**options, temperature=TEMPERATURE, backend=backend)
    out = loss_fn(hidden, weight, ids, mask, advantages, old_per_token_logps=old, ref_per_token_logps=ref)
    out.loss.backward()
    ref_loss, _, ref_h, ref_w = trl_reference(
        hidden, weight, ids, mask, advantages, old, ref, level="token", **options
    )
    assert_close_to_reference("loss", out.loss.detach(), ref_loss.detach(), torch.bfloat16)
    assert_close_to_reference("grad hidden", hidden.grad, ref_h, torch.bfloat16)
    assert_close_to_reference("grad weight", weight.grad, ref_w, torch.bfloat16)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_matches_trl_formulas_bf16(backend, loss_type):
    options = dict(loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28)
    assert_matches_trl_formulas_bf16(backend, 1, options)


def test_delta_two_sided_clip(backend):
    hidden, weight, ids, mask, advantages, old, ref = make_batch(torch.float32, seed=2)
    old = old - 0.5  # large ratios, so the delta cap binds
    options = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=1.5)
    out = GRPOLoss(**options, temperature=TEMPERATURE, backend=backend)(
        hidden, weight, ids, mask, advantages, old_per_token_logps=old
    )
    out.loss.backward()
    ref_loss, _, ref_h, _ = trl_reference(
        hidden, weight, ids, mask, advantages, old, ref, level="token", **options
    )
    assert_close_to_reference("loss", out.loss.detach(), ref_loss.detach(), torch.float32)
    assert_close_to_reference("grad hidden", hidden.grad, ref_h, torch.float32)


def test_all_masked_batch_is_zero_without_nan(backend):
    hidden, weight, ids, mask, advantages, old, ref = make_batch(torch.float32)
    mask.zero_()
    for loss_type in ("grpo", "bnpo", "dapo"):
        hidden.grad = weight.grad = None
        out = GRPOLoss(loss_type=loss_type, beta=0.04, backend=backend)(
            hidden, weight, ids, mask, advantages, old_per_token_logps=old, ref_per_token_logps=ref
        )
        out.loss.backward()
        assert out.loss.item() == 0.0
        assert all(torch.isfinite(value) for value in out.metrics.values())
        assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(
            weight.grad, torch.zeros_like(weight)
        )


def test_bad_input():
    hidden, weight, ids, mask, advantages, _, ref = make_batch(torch.float32)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        GRPOLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOLoss(importance_sampling_level="batch")
    loss_fn = GRPOLoss(beta=0.04)
    with pytest.raises(ValueError, match="completion_mask shape"):
        loss_fn(hidden, weight, ids, mask[:, :-1], advantages, ref_per_token_logps=ref)
    with pytest.raises(ValueError, match="advantages must have shape"):
        loss_fn(hidden, weight, ids, mask, advantages[:-1], ref_per_token_logps=ref)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        loss_fn(hidden, weight, ids, mask, advantages)


def test_memory_is_independent_of_the_vocabulary(backend):
    """No tensor of B·T × V elements is allocated; only a chunk of logits at a time."""
    from tests.kernels.test_linear_cross_entropy import _RecordAllocations

    batch, length, vocab, chunk = 4, 64, 1024, 32
    hidden = torch.randn(batch, length, D, device=DEVICE, requires_grad=True)
    weight = torch.randn(vocab, D, device=DEVICE, requires_grad=True)
    ids = torch.randint(0, vocab, (batch, length), device=DEVICE)
    mask = torch.ones(batch, length, device=DEVICE)
    old = torch.full((batch, length), -7.0, device=DEVICE)
    for level, quantile in (("token", 1.0), ("sequence", 1.0), ("token", 0.2), ("sequence", 0.2)):
        loss_fn = GRPOLoss(
            beta=0.04,
            importance_sampling_level=level,
            chunk_size=chunk,
            backend=backend,
            use_bias_correction_kl=level == "token",
            top_entropy_quantile=quantile,
        )
        with _RecordAllocations() as recorder:
            out = loss_fn(
                hidden,
                weight,
                ids,
                mask,
                torch.randn(batch, device=DEVICE),
                old_per_token_logps=old,
                ref_per_token_logps=old,
            )
            out.loss.backward()
        fp32 = 4
        assert recorder.largest <= max(2 * chunk * vocab, vocab * D, batch * length * D) * fp32
        assert recorder.largest < batch * length * vocab * fp32


@pytest.mark.parametrize("quantile", [0.8, 0.2, 0.0])
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["beta0", "beta0.04"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_entropy_mask_matches_trl_formulas_fp32(backend, loss_type, level, beta, quantile):
    """top_entropy_quantile: the policy term of the low-entropy tokens is dropped, the KL term and the
    normaliser keep every token; at token level the gradient pass runs on the kept tokens alone."""
    hidden, weight, ids, mask, advantages, old, ref = make_batch(torch.float32, seed=3)
    epsilon_high = 1.4 if loss_type == "cispo" else 0.28
    options = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high)
    options["top_entropy_quantile"] = quantile
    loss_fn = GRPOLoss(
        **options,
        importance_sampling_level=level,
        temperature=TEMPERATURE,
        max_completion_length=MAX_LEN,
        chunk_size=5,  # several chunks of the kept tokens
        backend=backend,
    )
    out = loss_fn(hidden, weight, ids, mask, advantages, old_per_token_logps=old, ref_per_token_logps=ref)
    out.loss.backward()
    ref_loss, ref_metrics, ref_h, ref_w = trl_reference(
        hidden, weight, ids, mask, advantages, old, ref, level=level, **options
    )
    assert_close_to_reference("loss", out.loss.detach(), ref_loss.detach(), torch.float32)
    for name, value in ref_metrics.items():
        torch.testing.assert_close(out.metrics[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)
    assert_close_to_reference("grad hidden", hidden.grad, ref_h, torch.float32)
    assert_close_to_reference("grad weight", weight.grad, ref_w, torch.float32)
    # the mask bites: a masked-in token has no gradient where only its dropped policy term had one
    if beta == 0.0 and level == "token":
        no_grad = (hidden.grad == 0).all(-1) & (mask != 0)
        assert no_grad.sum() >= (1 - quantile) * mask.sum() - 1


def test_entropy_mask_matches_trl_formulas_bf16(backend):
    options = dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, top_entropy_quantile=0.2)
    assert_matches_trl_formulas_bf16(backend, 4, options)


def test_entropy_mask_with_no_kept_token_is_zero_without_nan(backend):
    """A fully masked micro-batch: no token to keep, a loss of 0 still in the graph, zero gradients."""
    hidden, weight, ids, mask, advantages, old, _ = make_batch(torch.float32)
    mask.zero_()
    hidden.data[0] = float("nan")  # padding's hidden states reach nothing
    out = GRPOLoss(top_entropy_quantile=0.2, backend=backend)(
        hidden, weight, ids, mask, advantages, old_per_token_logps=old
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and all(torch.isfinite(value) for value in out.metrics.values())
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_entropy_mask_gathers_across_processes():
    """``entropy_gather`` (every process's values) sets the threshold: here another process's tokens all
    have a higher entropy than this one's, so at ρ = 0.5 none of this one's is kept."""
    hidden, weight, ids, mask, advantages, old, _ = make_batch(torch.float32)
    others = torch.full((int(mask.sum()) + 1,), 100.0, device=DEVICE)  # on the device, as a gather's
    loss_fn = GRPOLoss(top_entropy_quantile=0.5, entropy_gather=lambda local: torch.cat([local, others]))
    out = loss_fn(hidden, weight, ids, mask, advantages, old_per_token_logps=old)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_bad_top_entropy_quantile():
    for value in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_entropy_quantile"):
            GRPOLoss(top_entropy_quantile=value)
