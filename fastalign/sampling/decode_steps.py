"""The rollout engine's decode steps: eager ones at the batch's current shape (``EagerSteps``), and on a GPU
fixed-shape ones replayed as CUDA graphs (``StaticSteps``). ``fastalign.sampling.generation``'s loop draws
the tokens; a steps object runs the model on them (``step``) and says when to compact the batch (``keep``,
``select``).

Why graphs: a decode step of a model of a few billion parameters on a GPU reads its weights in about a
millisecond, but launches a few hundred kernels from Python to do it (each layer's norms, projections,
rotary embedding, attention, activation), so the step costs its launches, not its reads. A CUDA graph
records those launches once and replays them with one call. A graph replays fixed addresses and shapes,
which the eager steps do not have: their KV cache and attention mask grow by a position every step, and
compactions shrink the batch.

How (``StaticSteps``): after the prefill every full-attention layer already holds its keys and values in
a buffer of the final length (``ReservedLayer.reserve``); ``ReservedLayer.make_static`` zeroes its tail
and makes ``update`` write a step's keys and values at a position held in a device tensor (``index_copy_``)
and return the whole buffer. The step attends over all of it under a 4-D boolean mask [R, 1, 1, L] whose
column is switched on as each position fills (transformers passes a 4-D mask through as it is). The
inputs (token ids, positions, the mask, the write position) are tensors updated in place between steps, so
one captured graph serves every step of a batch size. Rows that end keep stepping (their tokens are
discarded) until the running ones fit in half the batch; then every buffer is compacted and the next size
is captured (at most log2 of the rows, a call). The logits processors and the draw run outside the graph:
they read the growing ids.

Before a capture the step runs twice: once as it is (the step's own logits and writes, and whatever a first
call initializes: cuBLAS handles, Triton autotuning), then with CUDA's synchronizing calls made errors
(``torch.cuda.set_sync_debug_mode``): a step that waits on the host (a ``.item()``, a ``nonzero``, a rotary
embedding that compares a device length, a mixture of experts' routing) cannot be captured, and a step that
reads the cache's length on the host (``get_seq_length``) would replay the length it read at the capture.
Either keeps the eager steps from there on, as does a capture that fails (said in the log; the capture's
allocator state is ended by hand, since ``capture_end`` does not end it when CUDA refuses to end the capture).
Each capture takes a memory pool of its own: a pool whose graphs were all released cannot take another capture
(torch asserts), and a compaction releases the batch's graph. A graph's first replay is then checked against
the same step run eagerly (``REPLAY_TOLERANCE``), which catches whatever else the capture froze that changes
between steps; a replay that differs also leaves the eager steps. Under autocast the graph reads the weights
autocast cast and cached in the first run: the cache lives until the outermost autocast ends, after the call.

Where: on CUDA, for a model attending with sdpa through transformers' attention functions whose cache layers
are all full attention, in eval mode, not quantized, not a mixture of experts, on one device, not sharded
(``static_refusal``), with a rotary embedding that does not change with the length (``generation``). On a CPU
the fixed-shape steps are slower than the eager ones (they attend over the whole buffer, and a CPU has no
launches to save: on SmolLM2-135M, 32 rows × 32 tokens, one thread, transformers' compiled static-cache
``generate`` took 9.47 s a call against 8.8 s eager, after a 39 s compile), so they run there only in tests,
which check the same tokens as ``generate`` on every family, and the control flow around the graphs with
``torch.cuda`` stood in for.
"""

from __future__ import annotations

import collections
import logging
import weakref

import torch

from fastalign.models.structure import base_model
from fastalign.sampling.decode_cache import ReservedLayer
from fastalign.sampling.prefix_attention import can_share

logger = logging.getLogger(__name__)

#: Rows that have ended, as a share of the batch, above which the eager steps compact it (each compaction
#: copies the KV cache of the rows that remain; each decode step runs every row in the batch).
COMPACT_SHARE = 1 / 8
#: Marks of a quantized layer's class name (bitsandbytes' Linear4bit and Linear8bitLt, fastalign's
#: FourBitLinear): their kernels are not known to be capturable.
_QUANTIZED = ("4bit", "8bit", "FourBit")
#: Config fields of a mixture of experts, whose routing reads the device on the host.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: A graph's first replay is checked against the same step run eagerly: logits that differ by more than
#: this share of their largest magnitude mean the graph replays something it should not (a value read on
#: the host at its capture), and the eager steps go on.
REPLAY_TOLERANCE = 1e-3
#: Graph captures, and steps kept eager (``uncaptured``: a step that synchronizes, reads the cache's
#: length, or whose capture failed (also ``failed``) or whose replay differed (also ``differed``)),
#: counted over the process (the GPU check reports them).
CAPTURES: collections.Counter = collections.Counter()
#: Models whose step cannot be captured (they decode eagerly from then on; not after running out of memory).
_UNCAPTURABLE: weakref.WeakSet = weakref.WeakSet()
#: Graphs whose capture failed, kept alive: the pinned-memory allocator may still point at them.
_FAILED_GRAPHS: list = []


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
    base = base_model(model)
    if getattr(base, "hf_quantizer", None) is not None or any(
        any(mark in type(module).__name__ for mark in _QUANTIZED) for module in model.modules()
    ):
        return "its weights are quantized"
    config = model.config.get_text_config(decoder=True)
    if any(getattr(config, name, None) for name in _EXPERTS):
        return "it is a mixture of experts (its routing waits on the device)"
    if len({str(device) for device in (getattr(base, "hf_device_map", None) or {}).values()}) > 1:
        return "its layers are spread over devices"
    return None


