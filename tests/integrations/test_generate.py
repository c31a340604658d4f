"""``fastalign.integrations.generate.serve_generate``: a model's ``generate`` served by the rollout engine
returns the ids its own ``generate`` returns (greedy: the same tokens, rows ending at different steps),
finds each prompt's repeated rows, leaves to the model's own ``generate`` what the engine does not
cover (said once), and under TRL's GRPO and RLOO trainers gives TRL's step exactly with greedy
sampling, the engine having sampled."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig

from fastalign.builtin import tiny_model
from fastalign.integrations import generate as served
from fastalign.integrations.generate import restore_generate, serve_generate
from fastalign.train import generation
from tests.helpers import require
from tests.train.test_generation import PAD, an_eos_that_ends_some_rows, left_padded


@pytest.fixture
def engine_calls(monkeypatch):
    """The (prompts, group) of every engine call made through a served ``generate``."""
    seen = []
    sample = generation.sample_groups

    def spy(model, ids, mask, group, kwargs, **rest):
        seen.append((ids.shape[0], group))
        return sample(model, ids, mask, group, kwargs, **rest)

    monkeypatch.setattr(served, "sample_groups", spy)
    return seen


@pytest.fixture(autouse=True)
def said_afresh(monkeypatch):
    monkeypatch.setattr(served, "_SAID", set())


def repeated(ids, mask, group):
    return {"input_ids": ids.repeat_interleave(group, 0), "attention_mask": mask.repeat_interleave(group, 0)}


@pytest.mark.parametrize("how", ["kwargs", "generation_config"])
def test_greedy_ids_equal_the_models_own_generate(how, engine_calls):
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([5, 9, 3])
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=10)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD)
    options = {"generation_config": GenerationConfig(**options)} if how == "generation_config" else options
    with torch.no_grad():
        expected = model.generate(**repeated(ids, mask, 4), **options)
        serve_generate(model)
        ours = model.generate(**repeated(ids, mask, 4), **options)
    assert engine_calls == [(3, 4)]  # three prompts, prefilled once each, four rows of each
    assert torch.equal(ours, expected)
    assert (ours[:, ids.shape[1] :] == PAD).any(), "no row ended before the longest: padding untested"


def test_each_prompts_rows_are_found_when_runs_differ():
    """Runs of 2 and 4 identical rows: blocks of 2 are each one prompt (the gcd); distinct rows: 1."""
    ids, mask = left_padded([4, 6])
    rows = torch.cat([ids[:1].repeat(2, 1), ids[1:].repeat(4, 1)])
    assert served._group(rows, mask[[0, 0, 1, 1, 1, 1]]) == 2
    assert served._group(ids, mask) == 1
    assert served._group(ids[:1].repeat(6, 1), mask[:1].repeat(6, 1)) == 6


@pytest.mark.parametrize(
    "call",
    ["return_dict_in_generate", "logits_processor", "positional", "no_mask", "beam_search"],
)
def test_what_the_engine_does_not_cover_runs_the_models_own_generate_saying_once(call, engine_calls, caplog):
    from transformers import LogitsProcessorList

    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([5, 7])
    kwargs = dict(do_sample=False, max_new_tokens=4, pad_token_id=PAD, eos_token_id=1)
    args = ()
    if call == "return_dict_in_generate":
        kwargs["return_dict_in_generate"] = True
    elif call == "logits_processor":
        kwargs["logits_processor"] = LogitsProcessorList()
    elif call == "beam_search":
        kwargs["num_beams"] = 2
    inputs = repeated(ids, mask, 2)
    if call == "positional":
        args = (inputs.pop("input_ids"),)
    elif call == "no_mask":
        inputs.pop("attention_mask")
    with torch.no_grad():
        expected = model.generate(*args, **inputs, **kwargs)
        serve_generate(model)
        with caplog.at_level(logging.WARNING, logger=served.__name__):
            first = model.generate(*args, **inputs, **kwargs)
            model.generate(*args, **inputs, **kwargs)
    assert engine_calls == []
    said = [r.getMessage() for r in caplog.records if r.name == served.__name__]
    assert len(said) == 1 and "runs the model's own generate" in said[0]
    if call == "return_dict_in_generate":
        first, expected = first.sequences, expected.sequences
    assert torch.equal(first, expected)


def test_serving_is_idempotent_and_restored():
    model = tiny_model("llama", seed=1)
    own = model.generate
    assert serve_generate(serve_generate(model)) is model
    assert model.generate.__wrapped__ == own
    restore_generate(model)
    assert model.generate == own and "generate" not in vars(model)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trls_sampling_trainers_step_as_trl_alone_with_greedy_sampling(kind, lora, tmp_path, engine_calls):
    """TRL's GRPO and RLOO trainers (2 completions of each of 2 prompts, greedy through
    ``generation_kwargs``): the same loss, metrics and gradients with the engine serving ``generate``."""
    require("trl")
    if lora:
        require("peft")
    from tests.integrations.test_trl_fused_head import assert_same_step, one_step

    greedy = {"generation_kwargs": {"do_sample": False}}
    theirs = one_step(kind, tmp_path / "trl", lora=lora, **greedy)
    assert engine_calls == []
    ours = one_step(kind, tmp_path / "engine", lora=lora, serve_generate=True, **greedy)
    assert engine_calls and all(group == 2 for _, group in engine_calls)
    assert_same_step(ours, theirs)
