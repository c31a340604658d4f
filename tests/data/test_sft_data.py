"""SFT data: TRL formats, loss masks, packing without cross-contamination, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.data import (
    PackedCollator,
    PaddingCollator,
    load_rows,
    pack_best_fit_decreasing,
    tokenize_sft_dataset,
)

PROMPT_COMPLETION = [
    {"prompt": "What is 3 plus 4?", "completion": " The answer is 7."},
    {"prompt": "What is 12 minus 2?", "completion": " The answer is 10."},
    {"prompt": "the model", "completion": " learns to answer"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_text_rows_train_on_every_token_plus_eos(tokenizer):
    (example,) = tokenize_sft_dataset([{"text": "the model learns"}], tokenizer)
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.input_ids[:-1]) == "the model learns"
    assert all(example.loss_mask)


def test_prompt_completion_masks_the_prompt(tokenizer):
    examples = tokenize_sft_dataset(PROMPT_COMPLETION, tokenizer)
    for row, example in zip(PROMPT_COMPLETION, examples, strict=True):
        prompt_length = len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
        assert example.loss_mask == [0] * prompt_length + [1] * (len(example) - prompt_length)
        targets = [t for t, keep in zip(example.input_ids, example.loss_mask, strict=True) if keep]
        assert tokenizer.decode(targets[:-1]) == row["completion"]
    everything = tokenize_sft_dataset(PROMPT_COMPLETION, tokenizer, completion_only_loss=False)
    assert all(all(example.loss_mask) for example in everything)


def test_conversational_prompt_completion(tokenizer):
    row = {
        "prompt": [{"role": "user", "content": "What is 1 plus 2?"}],
        "completion": [{"role": "assistant", "content": "3"}],
    }
    (example,) = tokenize_sft_dataset([row], tokenizer)
    targets = [t for t, keep in zip(example.input_ids, example.loss_mask, strict=True) if keep]
    assert tokenizer.decode(targets) == "3<|im_end|>\n"


def test_assistant_only_loss_needs_generation_marks(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    with pytest.raises(ValueError, match="generation"):
        tokenize_sft_dataset(rows, tokenizer, assistant_only_loss=True)
    marked = tiny_tokenizer()
    marked.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    (example,) = tokenize_sft_dataset(rows, marked, assistant_only_loss=True)
    targets = [t for t, keep in zip(example.input_ids, example.loss_mask, strict=True) if keep]
    assert marked.decode(targets) == "hello<|im_end|>"


def test_truncation_and_too_long_rows(tokenizer):
    (example,) = tokenize_sft_dataset(PROMPT_COMPLETION[:1], tokenizer, max_length=8)
    assert len(example) == 8
    with pytest.raises(ValueError, match=r"row 0: \d+ tokens exceed max_length=8"):
        tokenize_sft_dataset(PROMPT_COMPLETION[:1], tokenizer, max_length=8, truncation=False)
    with pytest.raises(ValueError, match="row 0: no loss tokens"):
        tokenize_sft_dataset(PROMPT_COMPLETION[:1], tokenizer, max_length=3)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "x"}], "SFT needs 'text'"),
        ([{"text": "ok"}, {"text": 3}], "row 1: 'text' must be text"),
        ([{"text": "ok"}, {"text": None}], "row 1: missing 'text'"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], r"row 0: messages\[0\] has role 'robot'"),
        ([{"messages": []}], "row 0: 'messages' must be a non-empty list"),
        ([], "empty"),
    ],
)
def test_bad_rows_name_the_row_and_field(tokenizer, rows, message):
    with pytest.raises(ValueError, match=message):
        tokenize_sft_dataset(rows, tokenizer)


def test_load_rows_from_files_and_lists(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in PROMPT_COMPLETION))
    assert load_rows(path)[1]["prompt"] == PROMPT_COMPLETION[1]["prompt"]
    assert len(load_rows(tmp_path)) == 3
    assert len(load_rows(PROMPT_COMPLETION)) == 3
    with pytest.raises(ValueError, match="not a local file"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="empty"):
        load_rows([])


def test_best_fit_decreasing():
    lengths = [7, 5, 4, 3, 3, 2, 1, 1]
    bins = pack_best_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4  # 26 tokens in bins of 8: the lower bound
    with pytest.raises(ValueError, match="example 0 has 7 tokens"):
        pack_best_fit_decreasing(lengths, 6)


def test_padding_collator(tokenizer):
    examples = tokenize_sft_dataset(PROMPT_COMPLETION, tokenizer)
    batch = PaddingCollator(tokenizer.pad_token_id)(examples)
    width = max(len(e) for e in examples)
    assert batch["input_ids"].shape == (3, width)
    assert batch["attention_mask"].sum().item() == sum(len(e) for e in examples)
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_packing_has_no_cross_contamination(tokenizer):
    """Each packed example's logits equal those of the example run alone, and its loss tokens too."""
    model = tiny_model("llama", vocab_size=len(tokenizer)).eval()
    examples = tokenize_sft_dataset(PROMPT_COMPLETION, tokenizer)
    batch = PackedCollator()(examples)
    assert batch["input_ids"].shape == (1, sum(len(e) for e in examples))
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        start = 0
        for example in examples:
            alone = model(input_ids=torch.tensor([example.input_ids])).logits[0]
            torch.testing.assert_close(packed[start : start + len(example)], alone, rtol=1e-5, atol=1e-5)
            assert batch["labels"][0, start] == -100  # never predicted from the previous example
            start += len(example)


def test_sharegpt_conversations_are_read_as_trls_sft_trainer_reads_them(tokenizer):
    """``conversations`` of ``from``/``value`` messages are ``messages`` of ``role``/``content`` (TRL's
    ``maybe_convert_to_chatml``); before: "SFT needs 'text', 'messages', or 'prompt' and 'completion'".
    ShareGPT's own role names are not guessed at: one line says how to write them."""
    chatml = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    sharegpt = [
        {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello!"}]}
    ]
    assert tokenize_sft_dataset(sharegpt, tokenizer) == tokenize_sft_dataset(chatml, tokenizer)
    human = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}]
    with pytest.raises(
        ValueError, match=r"row 0: messages\[0\] has role 'human'.*write them user and assistant"
    ):
        tokenize_sft_dataset(human, tokenizer)
