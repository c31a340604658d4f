"""``fastalign.integrations.generate.serve_generate``: a model's ``generate`` served by the rollout engine
returns the ids its own ``generate`` returns (greedy: the same tokens, rows ending at different steps,
repeated or shared prompt KV, outside ``no_grad`` too), finds each prompt's repeated rows, leaves to the
model's own ``generate`` every call the engine would not sample alike (said once), survives deep copies
and restores what the instance had; in 2 processes the ranks decide together and stay in step; under
TRL's GRPO and RLOO trainers with greedy sampling the completions TRL scores, and so every logged metric,
are TRL alone's."""

from __future__ import annotations

import copy
import logging
import pickle
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from fastalign.builtin import tiny_model
from fastalign.integrations import generate as served
from fastalign.integrations.generate import restore_generate, serve_generate
from fastalign.sampling import generation
from tests.helpers import require
from tests.train.test_generation import PAD, an_eos_that_ends_some_rows, left_padded, sharing


@pytest.fixture
def engine_calls(monkeypatch):
    """The (prompts, rows per prompt) of every engine call made through a served ``generate``."""
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


def own_and_served(model, inputs: dict, **kwargs):
    """The model's own ``generate`` output, then the served one's, for the same call and random state."""
    torch.manual_seed(0)
    own = model.generate(**inputs, **kwargs)
    serve_generate(model)
    torch.manual_seed(0)
    try:
        return own, model.generate(**inputs, **kwargs)
    finally:
        restore_generate(model)


@pytest.mark.parametrize("shared", [False, True], ids=["repeated", "shared"])
@pytest.mark.parametrize("how", ["kwargs", "generation_config"])
def test_greedy_ids_equal_the_models_own_generate(how, shared, engine_calls, monkeypatch):
    """Outside ``no_grad`` as a plain call makes it: no forward of the served call builds a graph."""
    sharing(monkeypatch, shared)
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([5, 9, 3])
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=8)
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD)
    options = {"generation_config": GenerationConfig(**options)} if how == "generation_config" else options
    graphs = []
    model.register_forward_hook(lambda module, args, output: graphs.append(output.logits.requires_grad))
    expected, ours = own_and_served(model, repeated(ids, mask, 4), **options)
    assert engine_calls == [(3, 4)]  # three prompts, prefilled once each, four rows of each
    assert torch.equal(ours, expected)
    assert (ours[:, ids.shape[1] :] == PAD).any(), "no row ended before the longest: padding untested"
    assert not any(graphs)


def test_num_return_sequences_gives_as_many_rows_as_generate(engine_calls):
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([5, 7])
    options = dict(do_sample=True, max_new_tokens=4, num_return_sequences=3, pad_token_id=PAD, eos_token_id=1)
    own, ours = own_and_served(model, repeated(ids, mask, 2), **options)
    assert engine_calls == [(2, 6)] and ours.shape == own.shape == (12, ids.shape[1] + 4)
    assert torch.equal(ours[:, : ids.shape[1]], own[:, : ids.shape[1]])


def test_each_prompts_rows_are_found_when_runs_differ():
    """Runs of 2 and 4 identical rows: blocks of 2 are each one prompt (the gcd); distinct rows, or the
    same ids under other masks: 1."""
    ids, mask = left_padded([4, 6])
    rows = torch.cat([ids[:1].repeat(2, 1), ids[1:].repeat(4, 1)])
    assert served._group(rows, mask[[0, 0, 1, 1, 1, 1]]) == 2
    assert served._group(ids, mask) == 1
    assert served._group(ids[:1].repeat(6, 1), mask[:1].repeat(6, 1)) == 6
    other_mask = mask[:1].repeat(2, 1)
    other_mask[1, -1] = 0
    assert served._group(ids[:1].repeat(2, 1), other_mask) == 1


def _dropout_lora():
    require("peft")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj"], init_lora_weights=False
    )
    return get_peft_model(tiny_model("llama", seed=1), config).train()


def _prompt_tuning():
    require("peft")
    from peft import PromptTuningConfig, get_peft_model

    return get_peft_model(
        tiny_model("llama", seed=1), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    )


