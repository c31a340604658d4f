"""Adapters that put fastalign's kernels under other training libraries, where users already train.

Each adapter imports its library lazily, so fastalign never requires it."""
