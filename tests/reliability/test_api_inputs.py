"""Bad inputs to the functional API: the fused loss, per-token log-probs, the GRPO and preference losses.

Two kinds of case:

- garbage at ignored positions (NaN/inf hidden states where the target is -100 or the loss mask is 0):
  nothing of it may reach the loss, the per-token outputs or the gradients. Each case compares with
  PyTorch (``F.cross_entropy`` / ``log_softmax``) on the same non-ignored rows and asserts exact zeros
  at the ignored ones, on both backends (Triton under the interpreter on CPU);
- invalid arguments: a one-line ``ValueError`` naming the argument (``assert_one_line_error``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastalign.losses import GRPOLoss, KTOLoss, PreferenceLoss
from fastalign.ops import group_advantages, linear_cross_entropy, token_logprobs, token_objective
from fastalign.ops.grpo import TokenLossConfig, grpo_token_loss
from tests.conftest import DEVICE
from tests.reliability.conftest import assert_one_line_error

N, D, V = 10, 8, 29
CHUNK = 4  # several chunks per call, a ragged last one
IGNORED = [1, 4, 5, 9]  # ignored rows in every chunk position


def poisoned_inputs(*, bias: bool = False, seed: int = 0):
    """hidden [N, D] with NaN, +inf and -inf at the ignored rows; weight [V, D]; targets [N]."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen)
    hidden[1] = float("nan")
    hidden[4, ::2] = float("inf")
    hidden[5] = -float("inf")
    hidden[9, 0] = float("nan")
    weight = torch.randn(V, D, generator=gen) / D**0.5
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[IGNORED] = -100
    b = torch.randn(V, generator=gen) * 0.1 if bias else None
    leaves = [t.to(DEVICE).requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
    return leaves[0], leaves[1], (leaves[2] if bias else None), targets.to(DEVICE)


def clean_reference(hidden, weight, b, targets):
    """Leaves for PyTorch's reference: the same values, ignored rows set to 0 (any finite value would
    do for a correct reference: those rows are ignored)."""
    valid = (targets != -100)[:, None]
    h = torch.where(valid, hidden.detach(), 0.0).double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    bb = None if b is None else b.detach().double().requires_grad_()
    return h, w, bb


def assert_ignored_rows_are_exact_zeros(grad: torch.Tensor, targets: torch.Tensor) -> None:
    ignored = targets == -100
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored])), grad[ignored]
    assert torch.isfinite(grad).all()


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# NaN/inf hidden states at ignored positions.


@pytest.mark.parametrize(
    "options",
    [
        dict(reduction="mean", bias=True),
        dict(reduction="sum", label_smoothing=0.1),
        dict(reduction="mean", num_items_in_batch=17),
    ],
    ids=["mean-bias", "sum-label-smoothing", "num-items"],
)
def test_poisoned_ignored_rows_leave_scalar_loss_and_gradients_exact(backend, options):
    """Before: loss, grad hidden and grad weight all NaN (0·NaN in the matmuls)."""
    options = dict(options)
    hidden, weight, b, targets = poisoned_inputs(bias=options.pop("bias", False))
    loss = linear_cross_entropy(hidden, weight, targets, b, chunk_size=CHUNK, backend=backend, **options)
    loss.backward()

    h, w, bb = clean_reference(hidden, weight, b, targets)
    num_items = options.pop("num_items_in_batch", None)
    reduction = options.pop("reduction")
    reduction = "sum" if num_items else reduction
    ref = F.cross_entropy(F.linear(h, w, bb), targets, reduction=reduction, **options)
    ref = ref / num_items if num_items else ref
    ref.backward()
    assert torch.isfinite(loss)
    close(loss, ref)
    assert_ignored_rows_are_exact_zeros(hidden.grad, targets)
    close(hidden.grad, h.grad)
    close(weight.grad, w.grad)
    if b is not None:
        close(b.grad, bb.grad)


