"""Packing examples into rows of at most ``max_length`` tokens, by TRL's ``packing_strategy``:

- ``bfd``: best-fit decreasing bins of whole examples, each keeping its own positions (``PackedCollator``
  restarts ``position_ids`` at every example, so none attends to another);
- ``bfd_split``: the same, after splitting each example longer than ``max_length`` into pieces of
  ``max_length`` tokens (the last one shorter), each piece then an example of its own;
- ``wrapped``: every example's tokens concatenated and cut into blocks of exactly ``max_length`` (the
  last block shorter), examples split wherever a block ends; a block is an ordinary padded row, so its
  tokens attend across the examples in it, as in TRL.

TRL packs each ``datasets.map`` batch (1,000 rows) on its own; here the whole data set is packed at once,
which is the same on up to 1,000 rows and leaves fewer part-filled rows beyond.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from fastalign.data.sft import TokenizedExample

#: TRL's ``packing_strategy`` values.
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


def pack_best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Indices of the examples in each bin, as TRL's ``pack_dataset(strategy="bfd")`` bins them: longest
    first (ties in data set order), each into the bin with the least free space that still fits it, or
    a new bin; among bins with equal free space, the one that has had it longest. O(n log n) with the
    bins kept sorted by (free space, when they got it)."""
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    too_long = [i for i, length in enumerate(lengths) if length > max_length]
    if too_long:
        raise ValueError(
            f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than max_length={max_length}"
        )
    bins: list[list[int]] = []
    free: list[tuple[int, int, int]] = []  # (free space, when the bin got it, bin number), sorted
    clock = itertools.count()
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        position = bisect.bisect_left(free, (length, -1, -1))
        if position == len(free):
            bins.append([index])
            space, number = max_length, len(bins) - 1
        else:
            space, _, number = free.pop(position)
            bins[number].append(index)
        bisect.insort(free, (space - length, next(clock), number))
    return bins


def split_long_examples(examples: Sequence[TokenizedExample], max_length: int) -> list[TokenizedExample]:
    """``bfd_split``'s pieces: each example cut into ``max_length``-token pieces (the last shorter), in
    order; an example that fits stays whole."""
    return [
        TokenizedExample(
            example.input_ids[start : start + max_length], example.loss_mask[start : start + max_length]
        )
        for example in examples
        for start in range(0, len(example), max_length)
    ]


def wrap_examples(examples: Sequence[TokenizedExample], max_length: int) -> list[TokenizedExample]:
    """``wrapped``'s blocks: all the examples' tokens (and loss masks) in order, cut every
    ``max_length`` tokens."""
    input_ids = [token for example in examples for token in example.input_ids]
    loss_mask = [keep for example in examples for keep in example.loss_mask]
    return [
        TokenizedExample(input_ids[start : start + max_length], loss_mask[start : start + max_length])
        for start in range(0, len(input_ids), max_length)
    ]
