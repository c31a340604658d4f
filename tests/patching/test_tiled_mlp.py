"""``fastalign.ops.tiled``: a gated MLP run in token tiles (the patched forward with a tile budget) has
the untiled module's output and gradients (input, every trained parameter, none for frozen ones) in
float64, at token counts that are no multiple of the tile, with LoRA adapters, a 4-bit base and under
activation checkpointing; its dropout masks are replayed in backward; and no [tokens, intermediate]
tensor is ever built."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from fastalign.ops.tiled import tiled_mlp
from fastalign.patching.modules import gated_mlp_forward, mlp_tile_tokens
from tests.conftest import DEVICE

HIDDEN, INTERMEDIATE, TILE = 8, 64, 5
SHAPE = (2, 19, HIDDEN)  # 38 tokens: 7 tiles of 5 and one of 3


def llama_mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=2, num_key_value_heads=2
    )
    return LlamaMLP(config).to(DEVICE, dtype)


def with_lora(mlp: torch.nn.Module, dropout: float = 0.0) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    model = peft.inject_adapter_in_model(config, torch.nn.Sequential(mlp))
    for name, param in model.named_parameters():  # random B: LoRA's update is not zero
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    return mlp


def bind(mlp: torch.nn.Module, backend: str, tile: int | None) -> torch.nn.Module:
    """``mlp`` with the patched forward, tiled at ``tile`` tokens (None: untiled)."""
    budget = None
    if tile is not None:
        budget = tile * _per_token(mlp)
    mlp.forward = types.MethodType(gated_mlp_forward("gate_up_down", False, False, backend, budget), mlp)
    return mlp


def _per_token(mlp: torch.nn.Module) -> int:
    """Bytes per token that ``mlp_tile_tokens`` budgets (one token per tile at a budget of one token's)."""
    x = torch.zeros(1, HIDDEN, dtype=next(mlp.parameters()).dtype, device=DEVICE)
    lora = 2 if any("lora" in name for name, _ in mlp.named_modules()) else 1
    per_token = (2 * INTERMEDIATE + HIDDEN) * x.dtype.itemsize * 2 * lora
    assert mlp_tile_tokens(mlp, x, per_token) == 1 and mlp_tile_tokens(mlp, x, 3 * per_token + 1) == 3
    return per_token


def run(mlp: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, checkpointed: bool = False, forward=None):
    """Output, input gradient and every trained parameter's gradient of ``mlp`` (or ``forward``, which
    uses its parameters) on ``x``."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    forward = forward or mlp
    out = checkpoint(forward, x, use_reentrant=False) if checkpointed else forward(x)
    out.backward(grad)
    grads = {name: p.grad for name, p in mlp.named_parameters() if p.requires_grad}
    frozen = [name for name, p in mlp.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen parameters got gradients: {frozen}"
    return out.detach(), x.grad, grads


def assert_same(tiled, untiled, tol: float = 1e-12) -> None:
    (out, grad_x, grads), (ref_out, ref_grad_x, ref_grads) = tiled, untiled
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_x, ref_grad_x, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=tol, atol=tol, msg=name)


def inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(SHAPE, dtype=dtype, device=DEVICE), torch.randn(SHAPE, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_tiled_mlp_equals_untiled(backend, checkpointed):
    mlp, (x, grad) = llama_mlp(), inputs()
    untiled = run(bind(mlp, backend, None), x, grad)
    assert_same(run(bind(mlp, backend, TILE), x, grad, checkpointed), untiled)


def test_tiled_lora_mlp_trains_the_adapters_only(backend):
    mlp, (x, grad) = with_lora(llama_mlp()), inputs()
    untiled = run(bind(mlp, backend, None), x, grad)
    assert sorted(untiled[2]) == sorted(n for n, _ in mlp.named_parameters() if "lora_" in n)
    assert_same(run(bind(mlp, backend, TILE), x, grad), untiled)
    assert_same(run(bind(mlp, backend, TILE), x, grad, checkpointed=True), untiled)


def test_tiled_lora_dropout_replays_its_masks_in_backward(backend):
    """With dropout the tiled forward draws each tile's mask in turn (not the untiled draw): its output
    and gradients are those of the same tiles run under autograd from the same seed, under checkpointing
    too, and backward leaves the caller's RNG where forward left it."""
    mlp, (x, grad) = with_lora(llama_mlp(), dropout=0.5), inputs()
    untiled = bind(mlp, backend, None).forward

    def tile_by_tile(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([untiled(tile) for tile in x.reshape(-1, HIDDEN).split(TILE)]).reshape(x.shape)

    torch.manual_seed(1)
    expected = run(mlp, x, grad, forward=tile_by_tile)
    bind(mlp, backend, TILE)
    for checkpointed in (False, True):
        torch.manual_seed(1)
        assert_same(run(mlp, x, grad, checkpointed), expected)
    torch.manual_seed(1)
    out = mlp(x.detach().requires_grad_())
    after_forward = rng_state()
    out.backward(grad)
    assert all(map(torch.equal, rng_state(), after_forward))
    torch.manual_seed(2)
    assert not torch.equal(mlp(x), expected[0])  # the masks are random: the test above can tell them apart


def rng_state() -> list[torch.Tensor]:
    """The generators dropout may draw from: the CPU's, and the GPU's where the test runs on one."""
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if DEVICE.type == "cuda" else [])


def test_tiled_mlp_over_a_4bit_base(backend):
    """QLoRA: the FourBitLinear projections are frozen (no gradient), the adapters over them trained."""
    from fastalign.quant import QuantOptions, quantize_linear

    mlp = llama_mlp(torch.float32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, quantize_linear(getattr(mlp, name), QuantOptions(backend=backend)))
    mlp = with_lora(mlp)
    x, grad = inputs(torch.float32)
    untiled = run(bind(mlp, backend, None), x, grad)
    assert_same(run(bind(mlp, backend, TILE), x, grad), untiled, tol=1e-5)


def test_short_sequences_take_the_untiled_path(backend):
    mlp = bind(llama_mlp(), backend, len(torch.empty(SHAPE).reshape(-1, HIDDEN)))
    out = mlp(torch.randn(SHAPE, dtype=torch.float64, device=DEVICE, requires_grad=True))
    assert "TiledMLP" not in type(out.grad_fn).__name__
    longer = mlp(torch.randn(3, 19, HIDDEN, dtype=torch.float64, device=DEVICE, requires_grad=True))
    assert "TiledMLP" in type(longer.grad_fn.next_functions[0][0]).__name__


class _Largest(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("lora", [False, True])
def test_no_tensor_outgrows_a_tile(lora):
    """Forward and backward, checkpointed, of a tiled MLP build no tensor above one tile's [tile,
    intermediate] or a weight (the sequence's [tokens, hidden] input, output and gradients are smaller
    here), where the untiled one builds [tokens, intermediate]."""
    tokens = SHAPE[0] * SHAPE[1]
    assert tokens * HIDDEN <= TILE * INTERMEDIATE < tokens * INTERMEDIATE
    mlp = llama_mlp()
    mlp = with_lora(mlp) if lora else mlp
    x, grad = inputs()
    largest = {}
    for tile in (TILE, None):
        bind(mlp, "torch", tile)
        with _Largest() as mode:
            run(mlp, x, grad, checkpointed=True)
        largest[tile] = mode.largest
    weight = INTERMEDIATE * HIDDEN  # a projection's weight and its gradient
    assert largest == {TILE: max(TILE * INTERMEDIATE, weight), None: tokens * INTERMEDIATE}


def test_tiled_mlp_without_gradients_runs_tile_by_tile():
    seen = []
    x = torch.randn(SHAPE, device=DEVICE)

    def fn(tile):
        seen.append(len(tile))
        return 2 * tile

    with torch.no_grad():
        assert torch.equal(tiled_mlp(fn, x, TILE), 2 * x)
    assert seen == [TILE] * 7 + [3]


@pytest.mark.parametrize("model_type", ["llama", "phi3"])  # separate gate and up, one fused gate_up
def test_patch_model_tiled_mlp_under_checkpointing_equals_untiled(model_type, monkeypatch):
    """``patch_model(tiled_mlp=True)`` with activation checkpointing: the loss and every gradient of the
    untiled, uncheckpointed patched model in float64 (and ``FASTALIGN_TILED_MLP=1`` turns it on)."""
    import copy

    import fastalign
    from fastalign.builtin import tiny_model
    from tests.patching.test_patch_model import padded_batch

    batch = padded_batch()
    untiled = fastalign.patch_model(tiny_model(model_type, dtype=torch.float64), backend="torch")
    monkeypatch.setenv("FASTALIGN_TILED_MLP", "1")
    tiled = fastalign.patch_model(copy.deepcopy(untiled), backend="torch", tiled_mlp_budget_mib=0.02)
    mlp, tokens = tiled.model.layers[0].mlp, batch["input_ids"].numel()
    assert (
        1
        < mlp_tile_tokens(mlp, torch.zeros(1, tiled.config.hidden_size, dtype=torch.float64), 2**20 // 50)
        < tokens
    )
    tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled.train(), untiled.train()
    losses = [model(**batch).loss for model in (untiled, tiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), (_, b) in zip(untiled.named_parameters(), tiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
