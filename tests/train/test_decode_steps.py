"""The rollout engine's fixed-shape decode steps (``fastalign.sampling.decode_steps``), which a GPU
replays as CUDA graphs: on a CPU they run eagerly, and must give ``generate``'s greedy tokens on every
family that allows them, through compactions, under LoRA and fastalign's patch, and sample its
distribution; what cannot run them is named. The CUDA tests (the GPU check runs this file) capture the
graphs and check the same tokens, and the fall-back when a capture fails. Runs on every supported
transformers: the steps hand the model a 4-D mask, which transformers passes through as it is."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from fastalign.builtin import tiny_model
from fastalign.builtin.models import TINY_MODEL_TYPES
from fastalign.sampling import decode_steps
from fastalign.sampling.decode_cache import ReservedLayer
from fastalign.sampling.decode_steps import StaticSteps, static_refusal
from fastalign.sampling.generation import _decode_cache, sample_groups
from tests.train.test_generation import (
    PAD,
    an_eos_that_ends_some_rows,
    compactions,
    distribution,
    fits,
    generate,
    left_padded,
)

CUDA = torch.cuda.is_available()


def refusal_of(model) -> str | None:
    """What ``static_refusal`` says of ``model`` (its decode cache as the engine makes it)."""
    return static_refusal(model, _decode_cache(model, shared=False), synced=False)


def compact_at_every_end(monkeypatch) -> None:
    """Compact the fixed-shape batch whenever a row has ended (not only at half): every step may change
    its shape, the hardest case for its buffers."""

    def keep(self, ended):
        if not bool(ended.any()) or bool(ended.all()):
            return None
        return (~ended).nonzero().squeeze(1)

    monkeypatch.setattr(StaticSteps, "keep", keep)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_greedy_tokens_equal_generates_on_every_family(model_type, monkeypatch):
    model = tiny_model(model_type, seed=1).eval()
    refusal = refusal_of(model)
    if refusal is not None:
        assert model_type in ("gemma2", "gemma3_text"), refusal  # sliding-window layers
        pytest.skip(f"{model_type}: {refusal}")
    ids, mask = left_padded([5, 9, 3, 7])
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=12)
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    compact_at_every_end(monkeypatch)
    seen = compactions(monkeypatch)
    with torch.no_grad():
        expected = generate(model, ids, mask, 2, **options)
        ours = sample_groups(model, ids, mask, 2, options, static=True)
    assert torch.equal(ours, expected)
    assert seen, "rows ended but the batch was never compacted"


def test_memory_left_in_the_reserved_buffers_is_never_read(monkeypatch):
    """A buffer's unfilled tail is masked out, but 0 × NaN is NaN: the steps must zero it."""
    reserve = ReservedLayer.reserve

    def reserve_over_nans(self, tokens):
        reserve(self, tokens)
        length = self.keys.shape[-2]
        self._keys[..., length:, :] = float("nan")
        self._values[..., length:, :] = float("nan")

    monkeypatch.setattr(ReservedLayer, "reserve", reserve_over_nans)
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([5, 2])
    options = dict(do_sample=False, max_new_tokens=6, eos_token_id=2, pad_token_id=PAD)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, 2, options, static=True)
    assert torch.equal(ours, generate(model, ids, mask, 2, **options))


def test_the_batch_is_compacted_once_half_its_rows_have_ended():
    steps = StaticSteps.__new__(StaticSteps)
    steps.eager = None
    ended = torch.tensor([True, True, True, False, False, False, False, False])
    assert steps.keep(ended) is None  # 5 of 8 still running
    ended[3] = True
    assert steps.keep(ended).tolist() == [4, 5, 6, 7]
    assert steps.keep(torch.ones(8, dtype=torch.bool)) is None  # all ended: the loop stops


@pytest.mark.parametrize("lora", [False, True], ids=["patched", "patched+lora"])
def test_lora_and_patched_models_decode_as_generate(lora, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from fastalign import patch_model

    model = tiny_model("llama", seed=3)
    patch_model(model)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.eval()
    ids, mask = left_padded([6, 4], seed=4)
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=PAD)
    compact_at_every_end(monkeypatch)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, 2, options, static=True)
        assert torch.equal(ours, generate(model, ids, mask, 2, **options))


def test_sampled_tokens_follow_generates_distribution():
    model = tiny_model("llama", seed=4).eval()
    ids, mask = left_padded([5], seed=5)
    options = dict(
        do_sample=True, max_new_tokens=2, temperature=0.7, top_k=40, eos_token_id=2, pad_token_id=PAD
    )
    torch.manual_seed(0)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, 3000, options, static=True)[:, -2:]
    first = distribution(model, ids, options)
    assert fits(torch.bincount(ours[:, 0], minlength=first.numel()).float(), first)
    top = int(torch.bincount(ours[:, 0]).argmax())
    second = distribution(model, torch.cat([ids, torch.tensor([[top]])], 1), options)
    after = ours[ours[:, 0] == top, 1]
    assert after.numel() > 100
    assert fits(torch.bincount(after, minlength=second.numel()).float(), second)


