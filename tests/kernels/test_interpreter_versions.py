"""The interpreter's version guard: Triton < 3.7 with NumPy >= 2.4 is refused in one line, not left to
fail inside the interpreter (triton-lang/triton#9171); every other pairing passes."""

import sys
import types

import pytest

from fastalign.ops import backend


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [
        ("3.6.0", "2.4.6", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.0", "2.4.6", False),
        ("3.9.0", "2.4.0", False),
    ],
)
def test_the_broken_pairing_is_refused(monkeypatch, triton_version, numpy_version, refused):
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__=numpy_version))
    backend.check_triton_interpreter.cache_clear()
    try:
        if refused:
            with pytest.raises(RuntimeError, match=r"numpy<2\.4 or triton>=3\.7"):
                backend.check_triton_interpreter()
        else:
            backend.check_triton_interpreter()
    finally:
        backend.check_triton_interpreter.cache_clear()


@pytest.mark.skipif(
    not backend.triton_interpreter_enabled(),
    reason="Triton kernels run compiled here (CUDA), not under the interpreter this guard is about",
)
def test_this_environment_passes():
    backend.check_triton_interpreter()
