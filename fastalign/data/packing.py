"""Best-fit-decreasing packing of examples into bins of at most ``max_length`` tokens."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def pack_best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Indices of the examples in each bin: longest first, each into the fullest bin it still fits
    (O(n log n) with the bins kept sorted by free space)."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    too_long = [i for i, length in enumerate(lengths) if length > max_length]
    if too_long:
        raise ValueError(
            f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than max_length={max_length}"
        )
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin number), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        position = bisect.bisect_left(free, (length, -1))
        if position == len(free):
            bins.append([index])
            bisect.insort(free, (max_length - length, len(bins) - 1))
        else:
            space, number = free.pop(position)
            bins[number].append(index)
            bisect.insort(free, (space - length, number))
    return bins
