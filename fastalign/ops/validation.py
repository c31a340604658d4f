"""Argument checks shared by the public ops and losses: each failure is a one-line ``ValueError`` that
names the argument and what it got.

Checks of Python values and of tensor metadata (type, dtype, shape, device) cost nothing on the device.
Checks of tensor *values* on a GPU need a host sync; ``DeferredChecks`` gathers them so that one call
costs one sync, placed where the op already has one.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable

import torch


def require_tensor(name: str, value, *, optional: bool = False) -> None:
    """``value`` must be a ``torch.Tensor`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def integer(name: str, value) -> int:
    """A Python (or NumPy) integer, not a bool, float or string."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def positive_int(name: str, value, what: str = "a positive integer") -> int:
    """An integer >= 1 (``chunk_size``, ``group_size``, ...)."""
    if isinstance(value, bool) or not _is_index(value):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    number = operator.index(value)
    if number < 1:
        raise ValueError(f"{name} must be {what}, got {number}")
    return number


def real(name: str, value, *, finite: bool = True) -> float:
    """A real number (not a bool or string); finite unless told."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if finite and not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def positive_finite(name: str, value) -> float:
    """A finite number > 0 (``temperature``, ``softcap``)."""
    number = real(name, value, finite=False)
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{name} must be > 0 and finite, got {number}")
    return number


def item_count(name: str, value, whole: bool = True) -> int | float | torch.Tensor:
    """A count of items (``num_items_in_batch``): a positive integer, or a one-element tensor holding one
    (integer dtype, or floating point with a whole value: ``transformers.Trainer`` passes a float tensor).
    Not ``whole``: a divisor, any finite number >= 0 (transformers' ``Trainer`` divides the count by its
    tensor-, context- and sequence-parallel sizes, and counts 0 for a window without a target token).

    A tensor's value is not read here (that would sync a GPU): callers check it where they already sync,
    through ``DeferredChecks.positive`` or ``DeferredChecks.divisor``.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer count, got a tensor of dtype {value.dtype}")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a single count, got a tensor of shape {tuple(value.shape)}")
        return value
    if whole:
        return positive_int(name, value, "a positive integer count (or an integer tensor)")
    number = real(name, value)
    if number < 0:
        raise ValueError(f"{name} must be a count (>= 0), got {number}")
    return number


def binary_mask(name: str, mask: torch.Tensor) -> None:
    """Metadata part of the mask check: bool, integer or floating point (values checked by
    ``DeferredChecks.binary_mask``)."""
    require_tensor(name, mask)
    if mask.dtype.is_complex:
        raise ValueError(f"{name} must be a 0/1 mask (bool or integer), got dtype {mask.dtype}")


def _is_index(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _first(bad: torch.Tensor) -> list[int]:
    return [int(i) for i in bad.nonzero()[0]] if bad.dim() else []


class DeferredChecks:
    """Value checks of device tensors, answered together with one host sync (``raise_first``)."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._messages: list[Callable[[], str]] = []

    def add(self, failed: torch.Tensor, message: Callable[[], str]) -> None:
        """``failed``: a 0-d bool tensor; ``message()`` is only built when it is True."""
        self._flags.append(failed.reshape(()))
        self._messages.append(message)

    def binary_mask(self, name: str, mask: torch.Tensor) -> None:
        """Every value of ``mask`` is 0 or 1 (nothing to check for bool masks). A fractional weight is
        not a mask: the losses treat any non-zero entry as a loss token."""
        binary_mask(name, mask)
        if mask.dtype == torch.bool:
            return
        bad = (mask != 0) & (mask != 1)

        def message() -> str:
            where = _first(bad)
            value = mask[tuple(where)].item()
            return f"{name} must be a 0/1 mask (bool or integer), got {value} at {where}"

        self.add(bad.any(), message)

    def finite(self, name: str, tensor: torch.Tensor) -> None:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return
        bad = ~torch.isfinite(tensor)

        def message() -> str:
            where = _first(bad)
            return f"{name} must be finite, got {tensor[tuple(where)].item()} at {where}"

        self.add(bad.any(), message)

    def positive(self, name: str, tensor: torch.Tensor) -> None:
        """A positive whole count (a floating-point tensor's value must be whole too)."""
        value = tensor.reshape(())
        bad = (value < 1) | (value != value.round()) if value.dtype.is_floating_point else value < 1
        self.add(bad, lambda: f"{name} must be a positive whole count, got {tensor.item()}")

    def divisor(self, name: str, tensor: torch.Tensor, counted: torch.Tensor) -> None:
        """A finite divisor >= 0 of the items this call ``counted``: 0 only where it counted none."""
        value = tensor.reshape(()).float()
        bad = ~torch.isfinite(value) | (value < 0) | ((value == 0) & (counted.to(value.device) > 0))
        self.add(
            bad,
            lambda: (
                f"{name} must be a finite count >= 0, and > 0 where this batch has items to count, got "
                f"{tensor.item()}"
            ),
        )

    def raise_first(self) -> None:
        """One sync for all checks; the first failed one raises its ValueError."""
        if not self._flags:
            return
        device = self._flags[0].device
        failed = torch.stack([flag.to(device) for flag in self._flags]).tolist()
        for flag, message in zip(failed, self._messages, strict=True):
            if flag:
                raise ValueError(message())
