"""fastalign.ops.linear_pair_objective (and the linear_sequence_objective under it), both backends,
against the same loss on float64 logits.

The loss is a DPO-like pair loss with an NLL term and per-pair constants (a reference), so every input
of ``PairSums`` carries a gradient; sizes are odd, some tokens are ignored (with NaN hidden states
there), and the chunk sizes make each pair its own chunk (a pair larger than the chunk) or group
several pairs per chunk.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastalign.ops import token_logprobs
from fastalign.ops.linear_pair_objective import PairSums, linear_pair_objective
from fastalign.ops.linear_sequence_objective import linear_sequence_objective, unit_chunks
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, require

PAIRS, SEQ, DIM, VOCAB = 3, 7, 11, 37
IGNORE = -100
BETA = 0.7


def make_inputs(dtype):
    hidden = torch.randn(2 * PAIRS, SEQ, DIM, device=DEVICE).to(dtype)
    weight = (torch.randn(VOCAB, DIM, device=DEVICE) * 2 / DIM**0.5).to(dtype)
    bias = (torch.randn(VOCAB, device=DEVICE) * 0.1).to(dtype)
    targets = torch.randint(0, VOCAB, (2 * PAIRS, SEQ), device=DEVICE)
    targets[:, :2] = IGNORE  # a prompt
    targets[1, -3:] = IGNORE  # padding, with NaN hidden states
    hidden[1, -3:] = float("nan")
    targets[PAIRS + 2, 4] = IGNORE
    weights = torch.rand(2 * PAIRS, SEQ, device=DEVICE) + 0.5
    return hidden, weight, bias, targets, weights


REF = torch.tensor([0.3, -0.2, 0.1, -0.4, 0.25, 0.05])  # reference log-probs: chosen, then rejected


def pair_loss(index, chosen, rejected, chosen_tokens):
    """Σ over the pairs ``index`` of −logσ(β(Δπ − Δref)) / P, plus 0.3 · their chosen NLL / 10."""
    ref_chosen, ref_rejected = REF[:PAIRS].to(chosen)[index], REF[PAIRS:].to(chosen)[index]
    margin = BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin).sum() / PAIRS - 0.3 * chosen_tokens.sum() / 10


def reference(hidden, weight, bias, targets, weights, softcap=None):
    """The loss, sequence sums and entropies from float64 logits (capped at ``softcap``: s·tanh(x/s)),
    differentiated by autograd."""
    valid = targets != IGNORE
    logits = torch.where(valid[..., None], hidden.double(), 0.0) @ weight.double().T + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = logits.log_softmax(-1)
    token = torch.where(valid, logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1), 0.0)
    weighted = (token * (1.0 if weights is None else weights.double())).sum(-1)
    plain = token.sum(-1)
    index = torch.arange(PAIRS)
    loss = pair_loss(index, weighted[:PAIRS], weighted[PAIRS:], plain[:PAIRS])
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    log_sum_sq = torch.logsumexp(2 * logp, -1)
    aligned = torch.where(valid, token - log_sum_sq, 0.0).sum(-1)
    return loss, weighted, plain, entropy, aligned


def call(hidden, weight, bias, targets, weights, backend, chunk_size, softcap=None):
    def loss_fn(index: torch.Tensor, sums: PairSums) -> torch.Tensor:
        assert sums.aligned_chosen is not None and sums.aligned_chosen.shape == index.shape
        return pair_loss(index.cpu(), sums.chosen, sums.rejected, sums.chosen_tokens)

    return linear_pair_objective(
        hidden,
        weight,
        targets,
        loss_fn,
        bias,
        token_weights=weights,
        return_entropy=True,
        return_aligned=True,
        softcap=softcap,
        chunk_size=chunk_size,
        backend=backend,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [3, 16], ids=["pair-per-chunk", "pairs-per-chunk"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "token-weights"])
def test_loss_sums_and_gradients_equal_float64(backend, dtype, chunk_size, weighted):
    hidden, weight, bias, targets, weights = make_inputs(dtype)
    weights = weights if weighted else None
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = call(*leaves, targets, weights, backend, chunk_size)
    out.loss.backward()

    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref_loss, ref_weighted, ref_plain, ref_entropy, ref_aligned = reference(*ref_leaves, targets, weights)
    ref_loss.backward()

    assert_close_to_reference("loss", out.loss.reshape(1), ref_loss.reshape(1), dtype)
    assert_close_to_reference("logps", out.logps, ref_weighted, dtype)
    assert_close_to_reference("token_sums", out.token_sums, ref_plain, dtype)
    assert_close_to_reference("entropy", out.entropy, ref_entropy, dtype)
    assert_close_to_reference("aligned", out.aligned, ref_aligned, dtype)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, ref_leaves, strict=True):
        grad = torch.nan_to_num(leaf.grad, nan=1e9)  # a NaN anywhere would fail loudly
        assert_close_to_reference(f"grad {name}", grad, ref.grad, dtype)
    assert torch.equal(leaves[0].grad[1, -3:], torch.zeros_like(leaves[0].grad[1, -3:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [3, 16], ids=["pair-per-chunk", "pairs-per-chunk"])
def test_a_final_logit_softcap_equals_float64(backend, dtype, chunk_size):
    """Gemma-2's softcap s·tanh(x/s) (here 1.5, where the logits spread over several units, so the cap
    bends them) in the loss, the sums, the entropy, WPO's statistic and every gradient."""
    hidden, weight, bias, targets, weights = make_inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = call(*leaves, targets, weights, backend, chunk_size, softcap=1.5)
    out.loss.backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref_loss, ref_weighted, ref_plain, ref_entropy, ref_aligned = reference(
        *ref_leaves, targets, weights, 1.5
    )
    ref_loss.backward()
    uncapped = reference(*(t.detach().double() for t in (hidden, weight, bias)), targets, weights)
    assert (uncapped[1] - ref_weighted).abs().max() > 0.5  # the cap changes the log-probs

    assert_close_to_reference("loss", out.loss.reshape(1), ref_loss.reshape(1), dtype)
    assert_close_to_reference("logps", out.logps, ref_weighted.detach(), dtype)
    assert_close_to_reference("token_sums", out.token_sums, ref_plain.detach(), dtype)
    assert_close_to_reference("entropy", out.entropy, ref_entropy.detach(), dtype)
    assert_close_to_reference("aligned", out.aligned, ref_aligned.detach(), dtype)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, ref_leaves, strict=True):
        grad = torch.nan_to_num(leaf.grad, nan=1e9)
        assert_close_to_reference(f"grad {name}", grad, ref.grad, dtype)


