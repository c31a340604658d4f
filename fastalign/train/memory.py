"""Activation memory: per-layer checkpointing, and CPU offloading of what the decoder layers save.

Why: at long sequence lengths the activations saved for the backward pass, not the weights, are the
largest term of training memory (layers × tokens × hidden × a dozen saved tensors). Checkpointing
keeps only each decoder layer's input and recomputes the rest in backward (about a third more
compute). Offloading moves the saved tensors to CPU memory during the forward and brings them back
during the backward; it costs host↔device bandwidth (PCIe, or NVLink-C2C on Grace Hopper) and pinned
host memory as large as what it offloads.

What goes to the host: with checkpointing, exactly each decoder layer's checkpointed input (its hidden
states); without, every tensor the decoder layers save for backward (their inputs, attention and MLP
intermediates). Parameters, tensors under ``min_bytes``, and whatever the model saves outside its
decoder layers (the embedding's token ids, the final norm, the loss head) stay where they are.

Where the hooks sit, and why not in per-layer module hooks: PyTorch consults only the innermost
saved-tensor hooks, and torch's non-reentrant checkpoint enters its own around the checkpointed
function, so what is saved inside it is the checkpoint's (to recompute), and only what the checkpoint
itself saves outside them, the layer's inputs, reaches hooks entered outside it. Transformers up to 5.17
checkpoints a layer's ``__call__``, so a layer's module hooks run inside the checkpoint: saved-tensor
hooks entered there became the innermost and took every activation of the layer (checkpointing was in
effect off; a 70B QLoRA step at 8,192 tokens pinned 128 GB of host memory); 5.23 checkpoints
``forward``, and module hooks run outside. So fastalign depends on neither: one ``saved_tensors_hooks``
context spans the forward of the module that runs the layers (``decoder_stack``), outside every
checkpoint, and what it offloads is decided by which layer is running, which a checkpointed layer
reports from a wrapper of its checkpoint function (transformers' ``_gradient_checkpointing_func``, called
by the layer in both placements, outside torch's checkpoint), and other layers from their module hooks.
The wrapper spans the whole checkpoint call: the non-reentrant checkpoint saves its inputs before it
runs the layer, the re-entrant one after (its layer runs without gradients and saves nothing). The
recomputation in backward runs the layer, not the wrapper, after the stack's forward has returned, and
under the checkpoint's own recomputation hooks: nothing is offloaded then. The wrapper is (re)installed
at each forward of the stack, so checkpointing may be enabled before or after offloading.

Host memory: one pinned buffer per offloaded layer, allocated in the first step and reused after
(``_HostPool``), as large as that layer's share of the planner's host term (layers × tokens × hidden ×
dtype bytes with checkpointing); the last ``keep_on_device`` layers' tensors stay on the GPU, where it has
room for them. A run whose share would not fit in the host's available memory is refused in one line
(``HostMemoryError``), before training where the tokens of a forward are known, else at the allocation.

Overlap: the device-to-host copies run on a side CUDA stream while the compute stream goes on with
the layer, and in backward the first unpack of a layer also starts the copies back of the layer
before it (the one backward reaches next), so those run during this layer's backward.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from fastalign.errors import one_line
from fastalign.models.structure import base_model, decoder_layers, decoder_stack
from fastalign.plan.planner import host_margin, usable_host_bytes


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations.

    Non-reentrant checkpointing works with frozen embeddings (LoRA) and with FSDP2; a KV cache is of
    no use in training and is incompatible with recomputation, so ``use_cache`` goes off.
    """
    inner = base_model(model)
    kwargs = {"use_reentrant": False}
    if hasattr(inner, "activation_checkpointing_enable"):  # newer transformers; the old name warns
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inner.config.use_cache = False


