"""The DPO options' ops (``fastalign.ops.preference``) and WPO's kernel against float64 definitions:
log Σ p² per token (both backends, odd sizes, ignored tokens, fp32 and bf16), f-DPO's scores and LD-DPO's
token weights."""

from __future__ import annotations

import math

import pytest
import torch

from fastalign.ops.preference import (
    F_DIVERGENCE_TYPES,
    f_divergence_scores,
    length_desensitised_weights,
    token_log_sum_sq_probs,
)
from tests.conftest import DEVICE


def log_sum_sq64(hidden, weight, bias, ignored):
    """log Σ_v softmax(z)_v² in float64, straight from the definition, of the logits as the head forms
    them in the inputs' dtype: exact (float64) logits rounded once to that dtype, as a GEMM that sums
    in fp32 and rounds its output does, whichever kernel it is. Returns it with the most it may move
    per token where a GEMM's rounding of a logit may differ from that.

    Ignored rows are zeroed before the matmul, as the head leaves them out of its own: a NaN row need
    not stay in its row through a low-precision GEMM (oneDNN's AMX bf16 kernels spread it to
    neighbouring rows), so masking only after the matmul could poison the tokens compared."""
    dtype = hidden.dtype
    hidden = hidden.masked_fill(ignored[..., None], 0.0).double()
    weight, bias = weight.double(), bias.double()
    exact = hidden @ weight.T + bias
    # An fp32 sum of the D exact products and the bias, in any order, is within D·2⁻²⁴·Σ|terms| of
    # the exact logit: where that interval straddles a rounding boundary of the dtype, the head's GEMM
    # may round the other way (which kernel runs differs by CPU ISA and by the GEMM's size: the head
    # multiplies a chunk of rows, this reference all of them).
    error = hidden.shape[-1] * 2**-24 * (hidden.abs() @ weight.abs().T + bias.abs())
    low, high = (exact - error).to(dtype).double(), (exact + error).to(dtype).double()
    logits = exact.to(dtype).double()
    p = logits.softmax(-1)
    sum_sq = (p**2).sum(-1, keepdim=True)
    # |∂ log Σp² / ∂z_v| = 2·p_v·|p_v − Σp²| / Σp², times the widest rounding a GEMM may pick, twice
    # (the first-order bound, with room for the second order over a bf16 ulp)
    slack = 2 * (2 * p * (p - sum_sq).abs() / sum_sq * (high - low)).sum(-1)
    return sum_sq.squeeze(-1).log(), slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("shape", "vocab", "chunk"), [((3, 7), 37, 4), ((2, 5), 4099, None), ((1, 1), 1, None)]
)
def test_log_sum_sq_probs_matches_float64(backend, dtype, shape, vocab, chunk):
    """Odd sizes (vocabulary wider than one 4096 tile, a single-token vocabulary), several chunks, a bias,
    ignored tokens whose hidden states are NaN (0 there, nothing leaks)."""
    gen = torch.Generator().manual_seed(vocab)
    dim = 11
    hidden = (torch.randn(*shape, dim, generator=gen) * 2).to(DEVICE, dtype)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(DEVICE, dtype)
    bias = torch.randn(vocab, generator=gen).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, shape, generator=gen).to(DEVICE)
    ignored = torch.rand(shape, generator=gen).to(DEVICE) < 0.3
    ignored.view(-1)[0] = shape != (1, 1)  # at least one ignored token where there are several
    targets = targets.masked_fill(ignored, -100)
    hidden = hidden.masked_fill(ignored[..., None], float("nan"))

    out = token_log_sum_sq_probs(hidden, weight, targets, bias, chunk_size=chunk, backend=backend)

    assert out.dtype == torch.float32 and out.shape == targets.shape
    assert (out[ignored] == 0).all()
    expected, slack = log_sum_sq64(hidden, weight, bias, ignored)
    expected = expected.masked_fill(ignored, 0.0)
    # 2e-5: the fp32 statistics of given logits; slack: logits the head's GEMM may round otherwise
    error = (out.double() - expected).abs()
    assert (error <= 2e-5 + slack).all(), f"error {error.max():.3e}, slack {slack.max():.3e}"
    assert (out[~ignored] <= 1e-6).all()  # Σ p² ≤ 1


def test_log_sum_sq_probs_extreme_logits_stay_finite(backend):
    """A peaked distribution (log Σ p² → 0) and a flat one (→ −log V), through the online rescaling."""
    vocab = 4099
    weight = torch.zeros(vocab, 2, device=DEVICE)
    weight[vocab - 1, 0] = 1.0  # the last tile's logit dominates after earlier tiles set the max
    hidden = torch.tensor([[[500.0, 0.0], [0.0, 0.0]]], device=DEVICE)
    out = token_log_sum_sq_probs(
        hidden, weight, torch.zeros(1, 2, dtype=torch.long, device=DEVICE), backend=backend
    )
    torch.testing.assert_close(out[0].cpu(), torch.tensor([0.0, -math.log(vocab)]), rtol=0, atol=1e-5)


def f_prime64(t: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """f'(t) of f-DPO's divergences (the f-DPO paper's table), t = π/π_ref, float64."""
    if kind == "reverse_kl":
        return t.log()
    if kind == "forward_kl":
        return 1 - 1 / t
    if kind == "js_divergence":
        return (2 * t / (1 + t)).log()
    return (t ** (alpha - 1) - 1) / (alpha - 1)


@pytest.mark.parametrize("alpha", [0.5, 0.3, 1.7])
@pytest.mark.parametrize("kind", F_DIVERGENCE_TYPES)
def test_f_divergence_scores_are_f_prime(kind, alpha):
    logratios = torch.tensor([-3.0, -0.4, 0.0, 0.25, 2.5], dtype=torch.float64)
    scores = f_divergence_scores(logratios.float(), kind, alpha)
    torch.testing.assert_close(scores.double(), f_prime64(logratios.exp(), kind, alpha), rtol=1e-5, atol=1e-6)


def test_alpha_divergence_limits():
    """α → 1 is reverse_kl's log t; a huge (α−1)·log t is clamped at 80, as TRL, so it stays finite."""
    logratios = torch.tensor([-2.0, 0.5, 1e4])
    near_one = f_divergence_scores(logratios, "alpha_divergence", 1.0 + 1e-7)
    assert torch.equal(near_one, logratios)
    clamped = f_divergence_scores(logratios, "alpha_divergence", 2.0)
    assert torch.isfinite(clamped).all() and clamped[2] == pytest.approx(math.expm1(80.0), rel=1e-6)


def test_length_desensitised_weights_split_each_pair_at_its_shorter_completion():
    ignored = -100
    targets = torch.tensor(
        [
            [ignored, 5, 6, 7, 8, ignored],  # chosen 0: 4 tokens
            [ignored, ignored, 1, 2, ignored, ignored],  # chosen 1: 2 tokens
            [ignored, 3, 4, ignored, ignored, ignored],  # rejected 0: 2 tokens → shared 2
            [ignored, 1, 2, 3, 4, 5],  # rejected 1: 5 tokens → shared 2
        ]
    )
    a = 0.25
    expected = torch.tensor(
        [
            [0, 1, 1, a, a, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 1, 1, a, a, a],
        ]
    )
    torch.testing.assert_close(length_desensitised_weights(targets, a), expected.float())
    assert (length_desensitised_weights(targets, 1.0) == (targets != ignored)).all()  # 1: plain sums