def _foreign_attention():
    """Falcon calls ``scaled_dot_product_attention`` itself, not through transformers' functions."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    return FalconForCausalLM(config).eval()


def _no_cache():
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    config = OpenAIGPTConfig(vocab_size=512, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    return OpenAIGPTLMHeadModel(config).eval()


def _llama():
    return tiny_model("llama", seed=1).eval()


#: A call the engine would not sample as ``generate``: (its model, extra options, what the log names).
NOT_SERVED = {
    "return_dict_in_generate": (_llama, {"return_dict_in_generate": True}, "return_dict"),
    "return_dict_in_the_models_config": (None, {}, "return_dict"),
    "logits_processor": (_llama, "processors", "generation option"),
    "positional": (_llama, "positional", "positional"),
    "no_mask": (_llama, "no_mask", "not both given"),
    "beam_search": (_llama, {"num_beams": 2}, "beam search"),
    "dropout_in_training": (_dropout_lora, {}, "dropout"),
    "checkpointing_in_training": (None, {}, "checkpointing"),
    "prompt_tuning": (_prompt_tuning, {}, "prompt learning"),
    "no_kv_cache": (_no_cache, {}, "keeps no KV cache"),
    "no_eos": (None, {}, "no eos_token_id"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NOT_SERVED))
def test_what_the_engine_would_not_sample_alike_runs_the_models_own_generate(case, engine_calls, caplog):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    make, extra, named = NOT_SERVED[case]
    kwargs = dict(do_sample=False, max_new_tokens=4, pad_token_id=PAD, eos_token_id=1)
    if case == "return_dict_in_the_models_config":
        model = tiny_model("llama", seed=1).eval()
        model.generation_config.return_dict_in_generate = True
    elif case == "checkpointing_in_training":
        model = tiny_model("llama", seed=1)
        model.gradient_checkpointing_enable()
        model.train()
    elif case == "no_eos":
        model = tiny_model("llama", seed=1).eval()
        model.generation_config.eos_token_id = model.config.eos_token_id = None
        kwargs.pop("eos_token_id")
    else:
        model = make()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    if extra == "processors":
        extra = {"logits_processor": processors}
    kwargs |= extra if isinstance(extra, dict) else {}
    ids, mask = left_padded([5, 7])
    inputs, args = repeated(ids, mask, 2), ()
    if extra == "positional":
        args = (inputs.pop("input_ids"),)
    elif extra == "no_mask":
        inputs.pop("attention_mask")
    serve_target = model.get_base_model() if case == "prompt_tuning" else model
    torch.manual_seed(0)
    expected = model.generate(*args, **inputs, **kwargs)
    serve_generate(serve_target)
    with caplog.at_level(logging.WARNING, logger=served.__name__):
        torch.manual_seed(0)
        first = model.generate(*args, **inputs, **kwargs)
        model.generate(*args, **inputs, **kwargs)
    assert engine_calls == []
    said = [r.getMessage() for r in caplog.records if r.name == served.__name__]
    assert len(said) == 1 and "runs the model's own generate" in said[0] and named in said[0], said
    if case.startswith("return_dict"):
        first, expected = first.sequences, expected.sequences
    assert torch.equal(first, expected)


def test_the_same_model_in_eval_mode_or_without_dropout_is_served(engine_calls):
    model = _dropout_lora().eval()
    ids, mask = left_padded([5, 7])
    options = dict(do_sample=False, max_new_tokens=4, pad_token_id=PAD, eos_token_id=1)
    own, ours = own_and_served(model.get_base_model(), repeated(ids, mask, 2), **options)
    assert engine_calls == [(2, 2)] and torch.equal(ours, own)


def test_a_model_attending_by_itself_is_served_without_the_shared_prefix(engine_calls, monkeypatch):
    """Falcon's attention never reaches the engine's shared-prefix function (it crashed there): it is
    served with the prompt KV repeated, whatever the prompt length."""
    sharing(monkeypatch, True)
    model = _foreign_attention()
    ids, mask = left_padded([9, 12])
    options = dict(do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=1)
    own, ours = own_and_served(model, repeated(ids, mask, 3), **options)
    assert engine_calls == [(2, 3)] and torch.equal(ours, own)


def test_a_deep_copy_serves_its_own_weights_and_a_served_model_pickles():
    model = serve_generate(tiny_model("llama", seed=1).eval())
    twin = copy.deepcopy(model)
    assert twin.generate.__self__ is twin and served._is_served(twin)
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.neg_()
    ids, mask = left_padded([5])
    options = dict(do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=1)
    restored = restore_generate(copy.deepcopy(twin))
    assert torch.equal(
        twin.generate(**repeated(ids, mask, 2), **options),
        restored.generate(**repeated(ids, mask, 2), **options),
    )
    loaded = pickle.loads(pickle.dumps(model))  # loads with its class's generate
    assert torch.equal(
        loaded.generate(**repeated(ids, mask, 2), **options),
        model.generate(**repeated(ids, mask, 2), **options),
    )


def test_serving_is_idempotent_and_restores_what_the_instance_had():
    model = tiny_model("llama", seed=1)
    own = model.generate
    assert serve_generate(serve_generate(model)) is model and served._is_served(model)
    restore_generate(model)
    assert model.generate == own and "generate" not in vars(model)

    def users(*args, **kwargs):
        return "the user's"

    model.generate = users
    restore_generate(serve_generate(model))
    assert model.generate is users


@pytest.mark.slow
def test_ranks_decide_together_and_stay_in_step():
    """Under FSDP2 in 2 processes: the engine decodes synced (each rank's ids its own ``generate``'s);
    one rank's call not served sends every rank's to ``generate``; an unsharded model is not synced."""
    from tests import torchrun

    torchrun.run_two_processes(Path(__file__).with_name("serve_generate_worker.py"), 8, timeout=300)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trls_sampling_trainers_score_trls_completions_with_greedy_sampling(
    kind, lora, tmp_path, engine_calls, monkeypatch
):
    """TRL's GRPO and RLOO trainers (2 completions of each of 2 prompts, greedy through
    ``generation_kwargs``): the engine samples, and the completions TRL scores, the rewards and every
    logged metric are TRL alone's. (With greedy rows a prompt's completions are identical, so the group's
    advantages, and the loss and gradients, are 0 in both: the completions are what this compares.)"""
    require("trl")
    if lora:
        require("peft")
    from tests.integrations import test_trl_fused_head as fused_head

    scored, reward = [], fused_head.digit_ratio

    def digit_ratio(*args, **kwargs):
        scored.append(list(kwargs["completions"]))
        return reward(*args, **kwargs)

    monkeypatch.setattr(fused_head, "digit_ratio", digit_ratio)
    greedy = {"generation_kwargs": {"do_sample": False}}
    theirs = fused_head.one_step(kind, tmp_path / "trl", lora=lora, **greedy)
    assert engine_calls == []
    trl_completions, scored[:] = list(scored), []
    ours = fused_head.one_step(kind, tmp_path / "engine", lora=lora, serve_generate=True, **greedy)
    assert engine_calls and all(group == 2 for _, group in engine_calls)
    assert scored == trl_completions and any(any(text for text in batch) for batch in scored)
    fused_head.assert_same_step(ours, theirs)
