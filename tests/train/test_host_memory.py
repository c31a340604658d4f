"""Freed host memory leaves the process once ``map_large_allocations`` is set (glibc only)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only"
)

#: After a 16 MiB tensor is freed (which raises glibc's default threshold to 16 MiB), allocates 300 MiB
#: of 2 MiB tensors and frees every other one (as a training step frees some tensors and keeps others),
#: printing the resident set before, in between and after.
SCRIPT = """
import json, os, sys, torch
from fastalign.train.host_memory import map_large_allocations
if sys.argv[1] == "mapped":
    assert map_large_allocations()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
torch.ones(16 << 18)  # allocated and freed at once
before = rss()
blocks = [torch.ones(1 << 19) for _ in range(150)]
held = rss()
del blocks[::2]
print(json.dumps({"before": before, "held": held, "after": rss()}))
"""


def _resident(mode: str) -> dict:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, cwd=root
    )
    return json.loads(out.stdout)


def test_freed_blocks_stay_resident_with_the_default_and_leave_when_mapped():
    default, mapped = _resident("default"), _resident("mapped")
    for run in (default, mapped):
        assert run["held"] - run["before"] > 250  # the 300 MiB were resident
    assert default["held"] - default["after"] < 30  # half of them freed, yet kept by the process
    assert mapped["held"] - mapped["after"] > 130  # freed and returned


def test_it_is_set_once_and_says_whether_it_took():
    from fastalign.train.host_memory import map_large_allocations

    assert map_large_allocations() is True
    assert map_large_allocations() is True
    assert map_large_allocations.cache_info().hits >= 1
