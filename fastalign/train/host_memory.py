"""Host memory that training frees goes back to the operating system (glibc's ``malloc`` on Linux).

PyTorch's CPU tensors come from ``malloc``. glibc serves a large block with its own ``mmap`` (returned
to the system when freed) only above a threshold that starts at 128 KiB and, each time such a block is
freed, rises to its size, up to 32 MiB. After the first training step, every activation, gradient
chunk and temporary below 32 MiB comes from the heap, and what is freed stays in the process:
resident, fragmented, counted in its peak. On SmolLM2-135M (SFT, fp32, 4 × 249 tokens, 2-core CPU) the
peak resident set was 4,151 MB with glibc's default and 3,407 MB with a fixed 1 MiB threshold,
for the same tensors.

``map_large_allocations`` fixes the threshold (which also stops its rising). The price is a page fault
per page of each new large block (the kernel zeroes it). ``fastalign train`` sets it for runs on the
CPU, where the host memory is the training memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: glibc's ``mallopt`` parameter number of the mmap threshold (``M_MMAP_THRESHOLD`` in malloc.h).
M_MMAP_THRESHOLD = -3
#: Blocks of at least this size get their own mapping.
THRESHOLD_BYTES = 1 << 20


@functools.cache
def map_large_allocations() -> bool:
    """Have glibc map every allocation of ``THRESHOLD_BYTES`` or more on its own (returned to the
    system when freed). Returns whether it took effect (False without glibc: macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
