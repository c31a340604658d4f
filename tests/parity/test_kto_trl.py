"""TRL 1.16 as the oracle for KTO: one optimizer step of TRL's own ``KTOTrainer`` and of ``fastalign
train kto`` on the same tiny model, perturbed reference, rows and options give the same loss, gradient norm
and metrics."""

from __future__ import annotations

import pytest

from fastalign.builtin import tiny_kto_rows
from tests.parity.steps import fastalign_step, trl_step

pytestmark = pytest.mark.slow

ROWS = tiny_kto_rows(8, seed=5)
METRICS = (
    "loss",
    "grad_norm",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_one_step_equals_trl(models, tmp_path, weights):
    from trl import KTOConfig, KTOTrainer

    options = dict(beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1])
    ours = fastalign_step(
        "kto", ROWS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1], **options
    )
    theirs = trl_step(KTOTrainer, KTOConfig, ROWS, tmp_path, models[0], ref_model=models[1], **options)
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])
