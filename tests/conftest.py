"""Test set-up: Triton kernels run under the interpreter on CPU when no CUDA device is present.

TRITON_INTERPRET must be in the environment before any module defining a ``@triton.jit`` kernel is
imported, so it is set here, before fastalign is imported by any test module.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core (pytest-xdist): one thread each, in this process and
    # in the processes its tests start, instead of every worker's torch spreading over every core.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import pytest  # noqa: E402


def _patch_the_language_once_per_launch() -> None:
    """Spare the Triton interpreter its repeated patching of ``triton.language`` within one launch.

    A kernel launch under the interpreter (``GridExecutor.__call__``) patches the language modules its
    kernel sees (``_patch_lang``: every builtin of ``tl``, ``tl.tensor``, ``tl.math`` swapped for an
    interpreted one, found by ``inspect.getmembers``) and restores them when the grid is done. Triton
    3.6 to 3.9 also call ``_patch_lang`` at every call of a ``@triton.jit`` device function, which
    includes ``tl.sum``, ``tl.max`` and ``tl.zeros_like`` (``triton.language.standard``): ~3 ms a call,
    per program and per loop iteration, to find every builtin already swapped (it swaps nothing, then
    sets the same few attributes again). In the linear cross-entropy kernels that was two thirds of
    the time (tests/losses/test_grpo.py::test_memory_is_independent_of_the_vocabulary[triton]:
    20,642 calls, 66 of ~100 s).

    Here a device function's ``_patch_lang`` is skipped when the launch under way has already patched
    the language modules that function sees (the first call that sees others, e.g. ``tl.core`` from
    ``triton.language.standard``, still patches them, as before); launches, and calls outside a
    launch, patch as before. Nothing the kernels compute changes. Where the interpreter lacks these
    names (another Triton), nothing is changed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if not (callable(patch_lang) and executor is not None and scope is not None):
        return
    launch = {"patched": None}  # ids of the language modules the launch under way has patched
    sees: dict = {}  # function → ids of the language modules in its globals
    run_grid = executor.__call__

    def launch_grid(self, *args, **kwargs):
        outer, launch["patched"] = launch["patched"], set()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch["patched"] = outer

    def patch_once(fn):
        seen = sees.get(fn)
        if seen is None:
            seen = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
            sees[fn] = seen
        patched = launch["patched"]
        if patched is not None and seen and seen <= patched:
            return scope()  # nothing to restore: the launch's own scope restores the modules
        result = patch_lang(fn)
        if patched is not None:
            patched |= seen
        return result

    executor.__call__ = launch_grid
    interpreter._patch_lang = patch_once


if not HAS_CUDA:
    _patch_the_language_once_per_launch()

#: Device the kernel tests run on: CUDA where present, else CPU (Triton under the interpreter).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(params=["torch", "triton"])
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _unpinned_cpu_gemms():
    """A run pins its CPU GEMM decision for its process (``fastalign.ops.cpu_gemm``); each test measures
    afresh, whatever a test before it pinned."""
    from fastalign.ops import cpu_gemm

    yield
    cpu_gemm._PINNED.clear()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct model directory (``tests.real.model``), built into .cache/ on
    first use from the pinned PyPI package: tests marked ``real`` take it."""
    from tests.real.model import smollm2_dir

    return smollm2_dir()
