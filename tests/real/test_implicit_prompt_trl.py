"""Preference rows with an implicit prompt, tokenized by the real SmolLM2 tokenizer, split as TRL 1.16's
DPOTrainer splits them: ``extract_prompt``'s shared characters (less a space right before the first that
differs), then prompt and prompt + completion tokenized. Before, fastalign cut at the shared token ids:
where the tokenizer makes the space before a digit or a newline run its own token, that token went to the
prompt and TRL's completions scored it (``logps/chosen`` -21.5 against TRL's -32.3, the IPO loss 23.77
against 24.17)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from fastalign.data.preference import tokenize_kto_dataset, tokenize_preference_dataset
from tests.helpers import require

pytestmark = pytest.mark.real

ROWS = [
    {"chosen": "What is 2+2? It is 4", "rejected": "What is 2+2? It is 5"},  # " " its own token before digits
    {"chosen": "x\n\nyes", "rejected": "x\n\nno"},  # a newline run merged with what follows
    {"chosen": "Sum: 1234", "rejected": "Sum: 1299"},
    {"chosen": "The answer is yes", "rejected": "The answer is yesterday"},  # one the other's beginning
    {"chosen": "It's fine", "rejected": "It'll be"},
    {"chosen": "a  b", "rejected": "a  c"},
]


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_implicit_prompts_are_split_as_trls_dpo_trainer_splits_them(smollm2, tmp_path):
    require("trl")
    import datasets
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = tiny_llama(tokenizer)
    args = DPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_length=128, bf16=False
    )
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, processing_class=copy.deepcopy(tokenizer),
        train_dataset=datasets.Dataset.from_list(ROWS),
    )  # fmt: skip
    theirs = [(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in trainer.train_dataset]
    logging.getLogger("fastalign.data.prompt_split").setLevel(logging.ERROR)  # TRL warns of it too
    ours = [
        (example.prompt_ids, example.chosen_ids, example.rejected_ids)
        for example in tokenize_preference_dataset(ROWS, tokenizer, max_length=128)
    ]
    assert ours == theirs


def test_kto_unpairs_preference_pairs_as_trls_kto_trainer(smollm2, tmp_path):
    """TRL's KTOTrainer takes preference pairs (explicit or implicit prompt) and unpairs them: each pair's
    chosen completion desirable, its rejected one undesirable, all the chosen first. Before, fastalign
    refused them: "row 0: missing 'completion'"."""
    require("trl")
    import datasets
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = tiny_llama(tokenizer)
    args = KTOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", max_length=128, bf16=False,
        per_device_train_batch_size=2,
    )  # fmt: skip
    explicit = [
        {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5"},
        {"prompt": "Color?", "chosen": " Blue", "rejected": " Red"},
    ]
    for rows in (explicit, ROWS[:3]):
        trainer = KTOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=args, processing_class=copy.deepcopy(tokenizer),
            train_dataset=datasets.Dataset.from_list(rows),
        )  # fmt: skip
        theirs = [(row["prompt_ids"], row["completion_ids"], row["label"]) for row in trainer.train_dataset]
        logging.getLogger("fastalign.data.prompt_split").setLevel(logging.ERROR)
        ours = [
            (example.prompt_ids, example.completion_ids, example.label)
            for example in tokenize_kto_dataset(rows, tokenizer, max_length=128)
        ]
        assert ours == theirs and len(ours) == 2 * len(rows)
