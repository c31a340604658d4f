"""Freed host memory goes back to the OS after each decoder layer's forward and backward, and at the end
of each step, on the CPU; the numbers trained are the same."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from fastalign.builtin import tiny_model, tiny_sft_rows
from fastalign.models.structure import decoder_layers
from fastalign.train import host_memory
from fastalign.train.memory import enable_activation_checkpointing
from tests.train.runs import short_config, train
from tests.train.test_memory import assert_same_step, padded_batch, train_step

#: Transformers up to 5.17 checkpoints a layer's ``__call__`` (5.23 its ``forward``): the layer's module
#: hooks then run inside the checkpoint, so its recomputation in backward runs the forward pre-hook again,
#: which watches the recomputed input too, and that input's gradient trims (checks) once more per layer.
CHECKPOINT_RUNS_MODULE_HOOKS = "__call__" in vars(GradientCheckpointingLayer)

glibc = pytest.mark.skipif(host_memory._mallinfo2() is None, reason="needs glibc 2.33+ and /proc")


@pytest.fixture
def releases(monkeypatch) -> list[int]:
    """Each trim, counted; every layer boundary trims (no slack)."""
    calls = []
    release = host_memory.release_freed_host_memory

    def counted() -> None:
        calls.append(1)
        release()

    monkeypatch.setattr(host_memory, "release_freed_host_memory", counted)
    monkeypatch.setattr(host_memory, "SLACK", -(1 << 40))
    monkeypatch.setattr(host_memory, "SLACK_SHARE", -1.0)
    return calls


@glibc
@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_layer_releases_after_forward_and_backward_and_trains_the_same(releases, checkpointing):
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    if checkpointing:
        enable_activation_checkpointing(model)
        enable_activation_checkpointing(reference)
    handles = host_memory.release_between_layers(model)
    layers = len(decoder_layers(model))
    assert len(handles) == 2 * layers
    batch = padded_batch()
    loss = train_step(model, batch)
    # after each layer's forward, and after its backward (which with checkpointing may recompute the
    # forward and count again)
    assert (
        2 * layers <= len(releases) <= (4 if checkpointing and CHECKPOINT_RUNS_MODULE_HOOKS else 3) * layers
    )
    torch.testing.assert_close(loss, train_step(reference, batch))
    for (name, expected), (_, got) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        assert torch.equal(got.grad, expected.grad), name
    releases.clear()
    with torch.no_grad():
        model(batch["input_ids"])
    assert releases == []  # inference frees as it goes: no trims
    for handle in handles:
        handle.remove()
    releases.clear()
    assert_same_step(reference, model)
    assert releases == []


def test_a_trim_waits_for_the_slack_and_a_dip_does_not_move_the_floor(monkeypatch):
    """The slack is an eighth of the memory in use, at least ``SLACK``."""
    calls = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: calls.append(1))
    monkeypatch.setattr(host_memory, "_floor", 1000)
    slack, large = host_memory.SLACK, 16 * host_memory.SLACK  # an eighth of large: 2 × SLACK
    for unused, in_use, trims in [
        (1000 + slack, 0, 0),
        (10, 0, 0),
        (1000 + slack, 0, 0),
        (1001 + slack, large, 0),
        (1000 + 2 * slack, large, 0),
        (1001 + 2 * slack, large, 1),
        (1001 + slack, 0, 2),
    ]:
        monkeypatch.setattr(host_memory, "_heap", lambda unused=unused, in_use=in_use: (unused, in_use))
        host_memory._release_if_grown()
        assert len(calls) == trims
    assert host_memory._floor == 1000


@glibc
def test_a_trim_sets_the_floor_to_what_is_left():
    host_memory.release_freed_host_memory()
    assert abs(host_memory._floor - host_memory._heap()[0]) < host_memory.SLACK


@glibc
def test_a_model_without_decoder_layers_gets_no_hooks():
    assert host_memory.release_between_layers(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize("preload", [None, "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"])
def test_switched_off_by_the_environment_or_another_allocator(monkeypatch, preload):
    if preload:
        monkeypatch.setenv("LD_PRELOAD", preload)
    else:
        monkeypatch.setenv("FASTALIGN_MALLOC_TRIM", "0")
    host_memory._glibc.cache_clear()
    host_memory._mallinfo2.cache_clear()
    try:
        assert host_memory.release_between_layers(tiny_model("llama")) == []
        assert host_memory._glibc() is None
    finally:  # found again with the environment restored
        host_memory._glibc.cache_clear()
        host_memory._mallinfo2.cache_clear()


@glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="a run takes the GPU when there is one")
def test_a_cpu_run_releases_at_each_layer_and_step(tmp_path, releases):
    steps = train(short_config(tmp_path, tiny_sft_rows(8), max_steps=2), "sft")
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in steps)
    layers = len(decoder_layers(tiny_model("llama")))
    assert len(releases) >= 2 * (2 * layers + 1)  # each step: every layer's forward and backward, its end