def test_poisoned_ignored_rows_give_zero_per_token_loss_and_stats(backend):
    """reduction='none' and return_stats: 0 loss, 0 lse, 0 entropy at ignored tokens (before: NaN)."""
    hidden, weight, _, targets = poisoned_inputs(seed=1)
    loss, stats = linear_cross_entropy(
        hidden, weight, targets, reduction="none", return_stats=True, chunk_size=CHUNK, backend=backend
    )
    upstream = torch.linspace(0.5, 1.5, N, device=DEVICE)
    (loss * upstream).sum().backward()

    h, w, _ = clean_reference(hidden, weight, None, targets)
    ref = F.cross_entropy(h @ w.T, targets, reduction="none")
    (ref * upstream.double()).sum().backward()
    ignored = targets == -100
    for value in (loss, stats.lse, stats.entropy):
        assert torch.equal(value[ignored], torch.zeros_like(value[ignored]))
        assert torch.isfinite(value).all()
    close(loss, ref)
    assert_ignored_rows_are_exact_zeros(hidden.grad, targets)
    close(hidden.grad, h.grad)
    close(weight.grad, w.grad)


def test_poisoned_ignored_rows_in_token_logprobs_with_temperature_and_softcap(backend):
    """token_logprobs + entropy at temperature 0.7 with a softcap: exact zeros at ignored tokens and
    their gradient rows; the rest equals log_softmax (before: NaN log-probs and NaN gradients)."""
    hidden, weight, b, targets = poisoned_inputs(bias=True, seed=2)
    logprobs, entropy = token_logprobs(
        hidden,
        weight,
        targets,
        b,
        temperature=0.7,
        softcap=5.0,
        return_entropy=True,
        chunk_size=CHUNK,
        backend=backend,
    )
    (logprobs.sum() + 0.3 * entropy.sum()).backward()

    h, w, bb = clean_reference(hidden, weight, b, targets)
    logits = torch.tanh(F.linear(h, w, bb) / 5.0) * 5.0 / 0.7
    log_p = logits.log_softmax(-1)
    valid = targets != -100
    ref_logprobs = torch.where(valid, log_p.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
    ref_entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (ref_logprobs.sum() + 0.3 * ref_entropy.sum()).backward()
    assert torch.equal(logprobs[~valid], torch.zeros_like(logprobs[~valid]))
    assert torch.equal(entropy[~valid], torch.zeros_like(entropy[~valid]))
    close(logprobs, ref_logprobs)
    close(entropy, ref_entropy)
    assert_ignored_rows_are_exact_zeros(hidden.grad, targets)
    close(hidden.grad, h.grad)
    close(weight.grad, w.grad)
    close(b.grad, bb.grad)


def test_nan_upstream_gradient_at_ignored_tokens_is_dropped(backend):
    """An upstream gradient that is NaN at ignored tokens (log-probs divided by a 0 count there, say)
    does not reach the inputs: F.cross_entropy drops it too (before: NaN gradients everywhere)."""
    hidden, weight, _, targets = poisoned_inputs(seed=3)
    logprobs = token_logprobs(hidden, weight, targets, chunk_size=CHUNK, backend=backend)
    upstream = torch.ones(N, device=DEVICE)
    upstream[targets == -100] = float("nan")
    logprobs.backward(upstream)

    h, w, _ = clean_reference(hidden, weight, None, targets)
    (-F.cross_entropy(h @ w.T, targets, reduction="sum")).backward()
    assert_ignored_rows_are_exact_zeros(hidden.grad, targets)
    close(hidden.grad, h.grad)
    close(weight.grad, w.grad)


def test_poisoned_ignored_rows_in_token_objective(backend):
    """token_objective (gradient formed in forward): the objective sees log-prob 0 at ignored tokens,
    and a NaN it returns there is dropped (before: NaN loss and gradients)."""
    hidden, weight, _, targets = poisoned_inputs(seed=4)
    valid = targets != -100

    def objective(rows, logp):
        # Σ logp² over valid tokens; deliberately NaN at ignored ones
        poisoned = torch.where(valid[rows], 2 * logp, float("nan"))
        return (logp * logp * valid[rows]).sum(), poisoned, torch.zeros(1, device=logp.device)

    result = token_objective(hidden, weight, targets, objective, chunk_size=CHUNK, backend=backend)
    result.loss.backward()

    h, w, _ = clean_reference(hidden, weight, None, targets)
    ref_logp = torch.where(
        valid, (h @ w.T).log_softmax(-1).gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0
    )
    (ref_logp**2).sum().backward()
    close(result.loss, (ref_logp**2).sum())
    assert torch.equal(result.logprobs[~valid], torch.zeros(int((~valid).sum()), device=DEVICE))
    assert_ignored_rows_are_exact_zeros(hidden.grad, targets)
    close(hidden.grad, h.grad)
    close(weight.grad, w.grad)


B, T = 4, 6


def grpo_batch(seed=0):
    """Completions [B, T] with the last two positions masked: NaN hidden states, pad ids outside the
    vocabulary and NaN old/ref log-probs there."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) / D**0.5
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, 4:] = 0
    mask[2, 2:] = 0
    old = torch.randn(B, T, generator=gen) * 0.1 - 3.0
    hidden[mask == 0] = float("nan")
    ids[mask == 0] = V + 7
    old[mask == 0] = float("nan")
    advantages = torch.randn(B, generator=gen)
    return (
        hidden.to(DEVICE).requires_grad_(),
        weight.to(DEVICE).requires_grad_(),
        ids.to(DEVICE),
        mask.to(DEVICE),
        advantages.to(DEVICE),
        old.to(DEVICE),
    )


def grpo_reference(hidden, weight, ids, mask, advantages, old, *, level, beta=0.04, eps=0.2):
    """TRL's GRPO 'dapo' loss in float64 on the unmasked tokens (masked ones replaced by finite values)."""
    valid = mask.bool()
    h = torch.where(valid[..., None], hidden.detach(), 0.0).double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    log_p = (h @ w.T).log_softmax(-1)
    logp = log_p.gather(-1, torch.where(valid, ids, 0)[..., None]).squeeze(-1)
    old = torch.where(valid, old, 0.0).double()
    m = mask.double()
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = log_ratio.exp()
    adv = advantages.double()[:, None]
    per_token = -torch.min(coef_1 * adv, coef_1.clamp(1 - eps, 1 + eps) * adv)
    kl = torch.exp(old - logp) - (old - logp) - 1
    per_token = per_token + beta * kl
    loss = (per_token * m).sum() / m.sum()
    loss.backward()
    return loss, h.grad, w.grad


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_ignores_nan_hidden_states_and_logps_at_masked_tokens(backend, level):
    """GRPOLoss: completion_mask 0 with NaN hidden states, NaN old/ref log-probs and out-of-vocabulary pad
    ids there (before: NaN loss, metrics and gradients)."""
    hidden, weight, ids, mask, advantages, old = grpo_batch()
    out = GRPOLoss(
        beta=0.04,
        importance_sampling_level=level,
        chunk_size=CHUNK,
        backend=backend,
        use_bias_correction_kl=False,  # the reference below is the plain k3 KL
    )(hidden, weight, ids, mask, advantages, old_per_token_logps=old, ref_per_token_logps=old)
    out.loss.backward()
    ref_loss, ref_h, ref_w = grpo_reference(hidden, weight, ids, mask, advantages, old, level=level)
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
    close(out.loss, ref_loss)
    masked = mask == 0
    assert torch.equal(hidden.grad[masked], torch.zeros_like(hidden.grad[masked]))
    assert torch.equal(out.per_token_logps[masked], torch.zeros_like(out.per_token_logps[masked]))
    close(hidden.grad, ref_h)
    close(weight.grad, ref_w)


def test_grpo_token_loss_op_ignores_nan_logps_at_masked_tokens(backend):
    """The GRPO token-loss op on log-probs that are NaN where the mask is 0 (before: NaN loss/grad)."""
    gen = torch.Generator().manual_seed(5)
    logp = torch.randn(B, T, generator=gen) * 0.1 - 2.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 3:] = False
    logp[~mask] = float("nan")
    old = torch.where(mask, logp + 0.05, float("nan"))
    logp = logp.to(DEVICE).requires_grad_()
    config = TokenLossConfig(
        beta=0.0, eps_low=0.2, eps_high=0.2, delta=None, sequence_level=False, cispo=False
    )
    advantages = torch.tensor([1.0, -0.5, 0.3, -2.0], device=DEVICE)
    loss, sums = grpo_token_loss(
        logp,
        mask.to(DEVICE),
        advantages,
        torch.full((B,), 0.1, device=DEVICE),
        config,
        old_logp=old.to(DEVICE),
        backend=backend,
    )
    loss.backward()
    ref_logp = torch.where(mask, logp.detach().cpu(), 0.0).double().requires_grad_()
    ratio = (ref_logp - torch.where(mask, old, 0.0).double()).exp()
    adv = advantages.cpu().double()[:, None]
    ref = (-torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask * 0.1).sum()
    ref.backward()
    assert torch.isfinite(sums).all()
    close(loss, ref)
    close(logp.grad.cpu(), ref_logp.grad)
    assert torch.equal(logp.grad[~mask], torch.zeros_like(logp.grad[~mask]))


