"""Preference, KTO and prompt-only data: TRL formats, prompt/completion splits, collators, clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastalign.builtin import tiny_tokenizer
from fastalign.data import (
    KTOCollator,
    PreferenceCollator,
    PromptCollator,
    tokenize_kto_dataset,
    tokenize_preference_dataset,
    tokenize_prompt_dataset,
)

QUESTION = "What is 3 plus 4?"  # 6 tokens
USER = {"role": "user", "content": QUESTION}
SYSTEM = {"role": "system", "content": "you are helpful"}
RENDERED_PROMPT = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_standard_explicit_prompt(tokenizer):
    row = {"prompt": QUESTION, "chosen": " The answer is 7.", "rejected": " The answer is 10."}
    (example,) = tokenize_preference_dataset([row], tokenizer)
    assert tokenizer.decode(example.prompt_ids) == QUESTION
    for ids, text in ((example.chosen_ids, row["chosen"]), (example.rejected_ids, row["rejected"])):
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[:-1]) == text
    assert example.ref_chosen_logp is None and example.ref_rejected_logp is None


def test_conversational_explicit_prompt_has_no_extra_eos(tokenizer):
    row = {"prompt": [USER], "chosen": [assistant("7")], "rejected": [assistant("10")]}
    (example,) = tokenize_preference_dataset([row], tokenizer)
    assert tokenizer.decode(example.prompt_ids) == RENDERED_PROMPT
    assert tokenizer.decode(example.chosen_ids) == "7<|im_end|>\n"
    assert tokenizer.decode(example.rejected_ids) == "10<|im_end|>\n"


def test_standard_implicit_prompt_splits_at_shared_tokens(tokenizer):
    row = {"chosen": f"{QUESTION} The answer is 7.", "rejected": f"{QUESTION} The answer is 10."}
    (example,) = tokenize_preference_dataset([row], tokenizer)
    assert tokenizer.decode(example.prompt_ids) == f"{QUESTION} The answer is"
    assert tokenizer.decode(example.chosen_ids) == " 7.<|eos|>"
    assert tokenizer.decode(example.rejected_ids) == " 10.<|eos|>"
    whole = tokenizer(row["chosen"], add_special_tokens=False)["input_ids"]
    assert example.prompt_ids + example.chosen_ids[:-1] == whole


def test_conversational_implicit_prompt_is_the_shared_messages(tokenizer):
    history = [SYSTEM, USER, assistant("7"), {"role": "user", "content": "times 2?"}]
    implicit = {"chosen": [*history, assistant("14")], "rejected": [*history, assistant("10")]}
    explicit = {"prompt": history, "chosen": [assistant("14")], "rejected": [assistant("10")]}
    examples = tokenize_preference_dataset([implicit, explicit], tokenizer)
    assert examples[0] == examples[1]
    assert tokenizer.decode(examples[0].prompt_ids).endswith("times 2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(examples[0].chosen_ids) == "14<|im_end|>\n"


def test_prompt_length_limit_and_truncation_keeps_the_end(tokenizer):
    row = {"prompt": QUESTION, "chosen": " The answer is 7.", "rejected": " no"}
    with pytest.raises(ValueError, match="row 0: the prompt has 6 tokens, over max_prompt_length=4"):
        tokenize_preference_dataset([row], tokenizer, max_prompt_length=4)
    (example,) = tokenize_preference_dataset([row], tokenizer, max_prompt_length=4, truncation=True)
    assert tokenizer.decode(example.prompt_ids) == " 3 plus 4?"
    assert tokenizer.decode(example.chosen_ids) == row["chosen"] + "<|eos|>"


def test_max_length_cuts_completions_at_the_end(tokenizer):
    row = {"prompt": QUESTION, "chosen": " The answer is 7.", "rejected": " 7."}
    with pytest.raises(ValueError, match=r"row 0: prompt \+ 'chosen' has 12 tokens, over max_length=9"):
        tokenize_preference_dataset([row], tokenizer, max_length=9)
    (example,) = tokenize_preference_dataset([row], tokenizer, max_length=9, truncation=True)
    assert tokenizer.decode(example.prompt_ids) == QUESTION
    assert tokenizer.decode(example.chosen_ids) == " The answer is"
    assert tokenizer.decode(example.rejected_ids) == " 7.<|eos|>"  # already fits
    with pytest.raises(ValueError, match="row 0: no 'chosen' tokens fit in max_length=6 after the 6-token"):
        tokenize_preference_dataset([row], tokenizer, max_length=6, truncation=True)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "the dataset is empty"),
        ([{"prompt": "a", "chosen": " b"}], "row 0: missing 'rejected'"),
        ([{"rejected": "a"}], "row 0: missing 'chosen'"),
        (
            [
                {"prompt": "a", "chosen": " b", "rejected": " c"},
                {"prompt": "a", "chosen": 3, "rejected": " c"},
            ],
            "row 1: 'chosen' must be text or a list of messages, got int",
        ),
        ([{"prompt": "a", "chosen": "", "rejected": " c"}], "row 0: 'chosen' is empty"),
        (
            [{"prompt": QUESTION, "chosen": [assistant("7")], "rejected": [assistant("8")]}],
            "row 0: mixed formats",
        ),
        (
            [{"prompt": [USER], "chosen": [{"role": "robot", "content": "7"}], "rejected": [assistant("8")]}],
            r"row 0: chosen\[0\] has role 'robot'",
        ),
        (
            [{"chosen": [USER, assistant("7")], "rejected": [USER, assistant("7")]}],
            "first differ at message 2",
        ),
        (
            [
                {
                    "chosen": [USER, assistant("7")],
                    "rejected": [{"role": "user", "content": "hi"}, assistant("7")],
                }
            ],
            "row 0: 'chosen' and 'rejected' must share their first messages",
        ),
    ],
)
def test_bad_preference_rows_name_the_row_and_field(tokenizer, rows, message):
    with pytest.raises(ValueError, match=message):
        tokenize_preference_dataset(rows, tokenizer)


def test_preference_collator(tokenizer):
    rows = [
        {"prompt": QUESTION, "chosen": " The answer is 7.", "rejected": " no"},
        {"prompt": "the model", "chosen": " learns", "rejected": " learns to answer"},
    ]
    examples = tokenize_preference_dataset(rows, tokenizer)
    collate = PreferenceCollator(tokenizer.pad_token_id)
    batch = collate(examples)
    sequences = [e.prompt_ids + e.chosen_ids for e in examples] + [
        e.prompt_ids + e.rejected_ids for e in examples
    ]
    prompts = [len(e.prompt_ids) for e in examples] * 2
    width = max(len(s) for s in sequences)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, width)
    for row, (sequence, prompt) in enumerate(zip(sequences, prompts, strict=True)):
        padding = width - len(sequence)
        assert batch["input_ids"][row].tolist() == sequence + [tokenizer.pad_token_id] * padding
        assert batch["attention_mask"][row].tolist() == [1] * len(sequence) + [0] * padding
        assert batch["labels"][row].tolist() == [-100] * prompt + sequence[prompt:] + [-100] * padding
    assert "ref_chosen_logps" not in batch and "ref_rejected_logps" not in batch

    scored = [
        dataclasses.replace(e, ref_chosen_logp=-1.5 - i, ref_rejected_logp=-3.0)
        for i, e in enumerate(examples)
    ]
    batch = collate(scored)
    assert batch["ref_chosen_logps"].dtype == torch.float32
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -2.5]
    assert batch["ref_rejected_logps"].tolist() == [-3.0, -3.0]
    with pytest.raises(ValueError, match="ref_chosen_logp is set on some examples"):
        collate([scored[0], examples[1]])


def test_kto_formats_and_labels(tokenizer):
    rows = [
        {"prompt": QUESTION, "completion": " The answer is 7.", "label": True},
        {"prompt": [USER], "completion": [assistant("10")], "label": False},
    ]
    standard, conversational = tokenize_kto_dataset(rows, tokenizer)
    assert tokenizer.decode(standard.prompt_ids) == QUESTION
    assert tokenizer.decode(standard.completion_ids) == " The answer is 7.<|eos|>"
    assert standard.label is True
    assert tokenizer.decode(conversational.prompt_ids) == RENDERED_PROMPT
    assert tokenizer.decode(conversational.completion_ids) == "10<|im_end|>\n"
    assert conversational.label is False
    (cut,) = tokenize_kto_dataset(rows[:1], tokenizer, max_length=8, max_prompt_length=4, truncation=True)
    assert tokenizer.decode(cut.prompt_ids) == " 3 plus 4?"
    assert tokenizer.decode(cut.completion_ids) == " The answer is 7"
    with pytest.raises(ValueError, match=r"row 0: prompt \+ 'completion' has 12 tokens, over max_length=8"):
        tokenize_kto_dataset(rows[:1], tokenizer, max_length=8)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "a", "completion": " b"}, "row 1: missing 'label'"),
        ({"prompt": "a", "completion": " b", "label": 1}, r"row 1: 'label' must be a bool .*, got 1"),
        (
            {"prompt": "a", "completion": " b", "label": "true"},
            "row 1: 'label' must be a bool .*, got 'true'",
        ),
        ({"prompt": "a", "label": True}, "row 1: missing 'completion'"),
        ({"prompt": "a", "completion": "", "label": True}, "row 1: 'completion' is empty"),
        ({"prompt": [USER], "completion": " b", "label": True}, "row 1: mixed formats"),
    ],
)
def test_bad_kto_rows_name_the_row(tokenizer, row, message):
    good = {"prompt": "a", "completion": " b", "label": False}
    with pytest.raises(ValueError, match=message):
        tokenize_kto_dataset([good, row], tokenizer)


def test_kto_collator_rotates_completions_for_the_kl_batch(tokenizer):
    rows = [
        {"prompt": QUESTION, "completion": " The answer is 7.", "label": True},
        {"prompt": "the model", "completion": " learns", "label": False},
        {"prompt": "the", "completion": " model learns to answer", "label": True},
    ]
    examples = tokenize_kto_dataset(rows, tokenizer)
    batch = KTOCollator(tokenizer.pad_token_id)(examples)
    assert batch["kto_labels"].dtype == torch.bool
    assert batch["kto_labels"].tolist() == [True, False, True]
    assert batch["input_ids"].shape[0] == batch["kl_input_ids"].shape[0] == 3
    for row, example in enumerate(examples):
        for prefix, completion in (("", example.completion_ids), ("kl_", examples[row - 1].completion_ids)):
            length = len(example.prompt_ids) + len(completion)
            assert batch[f"{prefix}input_ids"][row, :length].tolist() == example.prompt_ids + completion
            assert batch[f"{prefix}attention_mask"][row].sum() == length
            labels = batch[f"{prefix}labels"][row].tolist()
            assert [token for token in labels if token != -100] == completion
            assert labels[: len(example.prompt_ids)] == [-100] * len(example.prompt_ids)
    assert "ref_logps" not in batch and "ref_kl_logps" not in batch
    scored = [dataclasses.replace(e, ref_logp=-float(i), ref_kl_logp=-0.5) for i, e in enumerate(examples)]
    batch = KTOCollator(tokenizer.pad_token_id)(scored)
    assert batch["ref_logps"].tolist() == [0.0, -1.0, -2.0]
    assert batch["ref_kl_logps"].dtype == torch.float32
    assert batch["ref_kl_logps"].tolist() == [-0.5] * 3


def test_prompt_only_rows_keep_prompt_and_columns(tokenizer):
    rows = [
        {"prompt": QUESTION, "answer": "7"},
        {"prompt": [USER], "answer": "7", "source": "math"},
    ]
    standard, conversational = tokenize_prompt_dataset(rows, tokenizer)
    assert tokenizer.decode(standard.prompt_ids) == QUESTION
    assert tokenizer.eos_token_id not in standard.prompt_ids
    assert standard.prompt == QUESTION
    assert standard.columns == {"answer": "7"}
    assert tokenizer.decode(conversational.prompt_ids) == RENDERED_PROMPT
    assert conversational.prompt == [USER]
    assert conversational.columns == {"answer": "7", "source": "math"}
    (cut,) = tokenize_prompt_dataset(rows[:1], tokenizer, max_prompt_length=4, truncation=True)
    assert tokenizer.decode(cut.prompt_ids) == " 3 plus 4?"
    assert cut.prompt == QUESTION


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"answer": "7"}, "row 1: missing 'prompt'"),
        ({"prompt": ""}, "row 1: 'prompt' is empty"),
        ({"prompt": 7}, "row 1: 'prompt' must be text or a list of messages, got int"),
        ({"prompt": []}, "row 1: 'prompt' must be a non-empty list of messages"),
        ({"prompt": QUESTION}, "row 1: the prompt has 6 tokens, over max_prompt_length=5"),
    ],
)
def test_bad_prompt_rows_name_the_row(tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        tokenize_prompt_dataset([{"prompt": "the"}, row], tokenizer, max_prompt_length=5)


def test_prompt_collator_pads_on_the_left(tokenizer):
    examples = tokenize_prompt_dataset([{"prompt": QUESTION}, {"prompt": "the model"}], tokenizer)
    batch = PromptCollator(tokenizer.pad_token_id)(examples)
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [examples[0].prompt_ids, [pad] * 4 + examples[1].prompt_ids]
    assert batch["attention_mask"].tolist() == [[1] * 6, [0] * 4 + [1] * 2]
    assert batch["examples"] == examples
