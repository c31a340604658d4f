"""TRL 1.16 as the oracle for SFT: one optimizer step of TRL's own ``SFTTrainer`` and of ``fastalign train
sft`` on the same tiny model and prompt-completion rows (completion-only loss, TRL's default for them, and
without it) give the same loss and gradient norm."""

from __future__ import annotations

import pytest

from fastalign.builtin import tiny_sft_rows
from tests.parity.steps import fastalign_step, trl_step

pytestmark = pytest.mark.slow

ROWS = tiny_sft_rows(8, seed=7)


@pytest.mark.parametrize("completion_only_loss", [None, False])
def test_one_step_equals_trl(models, tmp_path, completion_only_loss):
    from trl import SFTConfig, SFTTrainer

    ours = fastalign_step(
        "sft", ROWS, tmp_path, model_name_or_path=models[0], completion_only_loss=completion_only_loss
    )
    theirs = trl_step(
        SFTTrainer,
        SFTConfig,
        ROWS,
        tmp_path,
        models[0],
        max_length=128,
        completion_only_loss=completion_only_loss,
    )
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])
