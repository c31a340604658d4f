"""The note at the start of a CPU run whose CPUs are busy (``fastalign.train.run.busy_cpus_note``)."""

from __future__ import annotations

import os

import torch

from fastalign.train.run import busy_cpus_note


def test_a_load_above_the_cores_is_one_actionable_line_on_cpu_runs_only(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (3.14, 2.0, 1.0))
    note = busy_cpus_note(torch.device("cpu"))
    assert note == (
        "note: the CPUs are busy (load 3.1 on 2 cores): training will be slower; stop other work or set "
        "OMP_NUM_THREADS to the free cores"
    )
    assert busy_cpus_note(torch.device("cuda")) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set already: not advised again
    assert busy_cpus_note(torch.device("cpu")) == (
        "note: the CPUs are busy (load 3.1 on 2 cores): training will be slower; stop other work "
        "(OMP_NUM_THREADS is 1)"
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 5.0, 5.0))  # the 1-minute average decides
    assert busy_cpus_note(torch.device("cpu")) is None


def test_no_note_where_the_load_is_unknown(monkeypatch):
    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert busy_cpus_note(torch.device("cpu")) is None
