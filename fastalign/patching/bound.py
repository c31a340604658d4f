"""A patch's function bound to its module: what ``types.MethodType`` does, and picklable.

``patch_model`` sets an instance ``forward`` on each patched module. A ``types.MethodType`` pickles as
``getattr(module, function.__name__)``, which on loading names no attribute of the module (an
``AttributeError``) or, for a function named ``forward``, the class's own: a pickled patched model came
back unloadable, or silently unpatched (its logits built again, its kernels gone). ``PatchedMethod``
pickles as the recipe of its function instead: a factory (``rebuildable``) with its arguments, or a
module-level function by name, rebuilt and bound again as the model loads (``torch.save`` of a whole
model, multiprocessing's spawn, Ray). A deep copy binds the same function to the copy, as a method's does.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable

#: The attribute of a patch's function that names its piece ('rms_norm', 'mlp', 'loss', ...).
MARK = "_fastalign_patch"
#: The attribute of a function built by a ``rebuildable`` factory: (the factory, its arguments).
_RECIPE = "_fastalign_recipe"


def rebuildable(factory: Callable) -> Callable:
    """``factory`` (a module-level function that builds a patch's function) with each function it builds
    marked with how to build it again, so that a pickled ``PatchedMethod`` of it can be rebuilt. The
    arguments must pickle (flags, names, classes, module-level functions), never a module instance."""

    @functools.wraps(factory)
    def build(*args, **kwargs):
        function = factory(*args, **kwargs)
        setattr(function, _RECIPE, (build, args, kwargs))
        return function

    return build


class PatchedMethod:
    """``function`` bound to ``module``: called as ``function(module, ...)``, with the bound signature
    (``inspect.signature``: transformers' ``generate`` and ``Trainer`` read a forward's parameters) and
    ``__func__``/``__self__`` as a method has them."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable, module: object):
        self.__func__ = function
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    @property
    def __name__(self) -> str:
        return self.__func__.__name__

    def __repr__(self) -> str:
        return f"<fastalign patched method {self.__func__.__qualname__} of {type(self.__self__).__name__}>"

    def __reduce__(self):
        recipe = getattr(self.__func__, _RECIPE, None)
        if recipe is None:  # a module-level function: pickled by its name (fails loudly if it has none)
            recipe = (None, (self.__func__,), {})
        return _rebound, (self.__self__, recipe, getattr(self.__func__, MARK, None))

    def __deepcopy__(self, memo: dict) -> PatchedMethod:
        return PatchedMethod(self.__func__, copy.deepcopy(self.__self__, memo))


def _rebound(module: object, recipe: tuple, piece: str | None) -> PatchedMethod:
    """A pickled ``PatchedMethod`` as it loads: its function rebuilt from ``recipe`` and marked as the
    patch ``piece`` again, bound to ``module`` (still loading: only its class may be read)."""
    factory, args, kwargs = recipe
    function = args[0] if factory is None else factory(*args, **kwargs)
    if piece is not None:
        setattr(function, MARK, piece)
    return PatchedMethod(function, module)
