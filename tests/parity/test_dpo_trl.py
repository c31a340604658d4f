"""TRL 1.16 as the oracle for the DPO family: for every ``loss_type``, one optimizer step of TRL's own
``DPOTrainer`` and of ``fastalign train dpo`` on the same tiny model, reference model, rows and options
give the same loss, gradient norm and metrics.

The reference is a perturbed copy of the policy (``ref_model_name_or_path``), so the log-ratios are not
zero and every loss type's formula is exercised away from its value at the start. Both run in fp32 on the
CPU, without gradient checkpointing (TRL 1.16 turns bf16 and checkpointing on by default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_preference_rows, tiny_tokenizer
from fastalign.ops.preference import DPO_LOSS_TYPES
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

pytestmark = pytest.mark.slow

PAIRS = tiny_preference_rows(8, seed=3)
#: label_smoothing where TRL's formula uses it (robust, exo_pair, aot, aot_unpaired); elsewhere 0.
SMOOTHED = {"robust": 0.1, "exo_pair": 0.1, "aot": 0.1, "aot_unpaired": 0.1}
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def fastalign_step(models, output_dir: Path, loss_type: str) -> dict:
    policy, reference = models
    rows = output_dir.parent / "pairs.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    config = TrainConfig(
        model_name_or_path=policy,
        ref_model_name_or_path=reference,
        dataset_name=str(rows),
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=len(PAIRS),
        learning_rate=1e-3,
        logging_steps=1,
        loss_curve_png=False,
        beta=0.1,
        loss_type=[loss_type],
        label_smoothing=SMOOTHED.get(loss_type, 0.0),
        max_length=128,
        seed=0,
    )
    run_training(config, "dpo")
    return json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[0])


def trl_step(models, output_dir: Path, loss_type: str) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    policy, reference = models
    args = DPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(PAIRS),
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        beta=0.1,
        loss_type=[loss_type],
        label_smoothing=SMOOTHED.get(loss_type, 0.0),
        save_strategy="no",
        seed=0,
    )
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32),
        ref_model=AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(PAIRS),
    )
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_one_step_equals_trl(models, tmp_path, loss_type):
    ours = fastalign_step(models, tmp_path / "fastalign", loss_type)
    theirs = trl_step(models, tmp_path / "trl", loss_type)
    assert abs(theirs["rewards/margins"]) > 1e-3  # the reference differs: the formula is exercised
    for key in METRICS:
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


def trl_experimental_step(models, output_dir: Path, name: str, loss_type: str) -> dict:
    """One step of TRL 1.16's CPOTrainer (cpo; simpo is its loss type) or ORPOTrainer (orpo)."""
    import datasets

    if name == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    from transformers import AutoModelForCausalLM

    options = {} if name == "orpo" else {"loss_type": "simpo" if name == "simpo" else loss_type}
    args = Config(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(PAIRS),
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        beta=0.1,
        save_strategy="no",
        seed=0,
        **options,
    )
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(PAIRS),
    )
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize(
    ("name", "loss_type"),
    [("cpo", "sigmoid"), ("cpo", "hinge"), ("cpo", "ipo"), ("simpo", "sigmoid"), ("orpo", "sigmoid")],
)
def test_reference_free_step_equals_trl(models, tmp_path, name, loss_type):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    config = TrainConfig(
        model_name_or_path=models[0],
        dataset_name=str(rows),
        output_dir=str(tmp_path / "fastalign"),
        max_steps=1,
        per_device_train_batch_size=len(PAIRS),
        learning_rate=1e-3,
        logging_steps=1,
        loss_curve_png=False,
        beta=0.1,
        max_length=128,
        seed=0,
        **({"loss_type": [loss_type]} if name == "cpo" else {}),
    )
    run_training(config, name)
    ours = json.loads((tmp_path / "fastalign" / "metrics.jsonl").read_text().splitlines()[0])
    theirs = trl_experimental_step(models, tmp_path / "trl", name, loss_type)
    extra = ("log_odds_ratio", "log_odds_chosen") if name == "orpo" else ("loss", "grad_norm", "nll_loss")
    for key in (*METRICS[2:], *extra):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])
    if name == "orpo":
        # The documented difference: ORPO's chosen NLL is over the completion (the paper's L_SFT of y_w
        # given x); TRL 1.16's is over prompt and completion. The odds-ratio term is the same.
        assert ours["nll_loss"] != pytest.approx(theirs["nll_loss"], rel=1e-3)
        odds_term = theirs["loss"] - theirs["nll_loss"]
        assert ours["loss"] - ours["nll_loss"] == pytest.approx(odds_term, rel=2e-4, abs=2e-6)
