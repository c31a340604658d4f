"""fastalign.ops.apply_rotary_pos_emb, both backends, against float64, with the model's own cos/sin."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from fastalign.builtin import tiny_config
from fastalign.ops import apply_rotary_pos_emb
from fastalign.ops.rope import rope_reference
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference

BATCH, HEADS_Q, HEADS_K, SEQ, HEAD_DIM = 2, 4, 2, 7, 16


def _cos_sin(position_ids, dtype, rotary_dim=HEAD_DIM):
    config = tiny_config("llama", head_dim=rotary_dim, rope_scaling={"rope_type": "linear", "factor": 2.0})
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    x = torch.zeros(1, device=DEVICE, dtype=dtype)
    return rotary(x, position_ids)


def _qk(dtype):
    # As in the models: projected [B, S, H, D] then transposed, so q and k are strided views.
    q = torch.randn(BATCH, SEQ, HEADS_Q, HEAD_DIM, device=DEVICE).to(dtype).transpose(1, 2)
    k = torch.randn(BATCH, SEQ, HEADS_K, HEAD_DIM, device=DEVICE).to(dtype).transpose(1, 2)
    return q.requires_grad_(), k.requires_grad_()


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 12], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("positions", ["per-row-packed", "shared"])
def test_forward_and_backward_match_float64(backend, dtype, rotary_dim, positions):
    if positions == "shared":
        position_ids = torch.arange(SEQ, device=DEVICE)[None]  # cos/sin broadcast over the batch
    else:  # two packed sequences per row: positions restart
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]], device=DEVICE)
    cos, sin = _cos_sin(position_ids, dtype, rotary_dim)
    q, k = _qk(dtype)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, backend=backend)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q_ref, k_ref = rope_reference(q64, k64, cos.double(), sin.double())
    assert_close_to_reference("q", q_out.detach(), q_ref.detach(), dtype)
    assert_close_to_reference("k", k_out.detach(), k_ref.detach(), dtype)

    up_q, up_k = torch.randn(q.shape, device=DEVICE), torch.randn(k.shape, device=DEVICE)
    ((q_out.float() * up_q).sum() + (k_out.float() * up_k).sum()).backward()
    ((q_ref * up_q.double()).sum() + (k_ref * up_k.double()).sum()).backward()
    assert_close_to_reference("grad q", q.grad, q64.grad, dtype)
    assert_close_to_reference("grad k", k.grad, k64.grad, dtype)


def test_bad_shapes():
    q, k = _qk(torch.float32)
    cos, sin = _cos_sin(torch.arange(SEQ, device=DEVICE)[None], torch.float32)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary_pos_emb(q, k, cos[:, :-1], sin[:, :-1])
    with pytest.raises(ValueError, match="q and k"):
        apply_rotary_pos_emb(q[0], k, cos, sin)
