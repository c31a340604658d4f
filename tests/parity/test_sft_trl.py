"""TRL 1.16 as the oracle for SFT: one optimizer step of TRL's own ``SFTTrainer`` and of ``fastalign train
sft`` on the same tiny model and prompt-completion rows (completion-only loss, TRL's default for them, and
without it; the nll and dft losses) give the same loss, gradient norm, entropy, token accuracy and
``num_tokens``."""

from __future__ import annotations

import pytest

from fastalign.builtin import tiny_sft_rows
from tests.helpers import require
from tests.parity.steps import fastalign_step, trl_step

pytestmark = pytest.mark.slow

ROWS = tiny_sft_rows(8, seed=7)


@pytest.mark.parametrize(
    ("completion_only_loss", "loss_type"), [(None, "nll"), (False, "nll"), (None, "dft"), (False, "dft")]
)
def test_one_step_equals_trl(models, tmp_path, completion_only_loss, loss_type):
    require("trl")
    from trl import SFTConfig, SFTTrainer

    ours = fastalign_step(
        "sft",
        ROWS,
        tmp_path,
        model_name_or_path=models[0],
        completion_only_loss=completion_only_loss,
        loss_type=[loss_type],
    )
    theirs = trl_step(
        SFTTrainer,
        SFTConfig,
        ROWS,
        tmp_path,
        models[0],
        max_length=128,
        completion_only_loss=completion_only_loss,
        loss_type=loss_type,
    )
    for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["nll", "dft"]])
def test_a_loss_type_sft_does_not_have_is_refused(loss_type):
    from fastalign.train.config import ConfigError, TrainConfig
    from fastalign.train.objectives.sft import SFTOptions

    with pytest.raises(ConfigError, match="'loss_type' for sft must be one of nll, dft"):
        SFTOptions.from_config(TrainConfig(loss_type=loss_type))