def may_capture(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decode steps may still be captured in this process: not once a step of it could
    not be (the eager steps then serve it; fixed-shape steps without a graph only attend over more)."""
    return model not in _UNCAPTURABLE


def _next_logits(
    model, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The model's last-position logits [R, V] after the one-token ``ids`` [R, 1] (a decode step over
    ``cache``, which it appends to)."""
    output = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
        logits_to_keep=1,
    )  # fmt: skip
    return output.logits[:, -1]


class EagerSteps:
    """Decode steps at the batch's current shape: the cache and the mask grow a position a step, and once
    an eighth of the rows have ended (``COMPACT_SHARE``) the batch is compacted to the rest. Under
    ``synced`` a rank whose rows have all ended keeps one row stepping."""

    def __init__(self, model: torch.nn.Module, cache, synced: bool):
        self.model, self.cache, self.synced = model, cache, synced

    def keep(self, ended: torch.Tensor) -> torch.Tensor | None:
        """The rows to keep (None: no compaction now)."""
        if ended.sum() < max(1.0, COMPACT_SHARE * len(ended)) or not (self.synced or not ended.all()):
            return None
        keep = (~ended).nonzero().squeeze(1)
        return keep if keep.numel() else torch.zeros(1, dtype=torch.long, device=ended.device)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next logits [R, V] (float32) after ``tokens`` [R], ``mask`` the rows' mask including them."""
        positions = mask.long().sum(-1, keepdim=True) - 1
        return _next_logits(self.model, self.cache, tokens[:, None], mask, positions).float()