def test_what_cannot_decode_at_a_fixed_shape_is_named():
    from fastalign.quant.four_bit_linear import FourBitLinear

    model = tiny_model("llama", seed=1).eval()
    assert refusal_of(model) is None
    assert "sliding window" in refusal_of(tiny_model("gemma3_text", seed=1).eval())
    eager = tiny_model("llama", seed=1).eval()
    eager.config._attn_implementation = "eager"
    assert "sdpa" in refusal_of(eager)
    cache = _decode_cache(model, shared=True)
    assert "shared prefix" in static_refusal(model, cache, synced=False)
    assert "sliding window" in refusal_of(tiny_model("mistral", seed=1, sliding_window=4).eval())
    assert "ranks" in static_refusal(model, _decode_cache(model, shared=False), synced=True)
    assert "training mode" in refusal_of(model.train())
    model.eval()
    model.config.num_local_experts = 4
    assert "mixture of experts" in refusal_of(model)
    model.config.num_local_experts = None
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert "spread over devices" in refusal_of(model)
    del model.hf_device_map
    dynamic = tiny_model("llama", seed=1, rope_scaling={"rope_type": "dynamic", "factor": 2.0}).eval()
    with pytest.raises(ValueError, match="rotary embedding"):
        sample_groups(
            dynamic,
            *left_padded([3]),
            2,
            dict(do_sample=False, max_new_tokens=2, eos_token_id=2),
            static=True,
        )
    up = model.model.layers[0].mlp.up_proj
    up.__class__ = FourBitLinear  # what the check looks at: the layer's type
    assert "quantized" in refusal_of(model)
    ids, mask = left_padded([3])
    with pytest.raises(ValueError, match=r"fixed-shape decoding is not possible: .*quantized"):
        sample_groups(
            model, ids, mask, 2, dict(do_sample=False, max_new_tokens=2, eos_token_id=2), static=True
        )


def test_steps_that_go_eager_midway_decode_as_generate(monkeypatch):
    """What a step that cannot be captured leads to: the eager steps from there on, over the cache as the
    fixed-shape ones filled it, after a compaction too."""
    step = StaticSteps.step
    width = {}

    def going_eager(self, tokens, mask):
        width.setdefault(id(self), self.filled)
        if self.eager is None and self.filled == width[id(self)] + 3:
            self._go_eager("a test")
        return step(self, tokens, mask)

    monkeypatch.setattr(StaticSteps, "step", going_eager)
    compact_at_every_end(monkeypatch)
    model = tiny_model("qwen3", seed=1).eval()
    ids, mask = left_padded([5, 9, 3, 7])
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=12)
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, 2, options, static=True)
    assert torch.equal(ours, generate(model, ids, mask, 2, **options))
    assert not decode_steps.may_capture(model)  # its next calls step eagerly from the start


def test_the_length_a_step_reads_is_noted():
    """A fixed-shape layer answers ``get_seq_length`` with the host-side length and notes the read (a
    captured step would replay it); back to appending, it counts its keys again."""
    layer = ReservedLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    layer.reserve(4)
    layer.make_static(torch.tensor([3]), 3)
    assert not layer.length_read
    layer.length = 5
    assert layer.get_seq_length() == 5 and layer.length_read
    keys, _ = layer.update(torch.full((1, 1, 1, 2), 2.0), torch.full((1, 1, 1, 2), 2.0))
    assert keys.shape[-2] == 7 and keys[0, 0, 3].tolist() == [2.0, 2.0] and keys[0, 0, 4:].abs().sum() == 0
    layer.make_dynamic(4)
    assert layer.get_seq_length() == 4
    keys, _ = layer.update(torch.full((1, 1, 1, 2), 3.0), torch.full((1, 1, 1, 2), 3.0))
    assert keys[0, 0, :, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 3.0]


def test_the_eager_steps_decode_on_a_cpu_unless_asked(monkeypatch):
    """Left to decide, a CPU decodes eagerly: fixed-shape steps attend over the whole buffer and a CPU has
    no launches to save."""
    made = []
    monkeypatch.setattr(StaticSteps, "__init__", lambda self, *a, **k: made.append(1) or 1 / 0)
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([4, 2])
    options = dict(do_sample=False, max_new_tokens=4, eos_token_id=2, pad_token_id=PAD)
    with torch.no_grad():
        assert torch.equal(
            sample_groups(model, ids, mask, 2, options), generate(model, ids, mask, 2, **options)
        )
    assert not made


