"""``truncation_mode`` (TRL 1.16's SFTConfig / DPOConfig): which end of an over-long row ``truncation``
keeps. TRL is the oracle: its SFTTrainer's prepared data set, and its DPOTrainer's collated batches (TRL
cuts preference rows in its collator, each prompt + completion on its own), on the same rows."""

from __future__ import annotations

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_preference_rows, tiny_tokenizer
from fastalign.data.preference import LengthLimits, PreferenceCollator, tokenize_preference_dataset
from fastalign.models.structure import IGNORE_INDEX
from fastalign.train.config import ConfigError, TrainConfig, check_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from tests.helpers import require

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))
CONVERSATION = [
    {"role": "user", "content": "What is 2 plus 3? Answer in words."},
    {"role": "assistant", "content": "Two plus three is five."},
]
#: SFT rows of each format, each longer than SFT_MAX_LENGTH, none with a prompt that fills it (TRL drops a
#: row that keep_start leaves without a loss token; fastalign refuses it).
SFT_ROWS = [
    [{"text": "the model learns to count: one two three four five six seven"}],
    [{"prompt": "What is 3 plus 4?", "completion": " The answer is seven, not eight."}],
    [{"messages": CONVERSATION}],
    [{"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:]}],
]
SFT_MAX_LENGTH = 24
#: Preference rows: prompt + completion, each on its own (as TRL's preference collator cuts).
MAX_LENGTH = 12


def _sft_ours(rows: list[dict], **options) -> list[tuple[list[int], list[int]]]:
    objective = make_objective("sft", TrainConfig(**options), CPU)
    examples = objective.tokenize(rows, tiny_tokenizer())
    return [
        (e.input_ids, [t if keep else IGNORE_INDEX for t, keep in zip(e.input_ids, e.loss_mask, strict=True)])
        for e in examples
    ]


def _sft_trl(rows: list[dict], tmp_path, **options) -> list[tuple[list[int], list[int]]]:
    import datasets

    require("trl")
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], bf16=False, use_cpu=True, **options)
    trainer = SFTTrainer(
        model=tiny_model("llama"),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("case", range(len(SFT_ROWS)))
def test_sft_rows_are_cut_as_trl_cuts_them(tmp_path, case, mode):
    rows = SFT_ROWS[case]
    options = dict(max_length=SFT_MAX_LENGTH, truncation_mode=mode)
    ours = _sft_ours(rows, truncation=True, **options)
    assert ours == _sft_trl(rows, tmp_path, **options)
    whole = _sft_ours(rows, max_length=4096)
    assert all(len(ids) > SFT_MAX_LENGTH for ids, _ in whole)  # every row was cut
    kept = slice(None, SFT_MAX_LENGTH) if mode == "keep_start" else slice(-SFT_MAX_LENGTH, None)
    assert ours == [(ids[kept], labels[kept]) for ids, labels in whole]


#: Preference rows whose completions differ in length (so keep_end cuts the two rows' prompts at
#: different tokens), some with a completion longer than MAX_LENGTH (its row keeps no prompt); standard
#: and conversational (a data set holds one or the other).
PAIRS = {
    "standard": tiny_preference_rows(6, seed=3),
    "conversational": [
        {
            "prompt": CONVERSATION[:1],
            "chosen": CONVERSATION[1:],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
        {
            "prompt": CONVERSATION[:1],
            "chosen": [{"role": "assistant", "content": "Five."}],
            "rejected": [{"role": "assistant", "content": "It is five, I think."}],
        },
    ],
}


def _trl_preference_batch(rows: list[dict], tmp_path, **options) -> dict[str, torch.Tensor]:
    """TRL's DPOTrainer's collated batch of all ``rows``, labels as its loss builds them."""
    import datasets

    require("trl")
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], bf16=False, use_cpu=True, **options)
    trainer = DPOTrainer(
        model=tiny_model("llama"),
        ref_model=tiny_model("llama"),  # not built from the policy's path: it has none
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(rows),
    )
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    batch = trainer.data_collator([{key: row[key] for key in keys} for row in trainer.train_dataset])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