class StaticSteps:
    """Decode steps over ``cache`` (reserved for ``tokens`` more positions after the [R, P] prompts of
    ``mask``) at a fixed shape: replayed as a CUDA graph with ``graphs``, run eagerly without (tests)."""

    def __init__(self, model: torch.nn.Module, cache, mask: torch.Tensor, tokens: int, graphs: bool):
        rows, width = mask.shape
        device = mask.device
        self.model, self.cache = model, cache
        self.graphs = graphs and may_capture(model)
        self.eager: EagerSteps | None = None  # the steps from the moment a step could not be captured
        self.filled = width  # positions of the buffers written so far (host side)
        self.position = torch.full((1,), width, dtype=torch.long, device=device)  # where a step writes
        self.mask = torch.zeros(rows, 1, 1, width + tokens, dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :width] = mask.bool()
        self.positions = mask.long().sum(-1, keepdim=True) - 1  # each row's last position; a step adds 1
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        for layer in cache.layers:
            layer.make_static(self.position, width)
        self.graph = self.logits = None
        self.checked = False  # whether a replay of the current graph was checked against an eager run
        self.retry_later = False  # a capture ran out of memory: the model's next call tries again
        # one side stream for every capture: the allocator reuses a freed block on its own stream only
        self.stream = torch.cuda.Stream(device) if self.graphs else None

    def keep(self, ended: torch.Tensor) -> torch.Tensor | None:
        """The rows to keep once the running ones fit in half the batch (None: keep stepping all)."""
        if self.eager is not None:
            return self.eager.keep(ended)
        running = int((~ended).sum())
        if running == 0 or running > len(ended) // 2:
            return None
        return (~ended).nonzero().squeeze(1)

    def select(self, keep: torch.Tensor) -> None:
        """Only the rows ``keep`` from now on (a batch size of its own: captured anew)."""
        self.cache.batch_select_indices(keep)
        if self.eager is None:
            self.mask, self.positions, self.ids = self.mask[keep], self.positions[keep], self.ids[keep]
            self.graph = self.logits = None
            self.checked = False

    def step(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next logits [R, V] (float32) of the rows after feeding them ``tokens`` [R] (``mask``, the
        rows' growing mask, is read only by the eager steps: these keep their own)."""
        if self.eager is not None:
            return self.eager.step(tokens, mask)
        self.ids.copy_(tokens[:, None])
        self.positions.add_(1)
        self.mask[:, 0, 0, self.filled] = True
        self.position.fill_(self.filled)
        for layer in self.cache.layers:
            layer.length = self.filled
        self.filled += 1
        if not self.graphs:
            return self._forward().float()
        if self.graph is None:
            return self._capture()
        with torch.cuda.device(self.position.device):
            self.graph.replay()
        logits = self.logits.to(torch.float32, copy=True)
        if self.checked:
            return logits
        self.checked = True
        eager = self._forward().float()  # the same step again (rewriting the same keys and values)
        if not torch.allclose(
            logits, eager, rtol=REPLAY_TOLERANCE, atol=REPLAY_TOLERANCE * float(eager.abs().max())
        ):
            CAPTURES["differed"] += 1
            self._go_eager("a replay's logits differed from the step run eagerly")
        return eager

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        return _next_logits(self.model, self.cache, self.ids, self.mask, self.positions)

    def _capture(self) -> torch.Tensor:
        """This step's logits, from its first run; then, where the step neither waits on the host nor reads
        the cache's length there, its capture (outputs ``self.logits``; a replay repeats its writes to
        the same positions). Otherwise the eager steps from here on."""
        device = self.position.device
        with torch.cuda.device(device):
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):  # restores the current stream on leaving, whatever happened
                logits = self._forward().float()
                why = self._uncapturable()
                if why is None:
                    why = self._record()
            torch.cuda.current_stream(device).wait_stream(self.stream)
            logits.record_stream(torch.cuda.current_stream(device))  # made on the side stream, used here
        if why is None:
            CAPTURES["captured"] += 1
        else:
            self._go_eager(why)
        return logits

    def _uncapturable(self) -> str | None:
        """Why the step cannot be captured, from a second run with synchronizing calls made errors (for
        every thread of the process during that run: CUDA's sync debug mode is global)."""
        for layer in self.cache.layers:
            layer.length_read = False
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._forward()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as failure:
            return f"a step waits on the device ({str(failure).splitlines()[0]})"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        if any(layer.length_read for layer in self.cache.layers):
            return "a step reads the cache's length on the host"
        return None

    def _record(self) -> str | None:
        """Capture the step on the current (side) stream into a memory pool of its own (a pool whose graphs
        were all released cannot take another capture); why it failed (None: ``self.graph`` holds it)."""
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        device = self.position.device.index
        failure = None
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except Exception as error:
            _end_failed_capture(graph, device, pool)
            return self._failed("the capture did not begin", error)
        try:
            self.logits = self._forward()
        except Exception as error:  # a kernel that cannot be captured, or out of memory
            failure = error
        finally:  # even on an interrupt: the stream must leave capture mode
            try:
                graph.capture_end()
            except Exception as error:
                failure = failure or error
                _end_failed_capture(graph, device, pool)
        if failure is not None:
            return self._failed("the capture failed", failure)
        self.graph = graph
        return None

    def _failed(self, what: str, failure: Exception) -> str:
        """Why a capture failed, counted. Out of memory (a capture takes fresh memory: torch does not
        release its cached blocks to retry while a capture is underway) is this call's, not the model's:
        the next call tries again."""
        CAPTURES["failed"] += 1
        if isinstance(failure, torch.OutOfMemoryError):
            self.retry_later = True
        return f"{what} ({str(failure).splitlines()[0]})"

    def _go_eager(self, why: str) -> None:
        """The eager steps from the next step on, over the cache as filled so far (and for the model's
        later calls too, unless the capture ran out of memory)."""
        CAPTURES["uncaptured"] += 1
        if not self.retry_later:
            _UNCAPTURABLE.add(self.model)
        logger.warning("fastalign: rollout decoding runs without CUDA graphs for this model: %s", why)
        for layer in self.cache.layers:
            layer.make_dynamic(self.filled)
        self.graph = self.logits = None
        self.eager = EagerSteps(self.model, self.cache, synced=False)


def _end_failed_capture(graph, device: int, pool) -> None:
    """What a failed ``capture_begin`` or ``capture_end`` leaves undone: the first registers the pool with
    the allocators before CUDA begins the capture, the second raises before ending the allocator's
    capture where CUDA refused to end it, and the graph never releases the pool. Both are done here (each
    may have been done already or never begun: then it says so and nothing changes). The graph is kept
    alive: the pinned-memory allocator's capture, which has no binding to end it, may still point at it."""
    _FAILED_GRAPHS.append(graph)
    for end in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
        try:
            end(device, pool)
        except RuntimeError:
            pass
