"""Triton kernel of the pairwise preference losses: per pair, the loss and its two partial derivatives.

Every DPO-family loss (and SimPO, CPO, ORPO) is a function of two numbers per pair once its inputs are
prepared (``fastalign.ops.preference`` does that with differentiable PyTorch ops): c and r, e.g. the
chosen and rejected log-ratios π − π_ref. With h = c − r, z = β·h, σ the logistic function, ε the label
smoothing, and logσ(x) = min(x, 0) − log(1 + e^−|x|):

    sigmoid    −(1−ε)·logσ(z) − ε·logσ(−z)                  robust  (−(1−ε)·logσ(z) + ε·logσ(−z)) / (1−2ε)
    exo_pair   σ(z)(logσ(z) − log(1−ε)) + σ(−z)(logσ(−z) − log ε)          hinge   relu(1 − z)
    ipo        (h − 1/(2β))²                                 discopop  −logσ(z)(1−m) + e^−z·m, m = σ(z/τ)
    bco_pair   −logσ(βc) − logσ(−βr)                        sppo_hard (c − 1/(2β))² + (r + 1/(2β))²
    nca_pair   −logσ(βc) − ½logσ(−βc) − ½logσ(−βr)          apo_zero  1 − σ(βc) + σ(βr)
    apo_down   σ(βc) + 1 − σ(z)                              orpo      −β·logσ(h − log(1−e^c) + log(1−e^r))
    kto        1 − σ(z)

One program handles ``BLOCK`` pairs; the derivatives are written out below, no autograd. Floor: a few
bytes per pair: negligible next to the log-probs that feed it.

``log_sum_sq_probs`` is WPO's per-token statistic log Σ_v p_v² of a chunk of logits [C, V], one program
per row in a single online pass over the vocabulary (running max m, s₁ = Σ e^(z−m), s₂ = Σ e^(2(z−m)),
then log s₂ − 2·log s₁); forward only (WPO's weights carry no gradient). Floor: one read of the chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOSS_CODES: dict[str, int] = {
    "sigmoid": 0,
    "robust": 1,
    "exo_pair": 2,
    "hinge": 3,
    "ipo": 4,
    "bco_pair": 5,
    "sppo_hard": 6,
    "nca_pair": 7,
    "apo_zero": 8,
    "apo_down": 9,
    "discopop": 10,
    "orpo": 11,
    "kto": 12,
}


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _pair_loss_kernel(
    c_ptr, r_ptr, loss_ptr, dc_ptr, dr_ptr, n, beta, smoothing, tau,
    LOSS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    # Padding lanes read −1: finite for every loss (ORPO's log(1 − e^c) included); never stored.
    c = tl.load(c_ptr + offsets, mask=inside, other=-1.0).to(tl.float32)
    r = tl.load(r_ptr + offsets, mask=inside, other=-1.0).to(tl.float32)
    h = c - r
    z = beta * h
    if LOSS == 0:  # sigmoid
        loss = -(1.0 - smoothing) * _log_sigmoid(z) - smoothing * _log_sigmoid(-z)
        dh = beta * (-(1.0 - smoothing) * _sigmoid(-z) + smoothing * _sigmoid(z))
        dc, dr = dh, -dh
    elif LOSS == 1:  # robust
        loss = (-(1.0 - smoothing) * _log_sigmoid(z) + smoothing * _log_sigmoid(-z)) / (1.0 - 2.0 * smoothing)
        dh = beta * (-(1.0 - smoothing) * _sigmoid(-z) - smoothing * _sigmoid(z)) / (1.0 - 2.0 * smoothing)
        dc, dr = dh, -dh
    elif LOSS == 2:  # exo_pair
        s, s_neg = _sigmoid(z), _sigmoid(-z)
        up, down = _log_sigmoid(z) - tl.log(1.0 - smoothing), _log_sigmoid(-z) - tl.log(smoothing)
        loss = s * up + s_neg * down
        dh = beta * s * s_neg * (up - down)
        dc, dr = dh, -dh
    elif LOSS == 3:  # hinge
        loss = tl.maximum(1.0 - z, 0.0)
        dh = tl.where(z < 1.0, -beta, 0.0)
        dc, dr = dh, -dh
    elif LOSS == 4:  # ipo
        gap = h - 1.0 / (2.0 * beta)
        loss = gap * gap
        dc, dr = 2.0 * gap, -2.0 * gap
    elif LOSS == 5:  # bco_pair
        loss = -_log_sigmoid(beta * c) - _log_sigmoid(-beta * r)
        dc = -beta * _sigmoid(-beta * c)
        dr = beta * _sigmoid(beta * r)
    elif LOSS == 6:  # sppo_hard
        up, down = c - 0.5 / beta, r + 0.5 / beta
        loss = up * up + down * down
        dc, dr = 2.0 * up, 2.0 * down
    elif LOSS == 7:  # nca_pair
        loss = -_log_sigmoid(beta * c) - 0.5 * _log_sigmoid(-beta * c) - 0.5 * _log_sigmoid(-beta * r)
        dc = -beta * _sigmoid(-beta * c) + 0.5 * beta * _sigmoid(beta * c)
        dr = 0.5 * beta * _sigmoid(beta * r)
    elif LOSS == 8:  # apo_zero
        sc, sr = _sigmoid(beta * c), _sigmoid(beta * r)
        loss = 1.0 - sc + sr
        dc, dr = -beta * sc * (1.0 - sc), beta * sr * (1.0 - sr)
    elif LOSS == 9:  # apo_down
        sc, sz = _sigmoid(beta * c), _sigmoid(z)
        loss = sc + 1.0 - sz
        dz = -beta * sz * (1.0 - sz)
        dc, dr = beta * sc * (1.0 - sc) + dz, -dz
    elif LOSS == 10:  # discopop
        m = _sigmoid(z / tau)
        dm = m * (1.0 - m) / tau
        e = tl.exp(-z)
        loss = -_log_sigmoid(z) * (1.0 - m) + e * m
        dh = beta * (-_sigmoid(-z) * (1.0 - m) + _log_sigmoid(z) * dm - e * m + e * dm)
        dc, dr = dh, -dh
    elif LOSS == 12:  # kto: 1 − σ(β(c − r)), c − r = log-ratio − KL (desirable) or KL − log-ratio
        s = _sigmoid(z)
        loss = 1.0 - s
        dh = -beta * s * (1.0 - s)
        dc, dr = dh, -dh
    else:  # orpo: c, r are mean per-token log-probs (< 0); log-odds difference
        log_odds = h - tl.log(1.0 - tl.exp(c)) + tl.log(1.0 - tl.exp(r))
        loss = -beta * _log_sigmoid(log_odds)
        d_odds = -beta * _sigmoid(-log_odds)
        dc, dr = d_odds / (1.0 - tl.exp(c)), -d_odds / (1.0 - tl.exp(r))
    tl.store(loss_ptr + offsets, loss, mask=inside)
    tl.store(dc_ptr + offsets, dc, mask=inside)
    tl.store(dr_ptr + offsets, dr, mask=inside)


def pair_loss(
    c: torch.Tensor,
    r: torch.Tensor,
    loss_type: str,
    *,
    beta: float,
    smoothing: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ∂loss/∂c, ∂loss/∂r), each [P] fp32, for contiguous fp32 c, r [P]."""
    n = c.numel()
    loss, dc, dr = (torch.empty(n, dtype=torch.float32, device=c.device) for _ in range(3))
    block = min(triton.next_power_of_2(n), 1024)
    _pair_loss_kernel[(triton.cdiv(n, block),)](
        c, r, loss, dc, dr, n, beta, smoothing, tau, LOSS=LOSS_CODES[loss_type], BLOCK=block
    )
    return loss, dc, dr


@triton.jit
def _log_sum_sq_probs_kernel(logits_ptr, out_ptr, stride_row, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    running_max = float("-inf")
    exp_sum = 0.0  # Σ exp(z − running_max)
    sq_sum = 0.0  # Σ exp(2(z − running_max))
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        z = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        rescale = tl.exp(running_max - new_max)
        e = tl.where(in_vocab, tl.exp(z - new_max), 0.0)
        exp_sum = exp_sum * rescale + tl.sum(e, axis=0)
        sq_sum = sq_sum * rescale * rescale + tl.sum(e * e, axis=0)
        running_max = new_max
    tl.store(out_ptr + row, tl.log(sq_sum) - 2.0 * tl.log(exp_sum))


def log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """log Σ_v softmax(logits)_v² per row [C] (fp32) of logits [C, V] (any float dtype, unit stride in V)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        block = min(triton.next_power_of_2(vocab), 4096)
        _log_sum_sq_probs_kernel[(rows,)](logits, out, logits.stride(0), vocab, BLOCK_V=block)
    return out
