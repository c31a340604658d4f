"""Triton row kernel of the fused linear divergence between two LM heads (distillation).

The op (``fastalign.ops.linear_divergence``) walks the tokens in chunks. For one chunk of C tokens it
builds the raw student logits ``x = h_s @ W_s.T + b_s`` and, without gradient, the teacher's
``y = h_t @ W_t.T + b_t`` ([C, V] each, fp32 whatever the inputs' dtype), then calls the kernel of
this file (or its PyTorch twin, ``fastalign.ops.linear_divergence_torch``): one program per row,
looping over the vocabulary in ``BLOCK_V`` tiles. With ``s = log softmax(x / T)`` (student, ``p = exp s``),
``t = log softmax(y / T)`` (teacher, ``q = exp t``) and the mixture ``m = (1 − β)·p + β·q``, the
divergence D is TRL's ``generalized_jsd_loss`` of one token:

    β = 0 (MODE 0):  D = KL(q ‖ p) = Σ q (t − s)                ∂D/∂z_j = p_j − q_j
    β = 1 (MODE 1):  D = KL(p ‖ q) = Σ p (s − t)                ∂D/∂z_j = p_j (s_j − t_j − D)
    else  (MODE 2):  D = β·KL(q ‖ m) + (1 − β)·KL(p ‖ m)        ∂D/∂z_j = (1 − β) p_j (s_j − log m_j − K)

with K = KL(p ‖ m): the q terms of ∂D/∂p cancel, ∂D/∂p_j = (1 − β)(s_j − log m_j), and the softmax's
Jacobian subtracts the p-weighted mean of that, (1 − β)·K.

where z = x / T, so ∂/∂x = ∂/∂z / T. With a hard-label weight, the cross-entropy of the student at
temperature 1, ``CE = lse(x) − x_label``, adds ``softmax(x)_j − [j = label]`` per unit of its weight.
The student's entropy ``H = −Σ p s = lse(z) − Σ p z`` (a metric: no gradient) is one more running sum
of pass 1.

Passes over a row (each reads both logits rows):

1. online max and Σexp of z and of z_t (and of x for the cross-entropy); for β ∈ {0, 1} the
   divergence as well, from the running ``Σ e·(z_t − z)`` of the distribution that weighs it; the
   entropy from the running ``Σ e_s·z``;
2. β ∈ (0, 1) only: D and K, which need both normalisers to form log m;
3. when a gradient is due: overwrite the student row, in place, with
   ``a·∂D/∂x + c·∂CE/∂x`` (a, c: per-row coefficients, 0 at ignored tokens).

Floor of the op: the student's three matmuls and the teacher's one, 2·N·V·(3·Ds + Dt) FLOPs (scalar
loss, gradient formed in the forward pass). The kernel adds 2–3 reads of both [C, V] tiles and one
write per chunk.

Written for the Triton interpreter too: loads upcast to fp32, the tile size a plain argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_pair(s_row, t_row, start, V, inv_temperature, BLOCK_V: tl.constexpr):
    """Columns [start, start + BLOCK_V): (cols, in_vocab, raw student x, z = x / T, z_t = y / T)."""
    cols = start + tl.arange(0, BLOCK_V)
    in_vocab = cols < V
    x = tl.load(s_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
    y = tl.load(t_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
    return cols, in_vocab, x, x * inv_temperature, y * inv_temperature


@triton.jit
def _online(running_max, exp_sum, values, in_vocab):
    """Fold one tile into a running (max, Σ exp(v − max)); also returns the tile's exp(v − new max)
    and the factor that rescales sums taken against the old max."""
    new_max = tl.maximum(running_max, tl.max(tl.where(in_vocab, values, float("-inf")), axis=0))
    rescale = tl.exp(running_max - new_max)
    e = tl.where(in_vocab, tl.exp(values - new_max), 0.0)
    return new_max, exp_sum * rescale + tl.sum(e, axis=0), e, rescale


@triton.jit
def _log_mixture(s, t, log_1m_beta, log_beta):
    """log((1 − β)·exp s + β·exp t), stable (TRL's logsumexp of the two weighted log-probs)."""
    a = s + log_1m_beta
    b = t + log_beta
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _divergence_row_kernel(
    student_ptr,
    student_stride,
    teacher_ptr,
    teacher_stride,
    V,
    inv_temperature,
    beta,
    log_1m_beta,
    log_beta,
    labels_ptr,
    ignore_index,
    coef_div_ptr,
    coef_ce_ptr,
    div_ptr,
    ce_ptr,
    entropy_ptr,
    MODE: tl.constexpr,
    HAS_CE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row · stride may pass 2**31
    s_row = student_ptr + row * student_stride
    t_row = teacher_ptr + row * teacher_stride

    # Pass 1: both normalisers (and the raw student's for the cross-entropy) in one online sweep. For
    # β ∈ {0, 1}, D = E_w[z_t − z] − lse_t + lse_s (w = q) or E_w[z − z_t] − lse_s + lse_t (w = p): the
    # expectation is a running sum rescaled with w's normaliser.
    s_max = float("-inf")
    s_sum = 0.0
    t_max = float("-inf")
    t_sum = 0.0
    x_max = float("-inf")
    x_sum = 0.0
    gap = 0.0
    pz = 0.0  # Σ exp(z − s_max)·z, for the entropy
    for start in range(0, V, BLOCK_V):
        _, in_vocab, x, z, zt = _load_pair(s_row, t_row, start, V, inv_temperature, BLOCK_V)
        s_max, s_sum, e_s, s_rescale = _online(s_max, s_sum, z, in_vocab)
        t_max, t_sum, e_t, t_rescale = _online(t_max, t_sum, zt, in_vocab)
        if MODE == 0:
            gap = gap * t_rescale + tl.sum(e_t * (zt - z), axis=0)
        if MODE == 1:
            gap = gap * s_rescale + tl.sum(e_s * (z - zt), axis=0)
        if WITH_ENTROPY:
            pz = pz * s_rescale + tl.sum(e_s * z, axis=0)
        if HAS_CE:
            x_max, x_sum, _, _ = _online(x_max, x_sum, x, in_vocab)
    lse_s = s_max + tl.log(s_sum)
    lse_t = t_max + tl.log(t_sum)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, lse_s - pz / s_sum)

    # Pass 2: the generalized JSD and K = KL(p ‖ m), which its gradient needs.
    kl_student = 0.0
    if MODE == 0:
        div = gap / t_sum - lse_t + lse_s
    elif MODE == 1:
        div = gap / s_sum - lse_s + lse_t
    else:
        kl_teacher = 0.0
        for start in range(0, V, BLOCK_V):
            _, in_vocab, _, z, zt = _load_pair(s_row, t_row, start, V, inv_temperature, BLOCK_V)
            s = z - lse_s
            t = zt - lse_t
            log_m = _log_mixture(s, t, log_1m_beta, log_beta)
            kl_student += tl.sum(tl.where(in_vocab, tl.exp(s) * (s - log_m), 0.0), axis=0)
            kl_teacher += tl.sum(tl.where(in_vocab, tl.exp(t) * (t - log_m), 0.0), axis=0)
        div = beta * kl_teacher + (1.0 - beta) * kl_student
    tl.store(div_ptr + row, div)

    if HAS_CE:
        label = tl.load(labels_ptr + row)
        has_label = label != ignore_index
        lse_x = x_max + tl.log(x_sum)
        x_label = tl.load(s_row + label, mask=has_label, other=0.0).to(tl.float32)
        tl.store(ce_ptr + row, tl.where(has_label, lse_x - x_label, 0.0))

    # Pass 3: the gradient w.r.t. the raw student logits, written over them.
    if WITH_GRAD:
        a = tl.load(coef_div_ptr + row) * inv_temperature
        c = tl.load(coef_ce_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols, in_vocab, x, z, zt = _load_pair(s_row, t_row, start, V, inv_temperature, BLOCK_V)
            s = z - lse_s
            t = zt - lse_t
            p = tl.exp(s)
            if MODE == 0:
                grad_z = p - tl.exp(t)
            elif MODE == 1:
                grad_z = p * (s - t - div)
            else:
                grad_z = (1.0 - beta) * p * (s - _log_mixture(s, t, log_1m_beta, log_beta) - kl_student)
            grad = a * grad_z
            if HAS_CE:
                grad += c * (tl.exp(x - lse_x) - tl.where(cols == label, 1.0, 0.0))
            # In place: this tile was read above and no other program touches this row.
            tl.store(s_row + cols, grad.to(student_ptr.dtype.element_ty), mask=in_vocab)


def divergence_rows_(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    coef_div: torch.Tensor | None,
    coef_ce: torch.Tensor | None,
    *,
    mode: int,
    beta: float,
    log_1m_beta: float,
    log_beta: float,
    inv_temperature: float,
    ignore_index: int,
    with_ce: bool,
    with_entropy: bool,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row divergence, cross-entropy and student entropy at the temperature (fp32 [C]; the
    cross-entropy is 0 unless ``with_ce``, the entropy unless ``with_entropy``) of ``student_logits`` /
    ``teacher_logits`` [C, V] (rows with unit column stride). The scalar keywords are the fields of
    ``fastalign.ops.linear_divergence_torch.RowMath``.

    When ``coef_div`` is given, ``student_logits`` is overwritten with the gradient w.r.t. itself of
    ``Σ_i coef_div_i·D_i + coef_ce_i·CE_i`` (``coef_ce`` may then be None when ``with_ce`` is False).
    Default tile: one per row up to 4096 columns (fast under the interpreter, no register spills on
    CUDA).
    """
    rows, vocab = student_logits.shape
    out = torch.zeros((3, rows), dtype=torch.float32, device=student_logits.device)
    with_grad = coef_div is not None
    block = block_v if block_v is not None else min(triton.next_power_of_2(vocab), 4096)
    _divergence_row_kernel[(rows,)](
        student_logits,
        student_logits.stride(0),
        teacher_logits,
        teacher_logits.stride(0),
        vocab,
        inv_temperature,
        beta,
        log_1m_beta,
        log_beta,
        labels,
        ignore_index,
        coef_div if with_grad else out[0],
        coef_ce if with_grad and with_ce else out[1],
        out[0],
        out[1],
        out[2],
        MODE=mode,
        HAS_CE=with_ce,
        WITH_ENTROPY=with_entropy,
        WITH_GRAD=with_grad,
        BLOCK_V=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return out[0], out[1], out[2]
