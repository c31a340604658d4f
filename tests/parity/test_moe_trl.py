"""TRL 1.16 as the oracle for the router's load-balancing loss of a mixture-of-experts policy: one optimizer
step of TRL's ``SFTTrainer`` / ``DPOTrainer`` and of ``fastalign train sft|dpo`` on a random Mixtral and
Qwen3-MoE (``tests/patching/test_moe.py``'s, from their published configs, saved the way the Hub holds
them: one tensor per expert) give the same loss, gradient norm and ``aux_loss``: the coefficient is the
model config's (Mixtral's 0.02, Qwen3-MoE's 0.001) unless ``router_aux_loss_coef`` sets one; 0 turns the
aux loss off (and its metric with it)."""

from __future__ import annotations

import pytest

from fastalign.builtin import tiny_preference_rows, tiny_sft_rows, tiny_tokenizer
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.objectives.sft import SFTObjective
from tests.helpers import require
from tests.parity.steps import fastalign_step, trl_step
from tests.patching.test_moe import BY_ID
from tests.patching.test_published_configs import build, read_config

pytestmark = pytest.mark.slow

SFT_ROWS = tiny_sft_rows(4, seed=7)
PAIRS = tiny_preference_rows(4, seed=3)
TOLERANCE = dict(rel=2e-4, abs=2e-6)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Family id → the directory of its random model, saved with the tiny tokenizer (built once)."""
    saved: dict[str, str] = {}

    def get(family_id: str) -> str:
        if family_id not in saved:
            root = tmp_path_factory.mktemp(family_id)
            model = build(BY_ID[family_id], read_config(BY_ID[family_id], root / "hub"))
            model.save_pretrained(root / "model")
            tiny_tokenizer().save_pretrained(root / "model")
            saved[family_id] = str(root / "model")
        return saved[family_id]

    return get


def assert_same(ours: dict, theirs: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], **TOLERANCE), (key, ours[key], theirs[key])


@pytest.mark.parametrize(
    ("family_id", "coef"), [("mixtral", None), ("mixtral", 0.5), ("mixtral", 0.0), ("qwen3-moe", None)]
)
def test_sft_step_with_the_aux_loss_equals_trl(moe_models, tmp_path, family_id, coef):
    require("trl")
    from trl import SFTConfig, SFTTrainer

    model = moe_models(family_id)
    ours = fastalign_step("sft", SFT_ROWS, tmp_path, model_name_or_path=model, router_aux_loss_coef=coef)
    theirs = trl_step(
        SFTTrainer, SFTConfig, SFT_ROWS, tmp_path, model, max_length=128, router_aux_loss_coef=coef
    )
    assert_same(ours, theirs, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    if coef == 0.0:
        assert "aux_loss" not in ours and "aux_loss" not in theirs
    else:
        assert_same(ours, theirs, ("aux_loss",))
        assert ours["aux_loss"] > 0


def test_dpo_step_with_the_aux_loss_equals_trl(moe_models, tmp_path):
    require("trl")
    from trl import DPOConfig, DPOTrainer

    model = moe_models("mixtral")
    ours = fastalign_step("dpo", PAIRS, tmp_path, model_name_or_path=model, ref_model_name_or_path=model)
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, model, ref_model=model, max_length=128)
    assert_same(ours, theirs, ("loss", "grad_norm", "aux_loss", "rewards/margins"))


def test_a_coefficient_for_a_model_without_a_router_is_refused(models):
    """As TRL: ``router_aux_loss_coef`` set for a dense model has nothing to weight."""
    from fastalign.builtin import tiny_model

    objective = SFTObjective.from_config("sft", TrainConfig(router_aux_loss_coef=0.1), None)
    with pytest.raises(
        ConfigError, match=r"'router_aux_loss_coef' is 0\.1, but llama is no mixture-of-experts"
    ):
        objective.router_aux.setup(tiny_model("llama"))