@pytest.fixture
def stand_in_graphs(monkeypatch) -> collections.Counter:
    """CUDA graphs on a CPU, for the control flow around them (captures, replays and their checks,
    fall-backs, clean-ups): ``torch.cuda``'s streams, sync debug mode, graphs and pool calls stood in for;
    the fixed-shape steps made to use graphs; a capture runs the step, and a replay runs it again into the
    captured output (so it cannot show what a real graph would freeze: the CUDA tests do). Returns the
    calls seen."""
    seen: collections.Counter = collections.Counter()
    forward, init = StaticSteps._forward, StaticSteps.__init__

    class Graph:
        capturing = None

        def capture_begin(self, pool=None, capture_error_mode=None):
            seen["begin"] += 1
            Graph.capturing = self

        def capture_end(self):
            seen["end"] += 1
            Graph.capturing = None

        def replay(self):
            seen["replay"] += 1
            self.output.copy_(forward(self.steps))

    def recording(self):
        output = forward(self)
        if Graph.capturing is not None:
            Graph.capturing.steps, Graph.capturing.output = self, output
        return output

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    mode = [0]
    monkeypatch.setattr(StaticSteps, "_forward", recording)
    monkeypatch.setattr(StaticSteps, "__init__", lambda self, *args, graphs: init(self, *args, graphs=True))
    for name, value in {
        "CUDAGraph": Graph, "Stream": Stream, "current_stream": lambda device=None: Stream(),
        "stream": lambda stream: contextlib.nullcontext(), "device": lambda device: contextlib.nullcontext(),
        "graph_pool_handle": lambda: (0, 1), "get_sync_debug_mode": lambda: mode[0],
        "set_sync_debug_mode": lambda value: mode.__setitem__(0, value),
    }.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(
            torch._C, name, lambda device, pool, name=name: seen.update([name]), raising=False
        )
    return seen


def decoded(model, caplog, tokens: int = 12) -> dict[str, int]:
    """Greedy decoding at a fixed shape of 4 prompts × 2 whose rows end at different steps, checked against
    ``generate``: what it added to ``CAPTURES``."""
    ids, mask = (t.to(model.device) for t in left_padded([5, 9, 3, 7]))
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=tokens)
    options = dict(do_sample=False, max_new_tokens=tokens, eos_token_id=eos, pad_token_id=PAD)
    before = dict(decode_steps.CAPTURES)
    with torch.no_grad(), caplog.at_level("WARNING"):
        ours = sample_groups(model, ids, mask, 2, options, static=True)
    assert torch.equal(ours, generate(model, ids, mask, 2, **options))
    return {key: decode_steps.CAPTURES[key] - before.get(key, 0) for key in decode_steps.CAPTURES}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3"])
def test_graph_steps_capture_replay_and_recapture_after_compactions(
    model_type, stand_in_graphs, monkeypatch, caplog
):
    compact_at_every_end(monkeypatch)
    seen = compactions(monkeypatch)
    model = tiny_model(model_type, seed=1).eval()
    added = decoded(model, caplog)
    compacted = len(seen) // model.config.num_hidden_layers  # each a batch size of its own, captured anew
    assert compacted and compacted <= added.get("captured", 0) <= compacted + 1, (compacted, added)
    assert not added.get("uncaptured")
    assert stand_in_graphs["replay"] > 0 and stand_in_graphs["begin"] == stand_in_graphs["end"]


@pytest.mark.parametrize(
    "failing", ["capture_begin", "capture_end", "captured_forward", "out_of_memory", "replay_differs", "sync"]
)
def test_graph_steps_that_fail_go_on_eagerly_and_clean_up(failing, stand_in_graphs, monkeypatch, caplog):
    """Each way a graph can fail, midway through a step: the eager steps finish with generate's tokens,
    the allocator's capture is ended and its pool released where the capture had begun, and the model is
    not tried again, unless the capture ran out of memory."""
    graph = torch.cuda.CUDAGraph
    if failing in ("capture_begin", "capture_end"):
        monkeypatch.setattr(graph, failing, lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("CUDA")))
    elif failing == "sync":
        broken_at(2, fail, monkeypatch)  # the check's run, with synchronizing calls made errors
    elif failing in ("captured_forward", "out_of_memory"):
        error = torch.OutOfMemoryError("out of memory") if failing == "out_of_memory" else RuntimeError("x")
        broken_at(3, lambda: (_ for _ in ()).throw(error), monkeypatch)
    else:
        replays_elsewhere(monkeypatch)
    model = tiny_model("llama", seed=1).eval()
    added = decoded(model, caplog)
    assert added.get("uncaptured") == 1 and "without CUDA graphs" in caplog.text
    assert bool(added.get("differed")) == (failing == "replay_differs")
    cleaned = failing in ("capture_begin", "capture_end")
    assert stand_in_graphs["_cuda_releasePool"] == stand_in_graphs["_cuda_endAllocateToPool"] == int(cleaned)
    assert decode_steps.may_capture(model) == (failing == "out_of_memory")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3"])
