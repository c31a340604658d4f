"""TRL 1.16 as the oracle for the DPO family: one optimizer step of TRL's own ``DPOTrainer`` (every
``loss_type``; LD-DPO's ``ld_alpha``, with a live or precomputed reference; f-DPO's
``f_divergence_type``, WPO's ``use_weighting``; ``truncation_mode`` keep_end),
``CPOTrainer`` (cpo sigmoid/hinge/ipo; simpo is its loss type) and ``ORPOTrainer``, and of ``fastalign
train`` on the same tiny model, rows and options give the same loss, gradient norm and metrics.

DPO's reference is a perturbed copy of the policy (``ref_model_name_or_path``), so the log-ratios are not
zero and every loss type's formula is exercised away from its value at the start."""

from __future__ import annotations

import pytest
import torch

from fastalign.builtin import tiny_preference_rows
from fastalign.ops.preference import DPO_LOSS_TYPES
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from tests.helpers import require
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
#: TRL 1.16's DPOTrainer also logs these: the mean over the vocabulary of the logits averaged over the
#: chosen / rejected completion tokens, the chosen tokens' argmax accuracy (from the fused head's row
#: statistics: no logits), and the running count of non-padding tokens.
HEAD = ("logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens")


def assert_equal(ours: dict, theirs: dict, keys) -> None:
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_one_step_equals_trl(models, tmp_path, loss_type):
    require("trl")
    from trl import DPOConfig, DPOTrainer

    options = dict(beta=0.1, loss_type=[loss_type], label_smoothing=SMOOTHED.get(loss_type, 0.0))
    ours = fastalign_step(
        "dpo", PAIRS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1], **options
    )
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], **options)
    assert abs(theirs["rewards/margins"]) > 1e-3  # the reference differs: the formula is exercised
    assert_equal(ours, theirs, ("loss", "grad_norm", "entropy", *REWARDS, *HEAD))


#: DPO options beyond the loss type, each with loss types whose formulas use them differently: LD-DPO
#: (summed, length-normalised and sorted log-ratios), f-DPO (every divergence; the sigmoid, hinge,
#: length-normalised and smoothed forms), WPO (pair-wise and per-log-ratio losses, a weighted mixture),
#: and all three at once; DiscoPOP's temperature.
OPTION_CASES = {
    "ld-sigmoid": dict(ld_alpha=0.5, loss_type=["sigmoid"]),
    "ld-ipo": dict(ld_alpha=0.3, loss_type=["ipo"]),
    "ld-aot": dict(ld_alpha=0.0, loss_type=["aot"], label_smoothing=0.1),
    "forward_kl-sigmoid": dict(f_divergence_type="forward_kl", loss_type=["sigmoid"]),
    "js-hinge": dict(f_divergence_type="js_divergence", loss_type=["hinge"]),
    "alpha-sigmoid_norm": dict(
        f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, loss_type=["sigmoid_norm"]
    ),
    "alpha-robust": dict(
        f_divergence_type="alpha_divergence",
        f_alpha_divergence_coef=1.7,
        loss_type=["robust"],
        label_smoothing=0.1,
    ),
    "discopop-tau": dict(discopop_tau=0.5, loss_type=["discopop"]),
    "wpo-sigmoid": dict(use_weighting=True, loss_type=["sigmoid"]),
    "wpo-mixture": dict(use_weighting=True, loss_type=["ipo", "bco_pair"], loss_weights=[0.7, 0.3]),
    "all-three": dict(
        ld_alpha=0.5, f_divergence_type="js_divergence", use_weighting=True, loss_type=["sigmoid"]
    ),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_dpo_option_step_equals_trl(models, tmp_path, case):
    require("trl")
    from trl import DPOConfig, DPOTrainer

    options = dict(beta=0.1, **OPTION_CASES[case])
    ours = fastalign_step(
        "dpo", PAIRS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1], **options
    )
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], **options)
    (tmp_path / "plain").mkdir()
    plain = fastalign_step(
        "dpo",
        PAIRS,
        tmp_path / "plain",
        model_name_or_path=models[0],
        ref_model_name_or_path=models[1],
        beta=0.1,
        loss_type=options["loss_type"],
        **{key: options[key] for key in ("label_smoothing", "loss_weights") if key in options},
    )
    # the option changes the step by more than the tolerance of the comparison below
    assert abs(ours["loss"] - plain["loss"]) > 2 * 2e-4 * abs(plain["loss"]), (ours["loss"], plain["loss"])
    assert_equal(ours, theirs, ("loss", "grad_norm", "entropy", *REWARDS, *HEAD))


def test_ld_alpha_with_precomputed_reference_equals_trl_and_the_live_reference(models, tmp_path):
    """LD-DPO weights the reference's tokens past the pair's shorter completion by ``ld_alpha``, as the
    policy's: precomputed reference log-probs are those weighted sums (TRL's too), not plain sums."""
    require("trl")
    from trl import DPOConfig, DPOTrainer

    options = dict(beta=0.1, ld_alpha=0.3, loss_type=["sigmoid"], ref_model_name_or_path=models[1])
    runs = {}
    for name, precompute in (("live", False), ("precomputed", True)):
        (tmp_path / name).mkdir()
        runs[name] = fastalign_step(
            "dpo", PAIRS, tmp_path / name, model_name_or_path=models[0],
            precompute_ref_log_probs=precompute, **options,
        )  # fmt: skip
    theirs = trl_step(
        DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], precompute_ref_log_probs=True,
        **{key: value for key, value in options.items() if key != "ref_model_name_or_path"},
    )  # fmt: skip
    assert abs(theirs["rewards/margins"]) > 1e-3  # the reference differs: its log-probs count
    assert_equal(runs["precomputed"], runs["live"], ("loss", "grad_norm", *REWARDS))
    assert_equal(runs["precomputed"], theirs, ("loss", "grad_norm", "entropy", *REWARDS, *HEAD))


