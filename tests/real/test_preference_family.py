"""KTO, CPO, SimPO and ORPO on the real SmolLM2-135M-Instruct against TRL 1.16's own trainers (the oracle):
one step of each on the same conversational rows, fastalign's fused heads against TRL's logits, gives the
same loss, gradient norm and every metric both log (a 135M model's real log-probs on real text, where a
tiny random model's are all alike)."""

from __future__ import annotations

import pytest

from tests.helpers import require
from tests.parity.steps import fastalign_step, trl_step
from tests.real.data import real_preference_rows

pytestmark = pytest.mark.real

PAIRS = real_preference_rows()[:4]
#: What either side logs of the run, not of the model (timing, schedule, counters).
NOT_COMPARED = {"epoch", "step", "learning_rate", "num_tokens", "mean_token_accuracy"}


def kto_rows() -> list[dict]:
    """Each pair as two unpaired rows, desirable and undesirable, alternating (TRL's KL pairs rotate
    completions within a batch: both sides pair the same rows)."""
    return [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in PAIRS
        for side in ("chosen", "rejected")
    ]


def trainers(name: str):
    """TRL's trainer and config for ``name``, and the options both sides take beyond the shared ones
    (SimPO is CPOTrainer's ``loss_type: simpo`` without the NLL: fastalign's simpo keeps TRL's
    ``cpo_alpha`` default, so it is set on both)."""
    trl = require("trl")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return {
        "kto": (trl.KTOTrainer, trl.KTOConfig, {}, {}),
        "cpo": (CPOTrainer, CPOConfig, {}, {}),
        "simpo": (CPOTrainer, CPOConfig, {"loss_type": "simpo"}, {"cpo_alpha": 0.0}),
        "orpo": (ORPOTrainer, ORPOConfig, {}, {}),
    }[name]


@pytest.mark.parametrize("name", ["kto", "cpo", "simpo", "orpo"])
def test_first_step_equals_trl(name, smollm2, tmp_path):
    from transformers import AutoTokenizer

    trainer, config, trl_only, both = trainers(name)
    rows = kto_rows() if name == "kto" else PAIRS
    options = dict(learning_rate=1e-6, beta=0.1, **both)
    ours = fastalign_step(name, rows, tmp_path, model_name_or_path=str(smollm2), **options)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    theirs = trl_step(
        trainer, config, rows, tmp_path, str(smollm2), tokenizer=tokenizer, **options, **trl_only
    )

    # ORPO's chosen NLL is over the completion (docs/trl.md; TRL's over prompt and completion): the loss,
    # its gradient and the NLL differ by design, the odds-ratio term and every other metric do not
    differs = {"loss", "grad_norm", "nll_loss"} if name == "orpo" else set()
    shared = sorted(set(ours) & set(theirs) - NOT_COMPARED - differs)
    assert len(shared) >= 6 and ({"loss", "grad_norm"} <= set(shared) or name == "orpo"), shared
    for key in shared:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours[key], theirs[key])
    if name == "orpo":
        odds_term = theirs["loss"] - theirs["nll_loss"]
        assert ours["loss"] - ours["nll_loss"] == pytest.approx(odds_term, rel=1e-4, abs=1e-6)
        assert ours["nll_loss"] != pytest.approx(theirs["nll_loss"], rel=1e-3)  # the prompt's tokens
    if name != "kto":  # the model knows its capitals: the chosen answers are likelier
        assert theirs["logps/chosen"] > theirs["logps/rejected"]