def test_without_gradients_the_sums_are_the_same(backend):
    hidden, weight, bias, targets, weights = make_inputs(torch.float32)
    with torch.no_grad():
        out = call(hidden, weight, bias, targets, weights, backend, 16)
    graded = call(hidden, weight.requires_grad_(), bias, targets, weights, backend, 16)
    torch.testing.assert_close(out.loss, graded.loss.detach())
    torch.testing.assert_close(out.logps, graded.logps)


def test_pairs_are_grouped_whole_within_the_chunk():
    counts = [4, 2, 9, 3, 3, 1]  # chosen 0..2, then rejected 0..2: pairs of 7, 5 and 10 tokens
    pairs = [[0, 3], [1, 4], [2, 5]]
    assert unit_chunks(pairs, counts, 12) == [[0, 1, 3, 4], [2, 5]]  # chosen rows first, then rejected
    assert unit_chunks(pairs, counts, 4) == [[0, 3], [1, 4], [2, 5]]  # a pair larger than a chunk: alone
    assert unit_chunks(pairs, counts, 100) == [[0, 1, 2, 3, 4, 5]]


def test_bad_shapes_are_named():
    hidden, weight, _, targets, weights = make_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"hidden must have shape \[2P, T, D\]"):
        linear_pair_objective(hidden[:5], weight, targets[:5], lambda i, s: s.chosen.sum())
    with pytest.raises(ValueError, match="token_weights shape"):
        linear_pair_objective(
            hidden, weight, targets, lambda i, s: s.chosen.sum(), token_weights=weights[:, 1:]
        )


