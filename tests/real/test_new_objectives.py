"""PPO, online DPO and distillation on the real SmolLM2-135M-Instruct, one short run each, checked where
the answer is known exactly: before any update the policy is its own reference (PPO's KL 0 and ratio 1,
online DPO's loss ln 2 and zero margins) and its own teacher (distillation's divergence 0), and a
2-layer student cut from it learns the full model's distributions. Kept short (a step or two, two
prompts, 8 sampled tokens) for the suite's CPU budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fastalign.train.engine import Callback
from fastalign.train.objectives.ppo import VALUE_MODEL
from fastalign.train.run import run_training
from tests.real.data import real_prompt_rows, real_sft_rows
from tests.real.model import smollm2_student
from tests.train.runs import logged, short_config

pytestmark = pytest.mark.real

#: Two prompts ("What is the capital of France?", ... Germany) with their ``answer`` column.
PROMPTS = real_prompt_rows()[:2]


def config(smollm2, tmp_path: Path, rows: list[dict], **options):
    """One step on ``rows`` from SmolLM2 (``tests.train.runs.short_config``'s other defaults)."""
    defaults = dict(
        model_name_or_path=str(smollm2),
        max_steps=1,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        save_strategy="no",
    )
    return short_config(tmp_path, rows, **defaults | options)


def test_distill_from_itself_diverges_nowhere_in_training_and_evaluation(smollm2, tmp_path):
    """SmolLM2 as its own teacher, on-policy (lmbda 1) from prompt-only rows: the divergence on the
    completions it samples is 0 in training and in evaluation (also on samples), through two different
    paths (the teacher's head handed out of its forward, the student's fused inside its own)."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in PROMPTS))
    run = config(
        smollm2,
        tmp_path,
        PROMPTS,
        teacher_model_name_or_path=str(smollm2),
        per_device_train_batch_size=2,
        max_completion_length=8,
        eval_dataset_name=str(held_out),
        eval_strategy="steps",
        per_device_eval_batch_size=2,
    )
    step, evaluation = logged(run_training(run, "distill"))
    assert step["loss"] == pytest.approx(0, abs=1e-6) and step["grad_norm"] == pytest.approx(0, abs=1e-3)
    assert 0 < step["entropy"] < math.log(49152)  # nats: a real distribution, below the uniform's
    assert evaluation["eval_loss"] == pytest.approx(0, abs=1e-6) and evaluation["eval_entropy"] > 0


def test_a_two_layer_student_learns_the_full_models_distributions(smollm2, tmp_path):
    """The first two of SmolLM2's 30 layers (its embeddings, tied head and final norm) as the student,
    on the data's completions (lmbda 0): far from the teacher at first, and a step on the same rows
    brings it closer."""
    student = smollm2_student(tmp_path / "student")
    run = config(
        smollm2,
        tmp_path,
        real_sft_rows()[:4],
        model_name_or_path=str(student),
        teacher_model_name_or_path=str(smollm2),
        lmbda=0.0,
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
    )
    first, second = logged(run_training(run, "distill"))
    assert first["loss"] > 0.5 and math.isfinite(second["loss"])  # reverse KL, nats a token
    assert second["loss"] < first["loss"] - 0.05


def test_online_dpo_first_step_is_ln2_against_itself(smollm2, tmp_path):
    """Two sampled answers to each prompt, ranked by whether they name the capital; the reference is
    the initial policy, so every log-ratio is 0: the sigmoid loss is ln 2 and the margins 0."""
    run = config(
        smollm2,
        tmp_path,
        PROMPTS,
        reward_funcs=["contains_answer"],
        per_device_train_batch_size=2,
        max_new_tokens=8,
    )
    (step,) = logged(run_training(run, "online_dpo"))
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "objective/kl"):
        assert step[key] == pytest.approx(0, abs=1e-5), key
    assert step["logps/chosen"] < 0 and step["logps/rejected"] < 0
    assert 0 <= step["objective/scores"] <= 1 and 0 <= step["val/contain_eos_token"] <= 1
    assert math.isfinite(step["grad_norm"])


class _Policy(Callback):
    """The policy's parameters after the last step, keyed as the exported file keys them."""

    def on_step_end(self, engine, metrics):
        self.weights = {
            name: parameter.detach().clone()
            for name, parameter in engine.model.named_parameters()
            if not name.startswith(VALUE_MODEL)
        }


def test_ppo_first_step_against_itself_and_the_export_is_the_trained_policy(smollm2, tmp_path):
    """A critic from the same checkpoint (a new score head on every token), one PPO step: the rollout's
    KL to the reference (the initial policy) is 0 and the first pass's ratio 1; the losses are finite;
    the exported model is the trained policy alone, reloadable by transformers."""
    policy = _Policy()
    run = config(
        smollm2,
        tmp_path,
        PROMPTS,
        reward_funcs=["contains_answer"],
        per_device_train_batch_size=2,
        max_completion_length=8,
        num_ppo_epochs=1,
        num_mini_batches=1,
        kl_coef=0.05,
    )
    (step,) = logged(run_training(run, "ppo", callbacks=[policy]))
    for key in ("objective/kl", "objective/non_score_reward", "policy/approxkl_avg", "policy/clipfrac_avg"):
        assert step[key] == pytest.approx(0, abs=1e-5), key
    assert step["val/ratio"] == pytest.approx(1, abs=1e-5)
    assert all(math.isfinite(step[key]) for key in ("loss", "loss/policy_avg", "loss/value_avg", "grad_norm"))
    assert step["loss/value_avg"] > 0  # a new value head is far from the returns

    exported = load_file(Path(run.output_dir) / "model.safetensors")
    assert not any(VALUE_MODEL in key or "score" in key for key in exported)
    initial = load_file(Path(smollm2) / "model.safetensors")
    changed = 0
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, policy.weights[key], rtol=0, atol=0, msg=key)
        changed += not torch.equal(tensor, initial[key])
    assert changed > len(exported) // 2  # trained, and saved after training
    reloaded = AutoModelForCausalLM.from_pretrained(run.output_dir, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, policy.weights["model.embed_tokens.weight"])  # tied
