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


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct model directory (``tests.real.model``), built into .cache/ on
    first use from the pinned PyPI package: tests marked ``real`` take it."""
    from tests.real.model import smollm2_dir

    return smollm2_dir()
