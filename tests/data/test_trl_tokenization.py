"""Where TRL 1.16's trainers tokenize otherwise than a prompt and its completion side by side: KTO's
mismatched completions start from the other row's whole completion, the distillation trainer samples from
the prompt tokenized alone, and GRPO's, RLOO's and distillation's text prompts start with the tokenizer's
own special tokens (online DPO's do not)."""

from __future__ import annotations

import torch

from fastalign.builtin import tiny_tokenizer
from fastalign.data.preference import (
    tokenize_kto_dataset,
    tokenize_prompt_dataset,
    with_mismatched_completions,
)
from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import OBJECTIVES, make_objective
from tests.parity.test_bos_tokenizer_trl import bos_tokenizer


def test_a_mismatched_completion_is_the_other_rows_whole_completion_cut_for_its_new_prompt():
    tokenizer = tiny_tokenizer()
    long_prompt = "What is the capital of France and of Spain and of Italy? "
    rows = [
        {"prompt": long_prompt, "completion": "The answer is Paris, Madrid and Rome.", "label": True},
        {"prompt": "Hi", "completion": "no", "label": False},
    ]
    examples = tokenize_kto_dataset(rows, tokenizer, max_length=44, truncation=True)
    assert len(examples[0].completion_ids) < len(examples[0].whole_completion_ids)  # cut for its prompt
    paired = with_mismatched_completions(examples, block=2, max_length=44)
    room = 44 - len(examples[1].prompt_ids)
    assert paired[1].kl_completion_ids == examples[0].whole_completion_ids[:room]
    assert len(paired[1].kl_completion_ids) > len(examples[0].completion_ids)
    assert paired[0].kl_completion_ids == examples[1].completion_ids


def test_distillation_with_lmbda_1_samples_from_the_prompt_tokenized_alone():
    config = TrainConfig(teacher_model_name_or_path="tiny-llama", lmbda=1.0)
    objective = make_objective("distill", config, DistributedContext(0, 1, 0, torch.device("cpu")))
    tokenizer = bos_tokenizer()
    with_completion, alone = objective.tokenize(
        [{"prompt": "The answer is ", "completion": "7."}, {"prompt": "The answer is "}], tokenizer
    )
    assert with_completion.prompt_ids == alone.prompt_ids
    assert alone.prompt_ids == tokenizer("The answer is ")["input_ids"]  # BOS first, the space kept


def test_grpo_rloo_and_distill_prompts_start_with_the_tokenizers_bos_online_dpos_do_not():
    tokenizer = bos_tokenizer()
    (prompt,) = tokenize_prompt_dataset([{"prompt": "2 + 2 ="}], tokenizer, special_tokens=True)
    assert prompt.prompt_ids == tokenizer("2 + 2 =")["input_ids"]
    assert prompt.prompt_ids[0] == tokenizer.bos_token_id
    (plain,) = tokenize_prompt_dataset([{"prompt": "2 + 2 ="}], tokenizer)
    assert plain.prompt_ids == prompt.prompt_ids[1:]
    flags = {name: OBJECTIVES[name].prompt_special_tokens for name in ("grpo", "rloo", "online_dpo", "ppo")}
    assert flags == {"grpo": True, "rloo": True, "online_dpo": False, "ppo": False}