@pytest.mark.parametrize("kind", list(PAIRS))
def test_dpo_rows_are_cut_as_trls_collator_cuts_them(tmp_path, kind):
    tokenizer, rows = tiny_tokenizer(), PAIRS[kind]
    config = TrainConfig(max_length=MAX_LENGTH, truncation=True, truncation_mode="keep_end")
    objective = make_objective("dpo", config, CPU)
    examples = objective.tokenize(rows, tokenizer)
    ours = objective.collate(tokenizer)(examples)
    theirs = _trl_preference_batch(rows, tmp_path, max_length=MAX_LENGTH, truncation_mode="keep_end")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].tolist() == theirs[key].tolist(), key
    # the cases the rows are for: rows of a pair starting at different prompt tokens, a row with no prompt
    assert any(e.chosen_prompt_start != e.rejected_prompt_start for e in examples)
    assert any(max(len(e.chosen_ids), len(e.rejected_ids)) == MAX_LENGTH for e in examples)


def test_keep_end_keeps_each_rows_last_tokens():
    """prompt 0..9; completions of 3 and 6 tokens; max_length 8: each row is its last 8 tokens."""
    limits = LengthLimits(max_length=8, truncation=True, truncation_mode="keep_end")
    fitted = limits.fit(list(range(10)), {"chosen": [20, 21, 22], "rejected": list(range(30, 36))}, "row 0")
    rows = {
        field: fitted.prompt_ids[fitted.prompt_starts[field] :] + ids
        for field, ids in fitted.completions.items()
    }
    assert rows == {"chosen": [5, 6, 7, 8, 9, 20, 21, 22], "rejected": [8, 9, *range(30, 36)]}
    assert fitted.prompt_ids == [5, 6, 7, 8, 9]  # no further back than a row needs
    long = limits.fit([1, 2], {"chosen": [3], "rejected": list(range(30, 40))}, "row 0")
    assert long.completions["rejected"] == list(range(32, 40)) and long.prompt_starts["rejected"] == 2
    with pytest.raises(ValueError, match=r"row 0: prompt \+ 'rejected' has 12 tokens.*truncation is off"):
        LengthLimits(max_length=8, truncation_mode="keep_end").fit(
            [1, 2], {"rejected": list(range(10))}, "row 0"
        )


def test_the_collator_builds_each_row_from_its_own_prompt_start():
    tokenizer = tiny_tokenizer()
    (example,) = tokenize_preference_dataset(
        PAIRS["standard"][:1], tokenizer, max_length=MAX_LENGTH, truncation=True, truncation_mode="keep_end"
    )
    batch = PreferenceCollator(tokenizer.pad_token_id)([example])
    for row, (start, completion) in enumerate(
        [
            (example.chosen_prompt_start, example.chosen_ids),
            (example.rejected_prompt_start, example.rejected_ids),
        ]
    ):
        length = int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :length].tolist() == example.prompt_ids[start:] + completion
        assert (batch["labels"][row, :length] != IGNORE_INDEX).sum() == len(completion)


# --- what cannot work is a ConfigError naming the key -------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"truncation_mode": "keep_middle"}, "'truncation_mode' must be one of keep_start, keep_end"),
        ({"truncation_mode": "keep_end"}, "'truncation_mode' \\('keep_end'\\) .* needs truncation: true"),
        (
            {"truncation_mode": "keep_end", "truncation": True, "packing": True},
            "'truncation_mode' \\('keep_end'\\) cannot go with packing",
        ),
    ],
)
def test_truncation_mode_that_would_be_ignored_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        check_config(TrainConfig(**options))


@pytest.mark.parametrize("name", ["kto", "cpo", "simpo", "orpo", "grpo", "rloo"])
def test_objectives_without_truncation_mode_in_trl_refuse_keep_end(name):
    """TRL 1.16's KTOConfig, CPOConfig, ORPOConfig, GRPOConfig and RLOOConfig have no truncation_mode."""
    require("trl")
    import trl
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    configs = {"kto": trl.KTOConfig, "cpo": CPOConfig, "simpo": CPOConfig, "orpo": ORPOConfig}
    configs |= {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig}
    assert "truncation_mode" not in configs[name].__dataclass_fields__
    assert (
        "truncation_mode" in trl.DPOConfig.__dataclass_fields__
        and "truncation_mode" in trl.SFTConfig.__dataclass_fields__
    )
    extra = {"reward_funcs": ["fastalign.builtin:digit_ratio"]} if name in ("grpo", "rloo") else {}
    config = TrainConfig(truncation=True, truncation_mode="keep_end", **extra)
    with pytest.raises(
        ConfigError, match=f"'truncation_mode' \\('keep_end'\\) is for sft, dpo, distill; {name} does not"
    ):
        make_objective(name, config, CPU)
