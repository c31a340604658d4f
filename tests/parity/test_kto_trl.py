"""TRL 1.16 as the oracle for KTO: one optimizer step of TRL's own ``KTOTrainer`` and of ``fastalign
train kto`` on the same tiny model, perturbed reference, rows and options (both loss types) give the same
loss, gradient norm and metrics."""

from __future__ import annotations

import pytest
import torch

from fastalign.builtin import tiny_kto_rows
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from tests.helpers import require
from tests.parity.steps import fastalign_run, fastalign_step, logged, trl_run, trl_step

pytestmark = pytest.mark.slow

ROWS = tiny_kto_rows(8, seed=5)
METRICS = (
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "num_tokens",
)


@pytest.mark.parametrize(
    ("loss_type", "weights"), [("kto", (1.0, 1.0)), ("kto", (1.0, 1.33)), ("apo_zero_unpaired", (1.0, 1.33))]
)
def test_one_step_equals_trl(models, tmp_path, loss_type, weights):
    require("trl")
    from trl import KTOConfig, KTOTrainer

    options = dict(beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1])
    ours = fastalign_step(
        "kto",
        ROWS,
        tmp_path,
        model_name_or_path=models[0],
        ref_model_name_or_path=models[1],
        loss_type=[loss_type],
        **options,
    )
    theirs = trl_step(
        KTOTrainer, KTOConfig, ROWS, tmp_path, models[0], ref_model=models[1], loss_type=loss_type, **options
    )
    if loss_type == "kto":
        assert theirs["kl"] > 0  # the KL reference point is exercised
    else:
        assert ours["kl"] == 0  # apo_zero_unpaired has none, and logs 0 as TRL
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


def test_steps_over_blocks_of_the_batch_size_equal_trl(models, tmp_path):
    """Four steps of two rows: TRL pairs each completion with its block's previous one (of
    per_device_train_batch_size rows) and trains in the data's order; so does fastalign, step by step."""
    require("trl")
    from trl import KTOConfig, KTOTrainer

    options = dict(beta=0.1, per_device_train_batch_size=2, max_steps=4)
    ours = logged(
        fastalign_run(
            "kto", ROWS, tmp_path, model_name_or_path=models[0], ref_model_name_or_path=models[1], **options
        )
    )
    theirs = [
        row
        for row in trl_run(KTOTrainer, KTOConfig, ROWS, tmp_path, models[0], ref_model=models[1], **options)
        if "loss" in row
    ]
    assert len(ours) == len(theirs) == 4
    for step, (mine, trls) in enumerate(zip(ours, theirs, strict=True)):
        for key in METRICS:
            assert mine[key] == pytest.approx(trls[key], rel=2e-4, abs=2e-6), (
                step,
                key,
                mine[key],
                trls[key],
            )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"train_sampling_strategy": "random"},
            "'train_sampling_strategy' \\('random'\\): kto's KL estimate",
        ),
        ({"per_device_train_batch_size": 1}, "'per_device_train_batch_size' \\(1\\): kto's KL estimate"),
    ],
)
def test_kl_pairs_need_the_datas_order_and_two_rows_a_micro_batch(options, message):
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    with pytest.raises(ConfigError, match=message):
        make_objective("kto", TrainConfig(**options), ctx)
    make_objective("kto", TrainConfig(loss_type=["apo_zero_unpaired"], **options), ctx)  # no KL term


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["kto", "apo_zero_unpaired"], []])
def test_kto_takes_one_of_its_own_loss_types(loss_type):
    with pytest.raises(ConfigError, match="'loss_type' for kto"):
        make_objective(
            "kto", TrainConfig(loss_type=loss_type), DistributedContext(0, 1, 0, torch.device("cpu"))
        )