def test_units_must_split_the_sequences_in_groups_of_one_size():
    hidden, weight, _, targets, _ = make_inputs(torch.float32)
    loss = lambda index, sums: sums.logps.sum()  # noqa: E731
    for units in ([[0, 1], [2, 3], [4]], [[0, 1], [2, 3], [4, 4]], [[0, 1, 2], [3, 4], [5]]):
        with pytest.raises(ValueError, match="units must split the 6 sequences"):
            linear_sequence_objective(hidden, weight, targets, loss, units=units)


def test_mean_logits_and_argmax_hits_equal_trls_fused_head(backend):
    """TRL 1.16's ``logits/*`` and ``mean_token_accuracy`` come from its own chunked head's per-token
    ``mean_logits`` (Σ_v z_v / V) and ``is_top1``: the per-sequence sums (``logit_sums``, ``top1``) of
    the pair head and ``token_logprobs``' stats are those, with every other target the argmax."""
    require("trl")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    hidden, weight, bias, targets, _ = make_inputs(torch.float32)
    valid = targets != IGNORE
    top = torch.where(valid[..., None], hidden, 0.0) @ weight.T + bias
    hit = valid & (torch.arange(SEQ, device=DEVICE) % 2 == 0)
    targets = torch.where(hit, top.argmax(-1), targets)
    out = call(hidden, weight, bias, targets, None, backend, 16)
    _, stats = token_logprobs(hidden, weight, targets, bias, return_stats=True, backend=backend)

    outputs = ("mean_logits", "is_top1")
    *_, mean_logits, is_top1 = ChunkedLogProbFunction.apply(
        hidden[valid], weight, bias, targets[valid], 1.0, 16, None, 1.0, outputs
    )
    their_mean = torch.zeros_like(stats.mean_logit).masked_scatter_(valid, mean_logits)
    their_top1 = torch.zeros_like(stats.accuracy).masked_scatter_(valid, is_top1)
    assert int(their_top1.sum()) >= int(hit.sum())  # the argmax targets hit, a few others may
    torch.testing.assert_close(stats.mean_logit, their_mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(stats.accuracy, their_top1)
    torch.testing.assert_close(out.logit_sums, their_mean.sum(-1), rtol=1e-5, atol=1e-6)
    assert torch.equal(out.top1, their_top1.sum(-1).float())


def test_argmax_hits_with_tied_bf16_logits_equal_trls(backend):
    """With bf16 logits where the target ties an earlier token for the maximum, the pair head's per-sequence
    ``top1`` and ``token_logprobs``' accuracy count it as TRL's ``is_top1`` does (``argmax == target``:
    not a hit); only the first tied column is."""
    require("trl")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    hidden, weight, bias, targets, _ = make_inputs(torch.bfloat16)
    tied = torch.tensor([2, 17, 30], device=DEVICE)
    weight[tied], bias[tied] = 0.0, 8.0
    valid = targets != IGNORE
    cycling = tied[torch.arange(targets.numel(), device=DEVICE) % 3].view_as(targets)
    targets = torch.where(valid, cycling, IGNORE)
    hits = targets == tied[0]
    out = call(hidden, weight, bias, targets, None, backend, 16)
    _, stats = token_logprobs(hidden, weight, targets, bias, return_stats=True, backend=backend)
    *_, is_top1 = ChunkedLogProbFunction.apply(
        hidden[valid], weight, bias, targets[valid], 1.0, 16, None, 1.0, ("is_top1",)
    )
    their_top1 = torch.zeros_like(stats.accuracy).masked_scatter_(valid, is_top1)
    assert torch.equal(their_top1, hits) and hits.any()
    assert torch.equal(stats.accuracy, their_top1)
    assert torch.equal(out.top1, their_top1.sum(-1).float())