def test_preference_loss_ignores_nan_hidden_states_at_masked_tokens(backend):
    """PreferenceLoss (DPO with a reference from hidden states): NaN hidden states where loss_mask is
    0, in the policy and the reference (before: NaN loss and gradients)."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, T, D, generator=gen)
    ref_hidden = hidden + 0.1 * torch.randn(4, T, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) / D**0.5
    targets = torch.randint(0, V, (4, T), generator=gen)
    loss_mask = torch.ones(4, T, dtype=torch.bool)
    loss_mask[:, :2] = False  # the prompt
    hidden[~loss_mask] = float("nan")
    ref_hidden[~loss_mask] = float("nan")
    hidden, weight = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    out = PreferenceLoss(beta=0.1, chunk_size=CHUNK, backend=backend)(
        hidden,
        weight,
        targets.to(DEVICE),
        loss_mask.to(DEVICE),
        ref_hidden=ref_hidden.to(DEVICE),
        ref_weight=weight.detach(),
    )
    out.loss.backward()

    def seq_logps(h, w):
        h = torch.where(loss_mask[..., None], h, 0.0)
        logp = (h @ w.T).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        return (logp * loss_mask).sum(-1)

    h = torch.where(loss_mask[..., None], hidden.detach().cpu(), 0.0).double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    policy, ref = seq_logps(h, w), seq_logps(ref_hidden.double(), w.detach())
    margin = 0.1 * ((policy[:2] - ref[:2]) - (policy[2:] - ref[2:]))
    ref_loss = -F.logsigmoid(margin).mean()
    ref_loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
    close(out.loss, ref_loss)
    assert torch.equal(hidden.grad[~loss_mask], torch.zeros_like(hidden.grad[~loss_mask]))
    close(hidden.grad.cpu(), h.grad)
    close(weight.grad.cpu(), w.grad)


def test_kto_loss_ignores_nan_hidden_states_at_ignored_targets(backend):
    """KTOLoss with -100 targets (no loss_mask) where the hidden states are NaN (before: NaN loss)."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, T, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) / D**0.5
    targets = torch.randint(0, V, (3, T), generator=gen)
    targets[:, :3] = -100
    hidden[:, :3] = float("nan")
    hidden, weight = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    zeros = torch.zeros(3, device=DEVICE)
    out = KTOLoss(beta=0.1, chunk_size=CHUNK, backend=backend)(
        hidden,
        weight,
        targets.to(DEVICE),
        torch.tensor([True, False, True], device=DEVICE),
        ref_logps=zeros - 9.0,
        kl_logps=zeros,
        ref_kl_logps=zeros,
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())
    assert torch.equal(hidden.grad[:, :3], torch.zeros_like(hidden.grad[:, :3]))
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


