"""Every objective that samples runs its rollouts through fastalign's engine (``sample_groups``), never
``model.generate``, on a model and options the engine takes: a run falling back to ``generate`` would
only say so in a log line."""

from __future__ import annotations

import pytest
from transformers import GenerationMixin

from fastalign.train import rollout
from fastalign.train.config import TrainConfig
from fastalign.train.run import run_training

REWARD = {"reward_funcs": ["fastalign.builtin:digit_ratio"]}
#: objective → the options of a one-step run on the built-in tiny model and data
RUNS = {
    "grpo": REWARD | {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 6},
    "rloo": REWARD | {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 6},
    "ppo": REWARD | {"per_device_train_batch_size": 4, "max_completion_length": 6},
    "online_dpo": REWARD | {"per_device_train_batch_size": 2, "max_new_tokens": 6},
    # the student samples every micro-batch (lmbda 1), and the teacher samples with seq_kd
    "distill": {"teacher_model_name_or_path": "tiny-llama", "lmbda": 1.0, "max_completion_length": 6},
    "distill-seq_kd": {
        "teacher_model_name_or_path": "tiny-llama", "lmbda": 0.0, "seq_kd": True, "max_completion_length": 6,
    },
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_every_sampling_objective_rolls_out_with_the_engine(run, tmp_path, monkeypatch):
    calls = {"engine": 0}
    engine = rollout.sample_groups

    def counted(*args, **kwargs):
        calls["engine"] += 1
        return engine(*args, **kwargs)

    def refused(self, *args, **kwargs):
        raise AssertionError("model.generate was called: the rollout fell back from the engine")

    monkeypatch.setattr(rollout, "sample_groups", counted)
    monkeypatch.setattr(GenerationMixin, "generate", refused)
    config = TrainConfig(
        model_name_or_path="tiny-llama", output_dir=str(tmp_path / "run"), max_steps=1, logging_steps=1,
        save_strategy="no", loss_curve_png=False, seed=0, **RUNS[run],
    )  # fmt: skip
    run_training(config, run.split("-")[0])
    assert calls["engine"] > 0
