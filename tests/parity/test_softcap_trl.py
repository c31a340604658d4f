"""TRL 1.16 as the oracle on a model with a final-logit softcap (Gemma-2's ``final_logit_softcapping``,
0.2 here so that it bends the logits): the fused heads that score completions inside the patched
forward (``head_fn``, which hands them the softcap) give TRL's loss, gradients and metrics for DPO (its
pair head and its reference) and WPO, KTO, and GRPO at token and sequence level, with and without its KL
term. Before, these objectives refused such a model (distillation's: tests/train/test_distill.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastalign.builtin import tiny_kto_rows, tiny_preference_rows
from tests.helpers import require
from tests.parity.steps import fastalign_step, trl_step
from tests.parity.test_dpo_trl import HEAD, REWARDS, assert_equal
from tests.parity.test_grpo_trl import assert_loss_and_gradients_equal_trl, batch, entropy_margin
from tests.parity.test_kto_trl import METRICS as KTO_METRICS

pytestmark = pytest.mark.slow


def test_the_softcap_bends_the_logits(softcap_models):
    """The fixture exercises the cap: the model's logits are its head's capped, and far from them."""
    model = AutoModelForCausalLM.from_pretrained(softcap_models[0], dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(ids, output_hidden_states=True)
        raw = model.lm_head(output.hidden_states[-1])
    assert model.config.final_logit_softcapping == 0.2
    torch.testing.assert_close(output.logits, 0.2 * torch.tanh(raw / 0.2))
    assert (output.logits - raw).abs().max() > 0.1


@pytest.mark.parametrize("use_weighting", [False, True], ids=["dpo", "wpo"])
def test_dpo_one_step_equals_trl(softcap_models, tmp_path, use_weighting):
    """DPO, and WPO (whose weights take log Σ p² of the capped logits too)."""
    require("trl")
    from trl import DPOConfig, DPOTrainer

    rows = tiny_preference_rows(8, seed=3)
    policy, reference = softcap_models
    options = dict(beta=0.1, loss_type=["sigmoid"], use_weighting=use_weighting)
    ours = fastalign_step(
        "dpo", rows, tmp_path, model_name_or_path=policy, ref_model_name_or_path=reference, **options
    )
    theirs = trl_step(DPOTrainer, DPOConfig, rows, tmp_path, policy, ref_model=reference, **options)
    assert abs(theirs["rewards/margins"]) > 1e-3
    assert_equal(ours, theirs, ("loss", "grad_norm", "entropy", *REWARDS, *HEAD))


def test_kto_one_step_equals_trl(softcap_models, tmp_path):
    require("trl")
    from trl import KTOConfig, KTOTrainer

    rows = tiny_kto_rows(8, seed=5)
    policy, reference = softcap_models
    ours = fastalign_step(
        "kto", rows, tmp_path, model_name_or_path=policy, ref_model_name_or_path=reference, beta=0.1
    )
    theirs = trl_step(KTOTrainer, KTOConfig, rows, tmp_path, policy, ref_model=reference, beta=0.1)
    assert theirs["kl"] > 0
    for key in KTO_METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.parametrize(
    ("level", "quantile"),
    [("token", 1.0), ("sequence", 1.0), ("token", 0.6)],
    ids=["token", "sequence", "entropy-masked"],
)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_and_gradients_equal_trl(softcap_models, tmp_path, level, quantile, beta):
    """Token and sequence level, and the entropy-masked loss (its forward-only pass caps too)."""
    data = batch(AutoModelForCausalLM.from_pretrained(softcap_models[0]).config.vocab_size)
    if quantile < 1:  # no token's entropy within rounding of the threshold (at 0.6: 1.4e-5 away)
        assert entropy_margin(softcap_models[0], data, quantile) > 1e-5
    options = dict(
        loss_type="dapo", importance_sampling_level=level, beta=beta, top_entropy_quantile=quantile
    )
    assert_loss_and_gradients_equal_trl(softcap_models, tmp_path, data, options)
