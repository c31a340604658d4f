"""TRL 1.16 as the oracle where a prompt and its completion meet: TRL tokenizes the prompt alone and the
prompt + completion together, and the completion starts where the two first differ. That differs from
tokenizing them apart where a token spans the boundary (a prompt ending in a space, which byte-level BPE
merges into the next word) and where a chat template renders the prompt alone otherwise than inside the
conversation. One step of TRL's SFT, DPO, KTO and CPO trainers and of fastalign's on such rows gives the
same loss, gradient norm and token count; TRL's CPO also ends conversational completions with EOS."""

from __future__ import annotations

import logging

import pytest

from fastalign.builtin import tiny_kto_rows, tiny_preference_rows, tiny_sft_rows, tiny_tokenizer
from fastalign.data.preference import tokenize_kto_dataset, tokenize_preference_dataset
from fastalign.data.sft import tokenize_sft_dataset
from tests.helpers import require
from tests.parity.conftest import save_models
from tests.parity.steps import both_steps

pytestmark = pytest.mark.slow

#: A template whose generation prompt ("reply: ") the rendered conversation does not have.
ODD_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'reply: ' }}{% endif %}"
)


def odd_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ODD_TEMPLATE
    return tokenizer


def space_first(row: dict) -> dict:
    """The row with each completion's leading space moved to the end of the prompt, where the tiny
    tokenizer's BPE merges it into the completion's first word (" The", " 7")."""
    completions = {key: row[key] for key in ("completion", "chosen", "rejected") if key in row}
    return {
        **row,
        "prompt": row["prompt"] + " ",
        **{key: value.removeprefix(" ") for key, value in completions.items()},
    }


def implicit(row: dict, mid_word: bool = False) -> dict:
    """The preference row with its prompt inside both completions (TRL's ``extract_prompt`` finds it by
    characters), the rejected one the chosen one with one character changed: the last digit (they part
    mid-number), or (``mid_word``) the completion's third, where the text they share ends inside a token
    (" Th" of " The")."""
    chosen = row["prompt"] + row["chosen"]
    at = len(row["prompt"]) + 3 if mid_word else max(i for i, char in enumerate(chosen) if char.isdigit())
    changed = "y" if mid_word else str((int(chosen[at]) + 1) % 10)
    return {"chosen": chosen, "rejected": chosen[:at] + changed + chosen[at + 1 :]}


def conversational(row: dict) -> dict:
    completions = {key: row[key] for key in ("completion", "chosen", "rejected") if key in row}
    return {
        **row,
        "prompt": [{"role": "user", "content": row["prompt"]}],
        **{key: [{"role": "assistant", "content": value.strip()}] for key, value in completions.items()},
    }


def test_a_merged_boundary_starts_the_completion_where_the_tokenizations_differ(caplog):
    tokenizer = tiny_tokenizer()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = {"prompt": "The answer is ", "completion": "7."}
    with caplog.at_level(logging.WARNING):
        (example,) = tokenize_sft_dataset([row], tokenizer)
    whole = [*ids("The answer is 7."), tokenizer.eos_token_id]
    assert example.input_ids == whole  # the row's own tokenization, not the prompt's + the completion's
    assert ids("The answer is ")[:3] == whole[:3] and ids("The answer is ")[3:] != whole[3:4]
    assert example.loss_mask == [0, 0, 0] + [1] * (len(whole) - 3)
    assert "in 1 of 1 rows the prompt's own tokens are not a prefix" in caplog.text
    assert "lacks the prompt's end ' '" in caplog.text


def test_a_template_that_renders_the_prompt_otherwise_is_split_as_trl_splits_it(caplog):
    tokenizer = odd_tokenizer()
    user, reply = [{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}]
    rows = [{"prompt": user, "chosen": reply, "rejected": [{"role": "assistant", "content": "5"}]}]
    with caplog.at_level(logging.WARNING):
        (example,) = tokenize_preference_dataset(rows, tokenizer)
    whole = tokenizer.apply_chat_template(user + reply, tokenize=True, return_dict=True)["input_ids"]
    assert example.prompt_ids + example.chosen_ids == list(whole)
    assert tokenizer.decode(example.chosen_ids).startswith("assistant: 4")
    assert "lacks the prompt's end 'reply: '" in caplog.text
    kto = [{"prompt": user, "completion": reply, "label": True}]
    (unpaired,) = tokenize_kto_dataset(kto, tokenizer)
    assert unpaired.prompt_ids + unpaired.completion_ids == list(whole)


def test_rows_whose_prompt_is_a_prefix_warn_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        tokenize_sft_dataset(tiny_sft_rows(4), tiny_tokenizer())
    assert "not a prefix" not in caplog.text


OBJECTIVES = ("sft", "dpo", "kto", "cpo")


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory) -> tuple[str, str]:
    return save_models(tmp_path_factory.mktemp("odd-template-models"), odd_tokenizer)


@pytest.mark.parametrize(
    ("objective", "rows_of"),
    [
        *((objective, rows_of) for rows_of in ("space-first", "odd-template") for objective in OBJECTIVES),
        ("dpo", "implicit"),
        ("cpo", "implicit"),
        ("dpo", "implicit-mid-word"),  # TRL's CPO refuses such rows: docs/trl.md
    ],
)
def test_one_step_equals_trl(objective, rows_of, odd_models, tmp_path):
    trl = require("trl")
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, reference = odd_models
    rows = {
        "sft": tiny_sft_rows(4, seed=4),
        "dpo": tiny_preference_rows(4, seed=4),
        "kto": tiny_kto_rows(8, seed=4),
        "cpo": tiny_preference_rows(4, seed=4),
    }[objective]
    shape = {
        "space-first": space_first,
        "odd-template": conversational,
        "implicit": implicit,
        "implicit-mid-word": lambda row: implicit(row, mid_word=True),
    }[rows_of]
    rows = [shape(row) for row in rows]
    trainer, config = {
        "sft": (trl.SFTTrainer, trl.SFTConfig),
        "dpo": (trl.DPOTrainer, trl.DPOConfig),
        "kto": (trl.KTOTrainer, trl.KTOConfig),
        "cpo": (CPOTrainer, CPOConfig),
    }[objective]
    options = {} if objective == "sft" else {"beta": 0.1}
    ref = {"ref_model_name_or_path": reference} if objective in ("dpo", "kto") else {}
    tokenizer = odd_tokenizer()
    ours, theirs = both_steps(objective, trainer, config, rows, tmp_path, policy, tokenizer, **ref, **options)
    if "num_tokens" in theirs:
        assert ours["num_tokens"] == theirs["num_tokens"]
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


def test_cpo_splits_an_implicit_prompt_ending_inside_a_token_where_the_ids_part():
    """TRL's CPO trainer raises on this row (docs/trl.md); fastalign splits it as DPO's: BOS, the ids the
    two texts share, then each text's own remaining ids and EOS."""
    tokenizer = tiny_tokenizer()
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = implicit(tiny_preference_rows(4, seed=4)[2], mid_word=True)
    (example,) = tokenize_preference_dataset([row], tokenizer, cpo_special_tokens=True)
    eos = [tokenizer.eos_token_id]
    assert example.prompt_ids[0] == tokenizer.bos_token_id
    assert example.prompt_ids[1:] + example.chosen_ids == ids(row["chosen"]) + eos
    assert example.prompt_ids[1:] + example.rejected_ids == ids(row["rejected"]) + eos
    assert example.chosen_ids[0] != example.rejected_ids[0]  # " The" against " Th" "y": the first id differs
