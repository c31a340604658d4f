"""The rollout engine's decode steps at a fixed shape, replayed as CUDA graphs on a GPU.

Why: a decode step of a model of a few billion parameters on a GPU reads its weights in about a
millisecond, but launches a few hundred kernels from Python to do it (each layer's norms, projections,
rotary embedding, attention, activation), so the step costs its launches, not its reads. A CUDA graph
records those launches once and replays them with one call. A graph replays fixed addresses and shapes,
which the engine's eager steps do not have: their KV cache and attention mask grow by a position every
step, and compactions shrink the batch.

How (``StaticSteps``): after the prefill every full-attention layer already holds its keys and values in
a buffer of the final length (``ReservedLayer.reserve``); ``ReservedLayer.make_static`` zeroes its tail
and makes ``update`` write a step's keys and values at a position held in a device tensor (``index_copy_``)
and return the whole buffer. The step attends over all of it under a 4-D boolean mask [R, 1, 1, L] whose
column is switched on as each position fills (transformers passes a 4-D mask through as it is). The
inputs (token ids, positions, the mask, the write position) are tensors updated in place between steps, so
one captured graph serves every step of a batch size. Rows that end keep stepping (their tokens are
discarded) until the running ones fit in half the batch; then every buffer is compacted and the next size
is captured (at most log2 of the rows, a call). The logits processors and the draw run outside the graph,
as in the eager steps: they read the growing ids.

Where: on CUDA, for a model attending with sdpa through transformers' attention functions whose cache
layers are all full attention, in eval mode (no dropout draws), not quantized, not sharded
(``static_refusal``). A capture that fails falls back to these steps run eagerly, said once in the log.
Elsewhere the engine steps eagerly (``fastalign.sampling.generation``). On a CPU these steps are slower
than the eager ones (they attend over the whole buffer, and a CPU has no launches to save: on
SmolLM2-135M, 32 rows × 32 tokens, one thread, transformers' compiled static-cache ``generate`` took 9.47 s
a call against 8.8 s eager, after a 39 s compile), so they run there only in tests, which check the same
tokens as ``generate`` on every family.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import torch

from fastalign.models.structure import base_model
from fastalign.sampling.decode_cache import ReservedLayer
from fastalign.sampling.prefix_attention import can_share

logger = logging.getLogger(__name__)

#: Marks of a quantized layer's class name (bitsandbytes' Linear4bit and Linear8bitLt, fastalign's
#: FourBitLinear): their kernels are not known to be capturable.
_QUANTIZED = ("4bit", "8bit", "FourBit")
#: Graph captures and failed captures, counted over the process (the GPU check reports them).
CAPTURES: collections.Counter = collections.Counter()


def static_refusal(model: torch.nn.Module, cache, synced: bool) -> str | None:
    """Why the decode steps of ``model`` over ``cache`` (the engine's, before its prefill or after) cannot
    run at a fixed shape (None: they can)."""
    if synced:
        return "its ranks step together (a sharded model)"
    kinds = {type(layer) for layer in cache.layers}
    kinds |= {cache.layer_class_to_replicate} if getattr(cache, "layer_class_to_replicate", None) else set()
    if kinds != {ReservedLayer}:
        return "its cache has layers other than full attention (a sliding window, a shared prefix, ...)"
    if not can_share(model):
        return "it does not attend with sdpa through transformers' attention functions"
    if model.training:
        return "it is in training mode"
    if getattr(base_model(model), "hf_quantizer", None) is not None or any(
        any(mark in type(module).__name__ for mark in _QUANTIZED) for module in model.modules()
    ):
        return "its weights are quantized"
    return None


class StaticSteps:
    """Decode steps over ``cache`` (reserved for ``tokens`` more positions after the [R, P] prompts of
    ``mask``) at a fixed shape: replayed as a CUDA graph with ``graphs``, run eagerly without."""

    def __init__(self, model: torch.nn.Module, cache, mask: torch.Tensor, tokens: int, graphs: bool):
        rows, width = mask.shape
        device = mask.device
        self.model, self.cache, self.graphs = model, cache, graphs
        self.filled = width  # positions of the buffers written so far (host side)
        self.position = torch.full((1,), width, dtype=torch.long, device=device)  # where a step writes
        self.mask = torch.zeros(rows, 1, 1, width + tokens, dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :width] = mask.bool()
        self.positions = mask.long().sum(-1, keepdim=True) - 1  # each row's last position; a step adds 1
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        for layer in cache.layers:
            layer.make_static(self.position)
        self.graph = self.logits = None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def keep(self, ended: torch.Tensor) -> torch.Tensor | None:
        """The rows to keep once the running ones fit in half the batch (None: keep stepping all)."""
        running = int((~ended).sum())
        if running == 0 or running > len(ended) // 2:
            return None
        return (~ended).nonzero().squeeze(1)

    def select(self, keep: torch.Tensor) -> None:
        """Only the rows ``keep`` from now on (a batch size of its own: captured anew)."""
        self.cache.batch_select_indices(keep)
        self.mask, self.positions, self.ids = self.mask[keep], self.positions[keep], self.ids[keep]
        self.graph = self.logits = None

    def step(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The next logits [R, V] (float32) of the rows after feeding them ``tokens`` [R] (``mask``, the
        eager steps' growing one, is not read: these steps keep their own)."""
        self.ids.copy_(tokens[:, None])
        self.positions.add_(1)
        self.mask[:, 0, 0, self.filled] = True
        self.position.fill_(self.filled)
        self.filled += 1
        if not self.graphs:
            return self._forward().float()
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        return self.logits.to(torch.float32, copy=True)

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        output = self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1]

    def _capture(self) -> torch.Tensor:
        """This step's logits: run once on a side stream (the warm-up: its writes and logits are this
        step's), then recorded, its outputs ``self.logits`` (a replay repeats its writes to the same
        positions). A capture that fails leaves these steps eager, said once in the log."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _uncached_autocast():
            warm = self._forward().float().clone()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                _uncached_autocast(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                self.logits = self._forward()
        except Exception as failure:  # a kernel that cannot be captured: the same steps, eagerly
            CAPTURES["failed"] += 1
            if CAPTURES["failed"] == 1:
                logger.warning("rollout decoding runs without CUDA graphs: a capture failed (%s)", failure)
            self.graphs, self.logits = False, None
            return warm
        CAPTURES["captured"] += 1
        self.graph = graph
        return warm


def _uncached_autocast():
    """Autocast as it is, but casting the weights inside the step: autocast's cache of cast weights is
    emptied when its context ends, and a graph that recorded reads of a cached cast would replay reads
    of freed memory."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
