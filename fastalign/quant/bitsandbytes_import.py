"""bitsandbytes kept out of a run that does not use it.

peft imports bitsandbytes when it is itself imported, and again looks for it whenever it adds LoRA layers,
if the package is installed; importing it takes seconds and can log a warning no user can act on (on a
CPU with AVX512-BF16: "Failed to load CPU gemm_4bit_forward from kernels-community"). fastalign needs it
only to quantize 4-bit weights and for the 8-bit optimizers; a run that asks for neither hides it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_NAME = "bitsandbytes"


@contextlib.contextmanager
def bitsandbytes_hidden(hidden: bool = True) -> Iterator[None]:
    """With ``hidden``, bitsandbytes is as if not installed inside the block (None in ``sys.modules``:
    ``import bitsandbytes`` raises ImportError, ``importlib.util.find_spec`` finds nothing), unless it
    was imported already; afterwards it imports normally. peft then leaves out only its code for
    bitsandbytes-quantized layers, which fastalign's models never have (its 4-bit layers are its own).
    A peft first imported inside the block keeps ``peft.helpers.bnb`` None for the process."""
    if not hidden or _NAME in sys.modules:
        yield
        return
    sys.modules[_NAME] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if _NAME in sys.modules and sys.modules[_NAME] is None:
            del sys.modules[_NAME]
