"""``fastalign train <objective> --help`` lists that objective's keys (type, default, doc) grouped, from the
TrainConfig fields and their comments; ``objective_markdown`` renders the same for the docs pages."""

from __future__ import annotations

import dataclasses

import pytest

from fastalign.cli.main import main
from fastalign.cli.usage import objective_groups, objective_markdown
from fastalign.train.config import TrainConfig
from fastalign.train.config.docs import key_docs
from fastalign.train.objectives import OBJECTIVES


def test_every_key_has_a_type_a_default_a_section_and_a_doc():
    docs = key_docs()
    assert list(docs) == [field.name for field in dataclasses.fields(TrainConfig)]
    assert [name for name, doc in docs.items() if not doc.doc or not doc.section] == []
    assert docs["max_steps"].type == "int" and docs["max_steps"].default == -1
    assert (
        docs["lora_target_modules"].default == ["all-linear"]
        and docs["lora_target_modules"].section == "LoRA"
    )
    assert docs["lora_target_modules"].doc.endswith("(all-linear: every linear layer but the output head)")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_objective_lists_every_key_it_reads_once(name):
    listed = [doc.name for _, docs in objective_groups(name) for doc in docs]
    assert len(listed) == len(set(listed))
    assert OBJECTIVES[name].config_keys(name) <= set(listed)
    assert {"model_name_or_path", "learning_rate", "output_dir", "report_to"} <= set(listed)


def test_train_objective_help_prints_its_keys_grouped(capsys):
    """Before: ``fastalign train sft --help`` printed ``fastalign train --help``, no key."""
    assert main(["train", "sft", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fastalign train sft [--config FILE]")
    assert "\nschedule:\n  --max_steps int (default: -1)\n      > 0 overrides num_train_epochs" in out
    assert "  --packing bool (default: false)\n" in out and "\nsft's own:\n" in out
    assert "--reward_funcs" not in out  # grpo's, not sft's
    assert main(["train", "grpo", "-h"]) == 0
    assert "  --reward_funcs list[str] (default: [])\n" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    assert "OBJECTIVE --help lists the objective's keys" in capsys.readouterr().out


def test_objective_markdown_is_a_table_per_group():
    text = objective_markdown("dpo")
    assert text.startswith("# `fastalign train dpo`\n\n## model and data\n\n| key | type | default | what |")
    assert "| `beta` | `float \\| None` | `None` | None: the objective's TRL default" in text
    assert "## dpo's own" in text