# --------------------------------------------------------------------------------------------------
# Invalid arguments: one-line ValueError naming the argument.


def _lce_inputs():
    hidden = torch.randn(2, 5, D, device=DEVICE)
    weight = torch.randn(V, D, device=DEVICE)
    targets = torch.randint(0, V, (2, 5), device=DEVICE)
    return hidden, weight, targets


def _lce(**override):
    hidden, weight, targets = _lce_inputs()
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, backend="torch") | override
    return linear_cross_entropy(**kwargs)


def _logprobs(**override):
    hidden, weight, targets = _lce_inputs()
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, backend="torch") | override
    return token_logprobs(**kwargs)


def _grpo(loss_options=None, **override):
    hidden = torch.randn(2, 3, D, device=DEVICE)
    kwargs = (
        dict(
            hidden=hidden,
            weight=torch.randn(V, D, device=DEVICE),
            completion_ids=torch.randint(0, V, (2, 3)),
            completion_mask=torch.ones(2, 3, dtype=torch.long),
            advantages=torch.tensor([1.0, -1.0]),
        )
        | override
    )
    return GRPOLoss(backend="torch", **(loss_options or {}))(**kwargs)


def _preference(loss_mask, objective_options=None):
    hidden = torch.randn(2, 4, D, device=DEVICE)
    targets = torch.randint(0, V, (2, 4), device=DEVICE)
    return PreferenceLoss(objective="simpo", backend="torch", **(objective_options or {}))(
        hidden, torch.randn(V, D, device=DEVICE), targets, loss_mask
    )


