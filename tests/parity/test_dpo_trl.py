"""TRL 1.16 as the oracle for the DPO family: one optimizer step of TRL's own ``DPOTrainer`` (every
``loss_type``), ``CPOTrainer`` (cpo sigmoid/hinge/ipo; simpo is its loss type) and ``ORPOTrainer``, and of
``fastalign train`` on the same tiny model, rows and options give the same loss, gradient norm and metrics.

DPO's reference is a perturbed copy of the policy (``ref_model_name_or_path``), so the log-ratios are not
zero and every loss type's formula is exercised away from its value at the start."""

from __future__ import annotations

import pytest

from fastalign.builtin import tiny_preference_rows
from fastalign.ops.preference import DPO_LOSS_TYPES
from tests.parity.steps import fastalign_step, trl_step

pytestmark = pytest.mark.slow

PAIRS = tiny_preference_rows(8, seed=3)
#: label_smoothing where TRL's formula uses it (robust, exo_pair, aot, aot_unpaired); elsewhere 0.
SMOOTHED = {"robust": 0.1, "exo_pair": 0.1, "aot": 0.1, "aot_unpaired": 0.1}
#: What both log (after loss and grad_norm).
REWARDS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def assert_equal(ours: dict, theirs: dict, keys) -> None:
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_one_step_equals_trl(models, tmp_path, loss_type):
    from trl import DPOConfig, DPOTrainer

    options = dict(beta=0.1, loss_type=[loss_type], label_smoothing=SMOOTHED.get(loss_type, 0.0))
    ours = fastalign_step(
        "dpo", PAIRS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1], **options
    )
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], **options)
    assert abs(theirs["rewards/margins"]) > 1e-3  # the reference differs: the formula is exercised
    assert_equal(ours, theirs, ("loss", "grad_norm", *REWARDS))


@pytest.mark.parametrize(
    ("name", "loss_type"),
    [("cpo", "sigmoid"), ("cpo", "hinge"), ("cpo", "ipo"), ("simpo", "sigmoid"), ("orpo", "sigmoid")],
)
def test_reference_free_step_equals_trl(models, tmp_path, name, loss_type):
    if name == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer

    ours_options = {"loss_type": [loss_type]} if name == "cpo" else {}
    ours = fastalign_step(name, PAIRS, tmp_path, model_name_or_path=models[0], beta=0.1, **ours_options)
    their_options = {} if name == "orpo" else {"loss_type": "simpo" if name == "simpo" else loss_type}
    theirs = trl_step(Trainer, Config, PAIRS, tmp_path, models[0], beta=0.1, **their_options)
    if name != "orpo":
        assert_equal(ours, theirs, ("loss", "grad_norm", "nll_loss", *REWARDS))
        return
    assert_equal(ours, theirs, ("log_odds_ratio", "log_odds_chosen", *REWARDS))
    # The documented difference: ORPO's chosen NLL is over the completion (the paper's L_SFT of y_w given
    # x); TRL 1.16's is over prompt and completion. The odds-ratio term is the same.
    assert ours["nll_loss"] != pytest.approx(theirs["nll_loss"], rel=1e-3)
    odds_term = theirs["loss"] - theirs["nll_loss"]
    assert ours["loss"] - ours["nll_loss"] == pytest.approx(odds_term, rel=2e-4, abs=2e-6)