def test_keep_end_truncation_step_equals_trl(models, tmp_path):
    """``truncation_mode: keep_end`` keeps each prompt + completion's last max_length tokens, as TRL's
    collator cuts them: rows of a pair can then start at different prompt tokens, or past the prompt."""
    require("trl")
    from trl import DPOConfig, DPOTrainer

    options = dict(beta=0.1, loss_type=["sigmoid"], max_length=12, truncation_mode="keep_end")
    ours = fastalign_step(
        "dpo", PAIRS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1],
        truncation=True, **options,
    )  # fmt: skip
    theirs = trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], **options)
    (tmp_path / "whole").mkdir()
    whole = fastalign_step(
        "dpo", PAIRS, tmp_path / "whole", model_name_or_path=models[0], ref_model_name_or_path=models[1],
        beta=0.1, loss_type=["sigmoid"],
    )  # fmt: skip
    assert ours["logps/rejected"] > whole["logps/rejected"] + 1.0  # the rows were cut
    assert_equal(ours, theirs, ("loss", "grad_norm", "entropy", *REWARDS, *HEAD))


#: Combinations TRL 1.16 refuses (or would silently ignore), and the keys fastalign's error names.
REFUSED = [
    (dict(f_divergence_type="forward_kl", loss_type=["bco_pair"]), "f_divergence_type"),
    (dict(f_divergence_type="js_divergence", loss_type=["sigmoid", "apo_zero"]), "f_divergence_type"),
    (dict(f_alpha_divergence_coef=0.3), "f_alpha_divergence_coef"),  # only alpha_divergence reads it
    (dict(use_weighting=True, loss_type=["aot"], label_smoothing=0.1), "use_weighting"),
    (dict(use_weighting=True, loss_type=["sigmoid", "sft"]), "use_weighting"),
    (dict(discopop_tau=0.2), "discopop_tau"),  # only loss_type discopop reads it
    (dict(alpha=0.1), "alpha"),  # cpo's and simpo's (dpo does not read it)
]


@pytest.mark.parametrize(("options", "key"), REFUSED)
def test_refused_dpo_options_are_a_config_error_naming_the_key(options, key):
    with pytest.raises(ConfigError, match=key):
        make_objective("dpo", TrainConfig(**options), DistributedContext(0, 1, 0, torch.device("cpu")))


@pytest.mark.parametrize(
    ("loss_type", "hint"), [("simpo", "simpo`$"), ("alphapo", "simpo` with cpo_alpha: 0 and alpha")]
)
def test_cpos_simpo_and_alphapo_loss_types_point_to_the_simpo_objective(loss_type, hint):
    with pytest.raises(ConfigError, match=f"TRL's CPO loss type {loss_type} is `fastalign train {hint}"):
        make_objective(
            "cpo", TrainConfig(loss_type=[loss_type]), DistributedContext(0, 1, 0, torch.device("cpu"))
        )


@pytest.mark.parametrize("name", ["cpo", "simpo", "orpo", "kto"])
@pytest.mark.parametrize(
    "options", [dict(ld_alpha=0.5), dict(use_weighting=True), dict(f_divergence_type="forward_kl")]
)
def test_dpo_options_are_refused_for_other_objectives(name, options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        make_objective(name, TrainConfig(**options), DistributedContext(0, 1, 0, torch.device("cpu")))


def test_trl_refuses_what_fastalign_refuses(models, tmp_path):
    """The refusals above that are TRL's own: its DPOTrainer raises for them too."""
    require("trl")
    from trl import DPOConfig, DPOTrainer

    for options in (
        dict(f_divergence_type="forward_kl", loss_type=["bco_pair"]),
        dict(use_weighting=True, loss_type=["aot"]),
    ):
        with pytest.raises((ValueError, NotImplementedError)):
            trl_step(DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], **options)
    with pytest.raises(RuntimeError, match="memory location"):  # sft's expanded loss weighted in place
        trl_step(
            DPOTrainer, DPOConfig, PAIRS, tmp_path, models[0], ref_model=models[1], use_weighting=True,
            loss_type=["sigmoid", "sft"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "loss_type", "alpha"),
    [
        ("cpo", "sigmoid", 0.0),
        ("cpo", "hinge", 0.0),
        ("cpo", "ipo", 0.0),
        ("simpo", "sigmoid", 0.0),
        ("orpo", "sigmoid", 0.0),
        ("cpo", "ipo", -0.3),  # AlphaPO (on summed log-probs TRL's fp32 p^-α overflows on these rows:
        # tests/losses/test_preference.py checks those against its formula in float64)
        ("simpo", "sigmoid", 0.25),  # TRL's loss_type alphapo, with the NLL on
    ],
)
def test_reference_free_step_equals_trl(models, tmp_path, name, loss_type, alpha):
    if name == "orpo":
        require("trl")
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        require("trl")
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer

    shape = {"alpha": alpha} if alpha else {}
    ours_options = {"loss_type": [loss_type]} if name == "cpo" else {}
    ours = fastalign_step(
        name, PAIRS, tmp_path, model_name_or_path=models[0], beta=0.1, **ours_options, **shape
    )
    their_options = (
        {} if name == "orpo" else {"loss_type": "simpo" if name == "simpo" else loss_type, **shape}
    )
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