def enable_activation_offloading(
    model: nn.Module,
    *,
    min_bytes: int = 1 << 20,
    keep_on_device: int = 0,
    tokens: int | None = None,
    residual_bytes: int | None = None,
    host_processes: int = 1,
) -> ActivationOffloader:
    """Offload what the decoder layers save for backward to CPU memory; ``.remove()`` undoes it.

    Tensors under ``min_bytes`` stay on the device: their copies would cost more than they free. The last
    ``keep_on_device`` layers keep theirs: backward reaches them first, so where the device has room for
    them, copying them out and straight back would only cost bandwidth and host memory. ``tokens``: the
    most tokens of one forward; with checkpointing, a run whose offloaded layer inputs would not fit in
    the host's available memory is refused here, before training (``HostMemoryError``).
    ``residual_bytes``: bytes per element of the layer inputs in training, when that is not the model's
    dtype now (FSDP2's bf16 mixed precision over fp32 weights makes them bf16, 2): the memory planner's
    ``residual_stream_bytes``, so that a run the planner fits is not refused here. None: the model's dtype.
    ``host_processes``: the processes on this machine that offload as much at once (torchrun's local
    ranks): they share its memory, so the check asks room for all of them.
    """
    layers = decoder_layers(model)
    if not 0 <= keep_on_device <= len(layers):
        raise ValueError(f"keep_on_device must be in [0, {len(layers)}] layers, got {keep_on_device}")
    if tokens is not None and any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        hidden = base_model(model).config.get_text_config().hidden_size
        per_layer = tokens * hidden * (residual_bytes or model.dtype.itemsize)
        what = f"{len(layers) - keep_on_device} layer inputs of {tokens:,} tokens"
        if host_processes > 1:
            what += f", for each of the {host_processes} processes on this machine"
        _check_host_memory((len(layers) - keep_on_device) * per_layer * host_processes, what)
    stack = decoder_stack(model)
    if getattr(stack, "_fastalign_offloader", None) is not None:
        # a second offloader's hooks would sit inside the first's and never see a layer begin: the
        # checkpointed layers' inputs would stay on the device, silently
        raise RuntimeError(
            "activation offloading is already on for this model: remove() its offloader before enabling "
            "it again"
        )
    return ActivationOffloader(stack, layers, min_bytes=min_bytes, keep_on_device=keep_on_device)


_PAGE = 4096


class HostMemoryError(MemoryError):
    """Offloading would need more host memory than the machine has available."""


def _available_host_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo: what the host can give without swapping."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _check_host_memory(nbytes: int, what: str) -> None:
    available = _available_host_bytes()
    if nbytes > usable_host_bytes(available):
        raise HostMemoryError(
            f"activation offloading needs {nbytes / 2**30:.1f} GiB of host memory ({what}), more than the "
            f"{available / 2**30:.1f} GiB available less a {host_margin(available) / 2**30:.1f} GiB margin: "
            "keep more layers on the GPU (keep_on_device), shorten the batches, or turn offloading off"
        )


class _OffloadingCheckpoint:
    """A decoder layer's checkpoint function, wrapped: while it runs, what is saved outside torch's
    checkpoint (the layer's inputs) is that layer's to offload."""

    def __init__(self, offloader: ActivationOffloader, index: int, checkpoint: Callable) -> None:
        self.offloader, self.index, self.checkpoint = offloader, index, checkpoint

    def __call__(self, function: Callable, *args, **kwargs):
        self.offloader._layer = self.index
        try:
            return self.checkpoint(function, *args, **kwargs)
        finally:
            self.offloader._layer_done()


