"""Token-tiled recompute of a token-wise block (a gated MLP with its LoRA adapters): its working set is
one tile's, not the sequence's.

At long context a decoder layer's largest tensors are its MLP's: gate and up outputs, the activation and
each LoRA adapter's intermediates are [tokens, intermediate] (Llama-3-70B: about 500 KB a token in bf16),
tens of GB at 64K tokens, created in forward and again when activation checkpointing recomputes the
layer. A token-wise function of [tokens, hidden] can be run on tiles of tokens instead: ``tiled_mlp``'s
forward runs each tile under ``no_grad`` and keeps only the input; its backward runs each tile again
under autograd and differentiates it with that tile's slice of the output gradient, so at any time one
tile's intermediates exist (and the input, the output and the input gradient, all [tokens, hidden]).

The trained parameters are inputs of the autograd node, not reached behind autograd's back: backward
returns their gradient summed over the tiles, which autograd accumulates once, as for any other op (so
``torch.autograd.grad`` on the loss, gradient hooks and data-parallel reducers see it). Under
non-reentrant activation checkpointing the layer's recomputation runs this forward again, which keeps
the input again and builds nothing else; backward is this node's own, run once.

Randomness (LoRA dropout) is replayed: forward keeps the RNG state it started from, and backward restores
it (without disturbing the caller's RNG) and recomputes the tiles in forward order, so each tile draws
the same mask it drew in forward — what ``torch.utils.checkpoint`` does for a whole layer. The masks are
the tiled forward's: a different draw from the untiled module's under the same seed, as the same
dropout at another batch shape would be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: Default working-set budget of one tile.
DEFAULT_BUDGET_MIB = 256


def tile_tokens(budget_bytes: int, per_token_bytes: int) -> int:
    """Tokens in a tile whose working set (``per_token_bytes`` each) fits ``budget_bytes``; at least 1."""
    return max(1, budget_bytes // max(1, per_token_bytes))


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    accelerator = torch.get_device_module(device).get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), accelerator


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], size: int, x: torch.Tensor, *params):
        ctx.fn, ctx.size, ctx.params = fn, size, params
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(tile) for tile in x.split(size)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p, wanted in zip(ctx.params, ctx.needs_input_grad[3:], strict=True) if wanted]
        want_x = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if want_x else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        device_type, dtype, enabled = ctx.autocast
        cpu_state, accelerator_state = ctx.rng
        devices = [x.device] if accelerator_state is not None else []
        with torch.random.fork_rng(devices=devices, device_type=x.device.type):
            torch.set_rng_state(cpu_state)
            if accelerator_state is not None:
                torch.get_device_module(x.device).set_rng_state(accelerator_state, x.device)
            start = 0
            for tile, tile_grad in zip(x.split(ctx.size), grad.split(ctx.size), strict=True):
                tile = tile.detach().requires_grad_(want_x)
                with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    out = ctx.fn(tile)
                wrt = ([tile] if want_x else []) + params
                grads = torch.autograd.grad(out, wrt, tile_grad, allow_unused=True)
                if want_x:
                    grad_x[start : start + len(tile)] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
                start += len(tile)
        by_param = iter(grad_params)
        wanted = ctx.needs_input_grad[3:]
        return None, None, grad_x, *(next(by_param) if w else None for w in wanted)


def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    size: int,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` ([..., hidden] → [..., out], each token on its own), computed
    ``size`` tokens at a time (the leading dimensions flattened), keeping only ``x`` for backward (see
    the module docstring).

    ``params``: the tensors ``fn`` uses whose gradient is wanted (a module's trainable parameters); one
    not listed gets no gradient. With no more tokens than ``size``, or nothing to differentiate, it is
    ``fn(x)`` run in tiles at most (no autograd node).
    """
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= size:
        return fn(x)
    trained = [p for p in params if p.requires_grad]
    if not (torch.is_grad_enabled() and (x.requires_grad or trained)):
        out = torch.cat([fn(tile) for tile in flat.split(size)])
    else:
        out = _TiledMLP.apply(fn, size, flat, *trained)
    return out.reshape(*x.shape[:-1], out.shape[-1])