def _kto(loss_mask):
    hidden = torch.randn(2, 4, D, device=DEVICE)
    targets = torch.randint(0, V, (2, 4), device=DEVICE)
    zeros = torch.zeros(2, device=DEVICE)
    return KTOLoss(backend="torch")(
        hidden,
        torch.randn(V, D, device=DEVICE),
        targets,
        torch.tensor([True, False]),
        loss_mask,
        ref_logps=zeros,
        kl_logps=zeros,
        ref_kl_logps=zeros,
    )


def _grpo_op(advantages):
    config = TokenLossConfig(
        beta=0.0, eps_low=0.2, eps_high=0.2, delta=None, sequence_level=False, cispo=False
    )
    return grpo_token_loss(
        torch.zeros(2, 3), torch.ones(2, 3), advantages, torch.ones(2), config, backend="torch"
    )


def case(case_id: str, before: str, call, culprit: str):
    """``before``: what the unfixed code did — 'silent' (accepted the invalid value: wrong or NaN result),
    'traceback' (an exception other than a one-line ValueError), 'vague' (an error not naming the
    argument), 'ok' (already right: kept as a guard)."""
    assert before in ("silent", "traceback", "vague", "ok")
    return pytest.param(call, culprit, id=f"{case_id}[{before}]")


API_CASES = [
    # num_items_in_batch: the loss's divisor, a finite count >= 0 (a fraction under transformers' tensor or
    # context parallelism), 0 only where no target counts; GRPO's: a positive integer or integer tensor
    case("num-items-negative", "ok", lambda: _lce(num_items_in_batch=-2.5), "num_items_in_batch"),
    case(
        "num-items-nan-tensor", "ok", lambda: _lce(num_items_in_batch=torch.tensor(math.nan)), "num_items_in"
    ),
    case(
        "num-items-zero-with-targets", "ok", lambda: _lce(num_items_in_batch=torch.tensor(0)), "num_items_in"
    ),
    case("num-items-bool", "silent", lambda: _lce(num_items_in_batch=True), "num_items_in_batch"),
    case("num-items-zero-grpo", "silent", lambda: _grpo(num_items_in_batch=torch.tensor(0)), "num_items"),
    case("num-items-fraction-grpo", "silent", lambda: _grpo(num_items_in_batch=2.5), "num_items_in_batch"),
    # temperature / softcap / z_loss: finite numbers (inf temperature made every distribution uniform)
    case("temperature-inf", "silent", lambda: _lce(temperature=math.inf), "temperature"),
    case("temperature-inf-logprobs", "silent", lambda: _logprobs(temperature=math.inf), "temperature"),
    case("temperature-inf-grpo", "silent", lambda: GRPOLoss(temperature=math.inf), "temperature"),
    case("temperature-nan", "ok", lambda: _logprobs(temperature=math.nan), "temperature"),
    case("temperature-negative", "ok", lambda: _lce(temperature=-0.5), "temperature"),
    case("temperature-string", "traceback", lambda: _logprobs(temperature="0.7"), "temperature"),
    case("softcap-inf", "silent", lambda: _lce(softcap=math.inf), "softcap"),  # NaN loss
    case("z-loss-inf", "silent", lambda: _lce(z_loss=math.inf), "z_loss"),  # inf loss
    # masks: 0/1 (bool or integer); a fraction counted as 1
    case(
        "completion-mask-fraction",
        "silent",
        lambda: _grpo(completion_mask=torch.full((2, 3), 0.5)),
        "completion_mask",
    ),
    case("loss-mask-fraction", "silent", lambda: _preference(torch.full((2, 4), 0.5)), "loss_mask"),
    case("loss-mask-two", "silent", lambda: _kto(torch.full((2, 4), 2)), "loss_mask"),
    case("loss-mask-shape", "silent", lambda: _preference(torch.ones(4, dtype=torch.bool)), "loss_mask"),
    # advantages: finite (NaN loss before)
    case("advantages-nan", "silent", lambda: _grpo(advantages=torch.tensor([math.nan, 1.0])), "advantages"),
    case("advantages-inf-op", "silent", lambda: _grpo_op(torch.tensor([1.0, math.inf])), "advantages"),
    # sizes and types
    case(
        "hidden-size-zero",
        "traceback",
        lambda: _lce(hidden=torch.randn(2, 5, 0), weight=torch.randn(V, 0)),
        "D is 0",
    ),
    case("chunk-size-fraction", "traceback", lambda: _lce(chunk_size=2.5), "chunk_size"),
    case("chunk-size-zero", "ok", lambda: _logprobs(chunk_size=0), "chunk_size"),
    case("chunk-size-negative-grpo", "silent", lambda: GRPOLoss(chunk_size=-3), "chunk_size"),  # until called
    case("chunk-size-bool", "silent", lambda: _lce(chunk_size=True), "chunk_size"),  # 1 token per chunk
    # ignore_index 2.5 matched no target: nothing was ignored
    case("ignore-index-fraction", "silent", lambda: _lce(ignore_index=2.5), "ignore_index"),
    case("group-size-float", "traceback", lambda: group_advantages(torch.zeros(4), 2.0), "group_size"),
    case("hidden-list", "traceback", lambda: _lce(hidden=[[0.0] * D]), "hidden"),
    case("targets-list", "ok", lambda: _logprobs(targets=[[1, 2, 3, 4, 5]] * 2), "targets"),
    case("advantages-list", "traceback", lambda: _grpo(advantages=[1.0, -1.0]), "advantages"),
    case(
        "preference-hidden-list",
        "traceback",
        lambda: PreferenceLoss()([[0.0]], torch.zeros(V, D), torch.zeros(1, 1)),
        "hidden",
    ),
    # dtypes, devices, target ids
    case("weight-dtype", "ok", lambda: _lce(weight=torch.randn(V, D, dtype=torch.float64)), "weight dtype"),
    case("weight-device", "ok", lambda: _lce(weight=torch.randn(V, D, device="meta")), "weight is on meta"),
    case("targets-float", "ok", lambda: _lce(targets=torch.zeros(2, 5)), "targets"),
    case("completion-ids-float", "vague", lambda: _grpo(completion_ids=torch.zeros(2, 3)), "completion_ids"),
    case("targets-out-of-vocab", "ok", lambda: _lce(targets=torch.full((2, 5), V)), f"[0, {V})"),
]


@pytest.mark.parametrize("call, culprit", API_CASES)
def test_invalid_argument_is_a_one_line_value_error(call, culprit):
    with pytest.raises(ValueError) as error:
        call()
    assert_one_line_error(error.value, culprit)


def test_grpo_loss_types_that_ignore_num_items_in_batch_refuse_it():
    """grpo, bnpo and dr_grpo normalise per micro-batch: a step-wide count would be accepted but ignored."""
    from fastalign.losses import GRPOLoss

    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        assert not GRPOLoss(loss_type=loss_type, max_completion_length=3).uses_item_count
    assert GRPOLoss(loss_type="dapo").uses_item_count and GRPOLoss(loss_type="cispo").uses_item_count
    with pytest.raises(ValueError) as error:
        _grpo(loss_options={"loss_type": "bnpo"}, num_items_in_batch=torch.tensor(7))
    assert_one_line_error(error.value, "num_items_in_batch")