def _checkpointed(layer: nn.Module) -> bool:
    """Whether this call of ``layer`` runs under transformers' checkpoint (``GradientCheckpointingLayer``)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


class _Offloaded:
    """A saved activation held in CPU memory (a view of a pool buffer), and where its copies stand. Its
    memory goes back to the pool when autograd drops it (the graph is freed)."""

    __slots__ = ("__weakref__", "cpu", "device", "event", "give_back", "group", "on_device")

    def __init__(
        self,
        cpu: torch.Tensor,
        give_back: Callable[[], None],
        device: torch.device,
        group: int,
        event: torch.cuda.Event | None,
    ):
        self.cpu, self.give_back, self.device, self.group, self.event = cpu, give_back, device, group, event
        self.on_device: torch.Tensor | None = None  # the copy back, once started

    def __del__(self) -> None:
        self.give_back()


_ALIGNMENT = 64  # bytes: each tensor in a buffer starts on a cache line, aligned for any dtype


class _LayerBuffer:
    """One decoder layer's host memory: ``buffer``, filled from ``used``; ``extra`` buffers for what did
    not fit this round; ``taken`` bytes in all this round, by ``live`` tensors; ``grow_to``: the size of
    the buffer the next round allocates first (set when a round outgrew the buffer)."""

    __slots__ = ("buffer", "extra", "grow_to", "live", "taken", "used")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.extra: list[torch.Tensor] = []
        self.used = self.taken = self.live = self.grow_to = 0


class _HostPool:
    """Host memory for offloaded tensors: one buffer per decoder layer, allocated once, reused every step.

    Per layer because a layer's tensors come back together (its backward): once the last is given back,
    the next forward fills the buffer from the start. What does not fit (the first step, a longer batch,
    a second forward before a backward) gets a buffer of its own for that round; once all of the layer's
    tensors are back these are freed, and the layer's next round first allocates one buffer of their
    total (in the forward, where a ``HostMemoryError`` reaches the caller: giving a tensor back runs in
    a finalizer, which would swallow it). With checkpointing a layer's round is its one input, whose own
    buffer simply stays. The pool grows to the largest round and stays there: with checkpointing,
    layers × tokens × hidden × dtype bytes, the planner's host term (``fastalign.plan``), and no
    allocation at all in the steps after the first.

    Pinned with ``cudaHostRegister`` on exact-size pageable allocations, not ``torch.empty(...,
    pin_memory=True)``: PyTorch's pinned-memory cache rounds each block up to a power of two (up to
    twice the memory) and keeps all it ever pinned. Where pinning fails, pageable memory, with one
    warning (the copies are then synchronous). Each allocation first checks the host's available memory
    (``HostMemoryError``), so a run whose offloading outgrows the host stops with a message instead of
    being killed.
    """

    def __init__(self, *, pin: bool, synchronize: Callable[[], None]) -> None:
        self.pin = pin
        self.allocations = 0  # buffers allocated, pinned or not
        self._synchronize = synchronize  # waits for the copies in flight, before a buffer is freed
        self._layers: dict[int, _LayerBuffer] = {}
        self._pinned: set[int] = set()

    @property
    def capacity(self) -> int:
        """Bytes held, in use or not."""
        return sum(buffer.numel() for buffer in self._buffers())

    def take(self, layer: int, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``nbytes`` of host memory (uint8) for a tensor of ``layer``, and the call that gives them back."""
        slot = self._layers.setdefault(layer, _LayerBuffer())
        if slot.grow_to:  # here, in the forward, a failure (HostMemoryError) reaches the caller
            slot.buffer, slot.grow_to = self._allocate(slot.grow_to), 0
        size = -(-nbytes // _ALIGNMENT) * _ALIGNMENT
        if slot.buffer is not None and slot.used + size <= slot.buffer.numel():
            memory = slot.buffer[slot.used : slot.used + size]
            slot.used += size
        else:
            memory = self._allocate(size)
            slot.extra.append(memory)
        slot.taken += size
        slot.live += 1
        return memory[:nbytes], functools.partial(self._give_back, slot)

    def _give_back(self, slot: _LayerBuffer) -> None:
        slot.live -= 1
        if slot.live:
            return
        if slot.buffer is None and len(slot.extra) == 1:
            slot.buffer = slot.extra[0]
        elif slot.extra:  # freed now; the larger one is allocated by the next take(), not in a finalizer
            self._free([*slot.extra, *([slot.buffer] if slot.buffer is not None else [])])
            slot.buffer, slot.grow_to = None, slot.taken
        slot.extra, slot.used, slot.taken = [], 0, 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        _check_host_memory(nbytes, f"{self.capacity / 2**30:.1f} GiB held already, {nbytes:,} bytes more")
        # cudaHostRegister pins whole pages: a buffer sharing a page with another registered one would be
        # refused, so each starts on a page boundary of an allocation one page longer
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        buffer = raw[-raw.data_ptr() % _PAGE :][:nbytes]
        self.allocations += 1
        if self.pin:
            try:
                _check_cuda(
                    torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0), "cudaHostRegister"
                )
                self._pinned.add(buffer.data_ptr())
            except RuntimeError as error:
                _clear_cuda_error()
                self.pin = False
                warnings.warn(
                    f"activation offloading: pinning host memory failed ({one_line(error)}); it goes on "
                    "in pageable memory, whose copies do not overlap compute",
                    stacklevel=2,
                )
        return buffer

    def _free(self, buffers: list[torch.Tensor]) -> None:
        self._synchronize()  # no copy may still read or write them
        for buffer in buffers:
            if buffer.data_ptr() in self._pinned:
                self._pinned.discard(buffer.data_ptr())
                _check_cuda(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()), "cudaHostUnregister")

    def _buffers(self) -> list[torch.Tensor]:
        return [b for slot in self._layers.values() for b in (*slot.extra, slot.buffer) if b is not None]

    def __del__(self) -> None:
        if self._pinned:
            self._free(self._buffers())


