"""Handing freed host memory back to the operating system while training on the CPU.

Why: PyTorch's CPU tensors come from glibc's ``malloc``. Tensors above its mapping threshold are mapped
and unmapped one by one, but each unmapping raises the threshold (up to 32 MiB), so soon a layer's
tensors come from the heap, and the heap keeps what is freed: a temporary's pages stay resident until a
later tensor happens to fit in their place. On SmolLM2-135M (bf16 DPO LoRA, 8 × 249 tokens) a step's
resident peak was 4.4 GB while at most 2.8 GB were alive; TRL's runs carry the same overhead.

``malloc_trim(0)`` returns every free page of every arena (``madvise``). It runs at the end of each
optimizer step, and after a decoder layer's forward or backward once the heaps hold ``SLACK`` (64 MiB)
more resident free memory than just after the last trim (the resident set less what ``malloc`` has handed
out, ``mallinfo2``): the resident set stays within about ``SLACK`` of what is alive. A trim costs a pass
over the heaps (about 16 ms on that model) and the page faults of touching the returned pages again; the
slack keeps it to a few trims a step where little is freed (KTO with checkpointing: 39 a step, peak 3.6
→ 3.3 GB), about two a layer where much is (that DPO LoRA step: 60, peak 4.4 → 2.9 GB), with no step
time change beyond this CPU's noise. On an accelerator nothing of this runs (the device memory has its
own caching allocator); without glibc (musl, macOS) neither, as there is no ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch
from torch import nn

from fastalign.models.structure import decoder_layers

#: how much more resident free heap memory than just after the last trim a layer boundary tolerates
SLACK = 64 << 20

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_floor = [0]  # resident bytes not handed out by malloc, just after the last trim (or the fewest since)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def _libc():
    """glibc's ``malloc_trim`` and ``mallinfo2`` (2.33+), or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):
        return None
    if not os.path.exists("/proc/self/statm"):
        return None
    info.restype = _MallInfo2
    return trim, info


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _resident_not_in_use() -> int:
    """The resident set less the bytes ``malloc`` has handed out (heap chunks in use, mapped chunks):
    code, Python's own arenas and the heaps' resident free pages; only the last grows between trims."""
    info = _libc()[1]()
    return _resident_bytes() - info.uordblks - info.hblkhd


def release_freed_host_memory() -> bool:
    """Return the free pages of glibc's heaps to the OS; whether it could (no glibc: it cannot)."""
    if _libc() is None:
        return False
    _libc()[0](0)
    _floor[0] = _resident_not_in_use()
    return True


def _release_if_grown(*_) -> None:
    unused = _resident_not_in_use()
    if unused > _floor[0] + SLACK:
        release_freed_host_memory()
    else:
        _floor[0] = min(_floor[0], unused)


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
    none without glibc, or for a model whose layers ``decoder_layers`` does not find (the end of each
    step still trims). Returns the hooks' handles (``.remove()`` each to undo)."""
    if _libc() is None:
        return []
    try:
        layers = decoder_layers(model)
    except ValueError:
        return []
    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(_watch_backward, with_kwargs=True))
        handles.append(layer.register_forward_hook(_after_forward))
    return handles
