"""Globals that Triton kernels read must be ``tl.constexpr``.

The compiler rejects a plain Python number read from a module global inside ``@triton.jit`` code, but
the interpreter that CPU tests use accepts it; this check finds such globals without a GPU.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import triton

import fastalign.kernels

MODULES = [
    importlib.import_module(f"fastalign.kernels.{info.name}")
    for info in pkgutil.iter_modules(fastalign.kernels.__path__)
]


def _jit_functions(module):
    """(name, Python function) of each kernel the module defines (compiled or interpreted)."""
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if isinstance(value, triton.runtime.KernelInterface) and fn.__module__ == module.__name__:
            yield name, fn


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_kernel_globals_are_constexpr(module):
    functions = list(_jit_functions(module))
    assert functions, f"{module.__name__} defines no @triton.jit function"
    offenders = [
        f"{name} reads {global_name}"
        for name, fn in functions
        for global_name in fn.__code__.co_names
        if type(vars(module).get(global_name)) in (int, float, bool)
    ]
    assert not offenders, f"plain-number globals in kernels (wrap them in tl.constexpr): {offenders}"
