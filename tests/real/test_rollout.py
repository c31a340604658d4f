"""The rollout engine on the real model: greedy completions of long, left-padded chat prompts equal
``generate``'s, with each prompt's KV held once for its rows (``fastalign.sampling.prefix_attention``), with
it repeated, and at a fixed shape (``fastalign.sampling.decode_steps``, the steps a GPU replays as CUDA
graphs, here run eagerly)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastalign.sampling import generation
from fastalign.sampling.decode_cache import SharedPrefixLayer


def chat_prompts(tokenizer, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` long chat prompts (a documentation passage and a question), left-padded."""
    from pydoc_data.topics import topics

    texts = []
    for name in sorted(topics)[:count]:
        passage = " ".join(topics[name].split()[:120])
        question = f"Documentation:\n{passage}\n\nIn one sentence, what does '{name}' cover?"
        messages = [{"role": "user", "content": question}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


def test_long_prompts_decode_as_generate_with_their_kv_held_once(smollm2, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids, mask = chat_prompts(tokenizer, 2)
    assert ids.shape[1] > 100 and bool((mask == 0).any())  # long, and left-padded
    options = dict(
        do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    shared = []
    share = SharedPrefixLayer.share
    spy = lambda self, *args: (shared.append(self), share(self, *args))[1]  # noqa: E731
    monkeypatch.setattr(SharedPrefixLayer, "share", spy)
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0), **options
        )
        assert generation.shares_prefix(model, ids, 3, options["max_new_tokens"])
        ours = generation.sample_groups(model, ids, mask, 3, options)
        fixed_shape = generation.sample_groups(model, ids, mask, 3, options, static=True)
        monkeypatch.setattr(generation, "SHARE_FROM", 10**9)
        repeated = generation.sample_groups(model, ids, mask, 3, options)
    assert len(shared) == model.config.num_hidden_layers
    assert torch.equal(ours, expected) and torch.equal(repeated, expected)
    assert torch.equal(fixed_shape, expected)


def test_a_served_generate_returns_generates_ids_on_the_real_model(smollm2, monkeypatch):
    """``serve_generate`` on the real model, called as TRL's GRPO calls ``generate`` (each prompt repeated,
    a ``GenerationConfig``, outside ``no_grad``): greedy, the ids of the model's own ``generate``, with the
    engine having sampled (each prompt prefilled once)."""
    from transformers import GenerationConfig

    from fastalign.integrations import generate as served

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids, mask = chat_prompts(tokenizer, 2)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    inputs = {"input_ids": ids.repeat_interleave(4, 0), "attention_mask": mask.repeat_interleave(4, 0)}
    expected = model.generate(**inputs, generation_config=config)
    prompts = []
    sample = served.sample_groups

    def spy(model, ids, *args, **kwargs):
        prompts.append(ids.shape[0])
        return sample(model, ids, *args, **kwargs)

    monkeypatch.setattr(served, "sample_groups", spy)
    ours = served.serve_generate(model).generate(**inputs, generation_config=config)
    assert prompts == [2] and torch.equal(ours, expected)
