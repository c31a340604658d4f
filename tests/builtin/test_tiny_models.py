"""fastalign.builtin: offline tokenizer and tiny models that every later test builds on."""

from __future__ import annotations

import pytest
import torch

from fastalign import linear_cross_entropy
from fastalign.builtin import TINY_MODEL_TYPES, tiny_config, tiny_model, tiny_tokenizer


def test_tokenizer_round_trips_text_and_has_special_tokens():
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) == 512
    text = "What is 12 plus 30? The answer is 42. Ünïcode too."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tiny_tokenizer()(text)["input_ids"] == ids  # deterministic training


def test_tokenizer_chat_template():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_tokenizer(vocab_size=100)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_tiny_model_trains_and_matches_fused_loss(model_type):
    """The model's own (logits-based) loss equals the fused loss from its final hidden states."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(model_type, vocab_size=len(tokenizer))
    assert model.config.model_type == model_type
    batch = tokenizer(
        ["What is 3 plus 4? The answer is 7.", "the model learns"], padding=True, return_tensors="pt"
    )
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(**batch, labels=labels, output_hidden_states=True)
    assert torch.isfinite(out.loss)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    fused = linear_cross_entropy(out.hidden_states[-1], model.lm_head.weight, shifted)
    torch.testing.assert_close(fused, out.loss.float(), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_same_seed_same_weights_and_overrides():
    first, second = tiny_model(seed=3), tiny_model(seed=3)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(tiny_model(seed=4).parameters()), next(first.parameters()))
    assert tiny_config("llama", num_hidden_layers=3).num_hidden_layers == 3
    with pytest.raises(ValueError, match="model_type"):
        tiny_config("gpt2")
