"""Handing freed host memory back to the operating system while training on the CPU.

Why: PyTorch's CPU tensors come from glibc's ``malloc``. Tensors above its mapping threshold are mapped
and unmapped one by one, but each unmapping raises the threshold (up to 32 MiB), so soon a layer's
tensors come from the heap, and the heap keeps what is freed: a temporary's pages stay resident until a
later tensor happens to fit in their place. On SmolLM2-135M (bf16 DPO LoRA, 8 × 249 tokens) a step's
resident peak was 4.4 GB while at most 2.8 GB were alive; TRL's runs carry the same overhead. A fixed
mapping threshold (``mallopt``) would map every tensor afresh instead: at 1 MiB the same step peaked at
2.9 GB but ran 40% slower (page faults and zeroing on every allocation).

``malloc_trim(0)`` returns every free page of every arena (``madvise``). It runs at the end of each
optimizer step, and after a decoder layer's forward or backward once the heaps hold more resident free
memory than just after the last trim by an eighth of the memory ``malloc`` has handed out
(``SLACK_SHARE``), and at least ``SLACK`` (256 MiB) (anonymous resident memory less what ``malloc`` has
handed out, ``mallinfo2``): the resident set stays within about an eighth of what is alive. A trim costs
a pass over the heaps (about 30 ms) and, above all, the page faults of touching the returned pages
again, so the slack is a trade. On SmolLM2-135M's fp32 SFT step (batch 4 × 248 tokens), a fixed 256 MiB
trimmed 5 to 7 times a step, the peak 3.76 → 3.37 GB, the step time unchanged within this CPU's noise;
64 MiB trimmed 38 times, the peak 3.19 GB, the step 35% slower. A step that holds more trims more
often at a fixed slack, as its activations outgrow it: GRPO at G = 8 (32 rows × 128 tokens, fp32, 2
threads, a quiet AVX-512 CPU) took 30.4-30.9 s a step at a 6.1 GB peak with 256 MiB (36 trims a step in
a profile on another CPU); an eighth of the memory in use gave 29.1 s at 6.2 GB (1 GiB: 28.3 s at 6.7
GB; no trimming: 32.4 s at 7.8 GB), and the SFT step 5.94 s at 3.27 GB against 5.98 s at 3.24 GB (one
run each). A layer boundary
that does not trim costs a ``/proc`` read and ``mallinfo2``'s walk of the free lists. A layer whose
input needs no gradient (the first, under LoRA) has no backward boundary; the step's end covers it.

Nothing of this runs on an accelerator (device memory has its own caching allocator), without glibc's
``malloc_trim`` (musl, macOS), under another allocator preloaded (jemalloc, tcmalloc, mimalloc: glibc's
heaps are then empty), or with ``FASTALIGN_MALLOC_TRIM=0`` (for those who tune ``MALLOC_*`` or
``GLIBC_TUNABLES`` themselves). Layer boundaries also need ``mallinfo2`` (glibc 2.33+); before that only
the step's end trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch
from torch import nn

from fastalign.models.structure import decoder_layers

#: how much more resident free heap memory than just after the last trim a layer boundary tolerates: this
#: share of what ``malloc`` has handed out, and at least ``SLACK``
SLACK_SHARE = 1 / 8
SLACK = 256 << 20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

#: anonymous resident bytes not handed out by malloc, just after the last trim
_floor = 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, when it is the allocator and trimming is wanted (see the module docstring), else None."""
    if os.environ.get("FASTALIGN_MALLOC_TRIM", "1") == "0":
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2`` (2.33+) where ``/proc/self/statm`` is there too, else None."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2") or not os.path.exists("/proc/self/statm"):
        return None
    libc.mallinfo2.argtypes, libc.mallinfo2.restype = [], _MallInfo2
    return libc.mallinfo2


def _heap() -> tuple[int, int]:
    """(anonymous resident bytes not handed out by ``malloc``, bytes handed out). The first is statm's
    resident less its shared, file-backed pages, less what ``malloc`` has handed out (heap chunks in use,
    mapped chunks): Python's own arenas, thread stacks and the heaps' resident free pages, of which only
    the last grows much between trims."""
    with open("/proc/self/statm", "rb") as statm:
        fields = statm.read().split()
    info = _mallinfo2()()
    in_use = info.uordblks + info.hblkhd
    return (int(fields[1]) - int(fields[2])) * _PAGE - in_use, in_use


def release_freed_host_memory() -> None:
    """Return the free pages of glibc's heaps to the OS (nothing without glibc)."""
    global _floor
    libc = _glibc()
    if libc is None:
        return
    libc.malloc_trim(0)
    if _mallinfo2() is not None:
        _floor = _heap()[0]


def _release_if_grown(*_) -> None:
    """Trim when the heaps' resident free memory has grown since the last trim by an eighth of the memory
    in use (``SLACK_SHARE``; at least ``SLACK``). The floor moves only at trims: a dip below it (chunks
    handed out from pages a trim returned are counted in use before they are touched) must not make the
    next return to it look like growth."""
    free, in_use = _heap()
    if free > _floor + max(SLACK, int(in_use * SLACK_SHARE)):
        release_freed_host_memory()


def _after_forward(*_) -> None:
    """After a layer's forward in training; not in generation or reference passes, which keep nothing
    for backward, so what they free is reused at once (and decoding calls each layer once a token)."""
    if torch.is_grad_enabled():
        _release_if_grown()


def _watch_backward(_layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a layer's forward: its input's gradient, when it comes, ends the layer's backward."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch.is_grad_enabled():
        hidden.register_hook(_release_if_grown)


def release_between_layers(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks on ``model``'s decoder layers that trim after each layer's forward (with gradients) and
    backward when the heaps' resident free memory has grown by ``SLACK`` (see the module docstring);
    none where that cannot be measured, or for a model whose layers ``decoder_layers`` does not find
    (the end of each step still trims). Returns the hooks' handles (``.remove()`` each to undo)."""
    if _mallinfo2() is None:
        return []
    try:
        layers = decoder_layers(model)
    except ValueError:
        return []
    release_freed_host_memory()  # the floor: what loading the model left behind, returned
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(_watch_backward, with_kwargs=True))
        handles.append(layer.register_forward_hook(_after_forward))
    return handles