def test_cuda_graphs_decode_as_generate(model_type, monkeypatch):
    """Compacting at every ended row: each compaction a capture of its own (a released graph's pool
    cannot take another, so each capture takes a new one)."""
    compact_at_every_end(monkeypatch)
    model = tiny_model(model_type, seed=1).cuda().eval()
    ids, mask = (t.cuda() for t in left_padded([5, 9, 3, 7]))
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=16)
    options = dict(do_sample=False, max_new_tokens=16, eos_token_id=eos, pad_token_id=PAD)
    before = dict(decode_steps.CAPTURES)
    with torch.no_grad():
        expected = generate(model, ids, mask, 4, **options)
        ours = sample_groups(model, ids, mask, 4, options)  # left to decide: graphs on CUDA
    assert decode_steps.CAPTURES["captured"] >= before.get("captured", 0) + 2  # recaptured after compacting
    assert decode_steps.CAPTURES["uncaptured"] == before.get("uncaptured", 0)
    assert torch.equal(ours, expected)


def broken_at(call: int, action, monkeypatch) -> None:
    """The ``call``-th run of a fixed-shape step (1: its first) does ``action`` first."""
    forward, calls = StaticSteps._forward, []

    def broken(self):
        calls.append(1)
        if len(calls) == call:
            action()
        return forward(self)

    monkeypatch.setattr(StaticSteps, "_forward", broken)


def replays_elsewhere(monkeypatch) -> None:
    """Graphs whose replays write somewhere the steps do not read (what a graph that froze something at
    its capture looks like from outside): zeros where the logits should be."""
    record = StaticSteps._record

    def frozen(self):
        failure = record(self)
        self.logits = torch.zeros_like(self.logits)
        return failure

    monkeypatch.setattr(StaticSteps, "_record", frozen)


def synchronize():
    torch.ones(1, device="cuda").item()  # a host wait: an error in the check, invalidates a capture


def fail():
    raise RuntimeError("a failure inside the step")


def decoded_on_cuda(model, caplog) -> dict[str, int]:
    """Greedy decoding of two prompts × 2 on CUDA, checked against ``generate``: what it added to
    ``CAPTURES``."""
    ids, mask = (t.cuda() for t in left_padded([5, 3]))
    options = dict(do_sample=False, max_new_tokens=6, eos_token_id=2, pad_token_id=PAD)
    before = dict(decode_steps.CAPTURES)
    with torch.no_grad(), caplog.at_level("WARNING"):
        ours = sample_groups(model, ids, mask, 2, options)
    assert torch.equal(ours, generate(model, ids, mask, 2, **options))
    return {key: decode_steps.CAPTURES[key] - before.get(key, 0) for key in decode_steps.CAPTURES}


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "call, action",
    [(2, synchronize), (3, synchronize), (3, fail)],
    ids=["waits-on-the-device", "capture-invalidated", "capture-raises"],
)
def test_a_step_that_cannot_be_captured_decodes_eagerly_saying_so(call, action, monkeypatch, caplog):
    """The second run checks for host waits, the third is the capture: either failing leaves the current
    stream the default one, the allocator usable, and the eager steps giving generate's tokens."""
    broken_at(call, action, monkeypatch)
    model = tiny_model("llama", seed=1).cuda().eval()
    added = decoded_on_cuda(model, caplog)
    assert added.get("uncaptured") == 1 and not added.get("captured")
    assert not any(decoded_on_cuda(model, caplog).values())  # not tried again: the eager steps
    assert "without CUDA graphs" in caplog.text
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.empty(1 << 20, device="cuda").fill_(1)  # the allocator still serves this stream
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_step_that_reads_the_caches_length_is_not_captured(monkeypatch, caplog):
    model = tiny_model("llama", seed=1).cuda().eval()
    forward = type(model.model).forward

    def reading(self, *args, past_key_values=None, **kwargs):
        past_key_values.get_seq_length()
        return forward(self, *args, past_key_values=past_key_values, **kwargs)

    monkeypatch.setattr(type(model.model), "forward", reading)
    added = decoded_on_cuda(model, caplog)
    assert added.get("uncaptured") == 1 and not added.get("captured")
    assert "reads the cache's length" in caplog.text


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_replay_that_differs_from_the_eager_step_leaves_the_graphs(monkeypatch, caplog):
    """A graph that froze something at its capture (here: its output read from elsewhere) is caught at its
    first replay, and the eager steps go on with generate's tokens."""
    replays_elsewhere(monkeypatch)
    added = decoded_on_cuda(tiny_model("llama", seed=1).cuda().eval(), caplog)
    assert added.get("differed") == 1
    assert "differed" in caplog.text