def _check_cuda(error: object, call: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"{call} failed with cudaError {int(error)}")


def _clear_cuda_error() -> None:
    """Read and so clear the error a failed CUDA call left as CUDA's last error: PyTorch checks that
    after its next kernel launch, which would fail with it. A kernel launched here takes it instead."""
    if not torch.cuda.is_available():  # (nothing to clear)
        return
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


class ActivationOffloader:
    """Saved-tensor hooks entered around the decoder stack's forward; what a decoder layer saves while it
    runs (or, checkpointed, what its checkpoint saves) is offloaded, grouped by that layer's call.

    Counters: ``offloaded_tensors``/``offloaded_bytes`` went to CPU; ``restored_tensors`` came back,
    ``prefetched_tensors`` of them before their layer's backward started; ``kept_on_device`` were on
    CPU already; ``kept_in_last_layers`` were saved by the last ``keep_on_device`` layers;
    ``skipped_small`` were under ``min_bytes``; ``skipped_parameters`` were weights or views of them,
    which stay alive anyway. ``pool``: the host memory (``None`` until the first tensor is offloaded).
    """

    _force_copy: bool = False  # tests: send CPU tensors through the offload path as if on CUDA

    def __init__(
        self, stack: nn.Module, layers: list[nn.Module], *, min_bytes: int, keep_on_device: int = 0
    ) -> None:
        self.min_bytes = min_bytes
        self.offloaded_tensors = self.offloaded_bytes = self.restored_tensors = self.prefetched_tensors = 0
        self.kept_on_device = self.kept_in_last_layers = self.skipped_small = self.skipped_parameters = 0
        self.pool: _HostPool | None = None
        self._layers = layers
        self._offloaded_layers = len(layers) - keep_on_device
        self._first_group = 0  # groups number the layer calls of all forwards: backward meets them reversed
        self._layer: int | None = None  # the decoder layer whose saved tensors are offloaded now, if any
        self._groups: dict[int, weakref.WeakSet[_Offloaded]] = {}  # the graph owns the entries
        self._context: saved_tensors_hooks | None = None
        self._copying: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # sources of this layer's copies
        self._copied: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # and of the previous layer's
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stack = stack
        stack._fastalign_offloader = self  # one offloader a model (enable_activation_offloading)
        self._handles = [
            stack.register_forward_pre_hook(self._enter),
            stack.register_forward_hook(self._exit, always_call=True),
        ]
        for index, layer in enumerate(layers):
            self._handles.append(
                layer.register_forward_pre_hook(functools.partial(self._layer_begins, index))
            )
            self._handles.append(layer.register_forward_hook(self._layer_ends, always_call=True))

    def remove(self) -> None:
        """Remove the hooks and the checkpoint wrappers; tensors offloaded already still come back in
        backward. The host pool is let go: its memory returns once the last tensor in it has come back
        (the pool and this offloader refer to each other, so without this it would wait for Python's
        cycle collector: measured on an H100, a second offloader's pool was pinned beside the first's)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self._stack, "_fastalign_offloader", None) is self:
            self._stack._fastalign_offloader = None
        for layer in self._layers:
            wrapper = getattr(layer, "_gradient_checkpointing_func", None)
            if isinstance(wrapper, _OffloadingCheckpoint) and wrapper.offloader is self:
                layer._gradient_checkpointing_func = wrapper.checkpoint
        self._release(self._copying)
        self._release(self._copied)
        self.pool = None

    def _enter(self, module: nn.Module, args: tuple) -> None:
        for index, layer in enumerate(self._layers):
            checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
            if checkpoint is not None and not isinstance(checkpoint, _OffloadingCheckpoint):
                layer._gradient_checkpointing_func = _OffloadingCheckpoint(self, index, checkpoint)
        self._groups = {group: entries for group, entries in self._groups.items() if entries}  # freed graphs
        self._first_group += len(self._layers)
        self._context = saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._layer = None
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _layer_begins(self, index: int, layer: nn.Module, args: tuple) -> None:
        if self._context is not None and not _checkpointed(layer):  # (a checkpointed one: the wrapper)
            self._layer = index

    def _layer_ends(self, layer: nn.Module, args: tuple, output: object) -> None:
        if self._context is not None and not _checkpointed(layer):
            self._layer_done()

    def _layer_done(self) -> None:
        self._layer = None
        self._release(self._copied)  # a layer later, those copies are done (or nearly)
        self._copied, self._copying = self._copying, []

    @torch.no_grad()
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if self._layer is None:
            return tensor
        base = tensor if tensor._base is None else tensor._base
        # Weights stay alive anyway. Not every leaf that requires grad does: with a frozen embedding,
        # transformers' ``enable_input_require_grads`` makes its output one, the first layer's input.
        if isinstance(base, nn.Parameter):
            self.skipped_parameters += 1
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_bytes:  # (torch < 2.13's checkpoint saves an empty tensor)
            self.skipped_small += 1
            return tensor
        if self._layer >= self._offloaded_layers:
            self.kept_in_last_layers += 1
            return tensor
        if not (tensor.is_cuda or (tensor.device.type == "cpu" and self._force_copy)):
            self.kept_on_device += 1
            return tensor
        if self.pool is None:
            self.pool = _HostPool(pin=tensor.is_cuda, synchronize=self._synchronize)
        memory, give_back = self.pool.take(self._layer, nbytes)
        layout = torch.empty_like(tensor, device="meta")  # its strides where dense, else contiguous
        cpu = memory.view(tensor.dtype).as_strided(layout.shape, layout.stride())
        if tensor.is_cuda:
            event = self._to_host(tensor, cpu)
        else:
            cpu.copy_(tensor)
            event = None
        group = self._first_group + self._layer
        entry = _Offloaded(cpu, give_back, tensor.device, group, event)
        self._groups.setdefault(group, weakref.WeakSet()).add(entry)
        self.offloaded_tensors += 1
        self.offloaded_bytes += nbytes
        return entry

    @torch.no_grad()
    def _unpack(self, packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self._release(self._copying)  # the forward is over: its copies can no longer overlap anything
        self._release(self._copied)
        self._fetch(packed.group)
        self.prefetched_tensors += self._fetch(packed.group - 1)
        tensor, packed.on_device = packed.on_device, None
        if tensor is None:  # unpacked a second time (retain_graph)
            tensor = self._copy_back(packed)
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
        self.restored_tensors += 1
        return tensor

    def _fetch(self, group: int) -> int:
        """Start the copies back of one layer call's tensors (once); returns how many."""
        entries = list(self._groups.pop(group, ()))
        for entry in entries:
            entry.on_device = self._copy_back(entry)
        return len(entries)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _to_host(self, tensor: torch.Tensor, cpu: torch.Tensor) -> torch.cuda.Event:
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # copy the finished value
        with torch.cuda.stream(stream):
            cpu.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        # The caching allocator knows only the compute stream: the source must outlive the copy.
        self._copying.append((tensor, event))
        return event

    def _synchronize(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _copy_back(self, entry: _Offloaded) -> torch.Tensor:
        if entry.device.type == "cpu":  # the _force_copy test path
            return entry.cpu.clone()
        compute, stream = torch.cuda.current_stream(entry.device), self._side_stream(entry.device)
        tensor = torch.empty_like(entry.cpu, device=entry.device)  # belongs to the compute stream
        stream.wait_stream(compute)  # that memory may have been freed by compute work still queued
        with torch.cuda.stream(stream):
            tensor.copy_(entry.cpu, non_blocking=True)
            entry.event = stream.record_event()
        tensor.record_stream(stream)  # also safe if a prefetched tensor is freed unused
        return tensor

    @staticmethod
    def _release(sources: list[tuple[torch.Tensor, torch.cuda.Event]]) -> None:
        """Drop the sources of device-to-host copies once the compute stream has waited for them.

        Their memory goes back to the compute stream's pool, so whatever reuses it runs after the copy.
        """
        for source, event in sources:
            torch.cuda.current_stream(source.device).wait_event(event)
        sources.clear()
