"""``fastalign train distill`` against TRL 1.16's generalized JSD (``GKDTrainer.generalized_jsd_loss``, the
divergence ``DistillationTrainer`` computes chunk by chunk), and through the runner.

Sampling is not compared: the loss is, on given completions (the data's), with the same student and
teacher: TRL's on the full [tokens, vocab] logits, fastalign's through the fused ``linear_divergence`` on
the two models' hidden states."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_model, tiny_sft_rows, tiny_tokenizer
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives import make_objective
from fastalign.train.run import run_training
from tests.parity.conftest import models  # noqa: F401 (the student and a perturbed teacher)

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def trl_loss_and_grads(model_dirs, batch, beta, temperature) -> tuple[float, dict]:
    from trl.experimental.gkd import GKDTrainer

    student = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).train()
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32).eval()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, width:] = batch["input_ids"][:, width:].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1]
    loss = GKDTrainer.generalized_jsd_loss(
        student(**inputs).logits[:, :-1],
        teacher_logits,
        labels[:, 1:],
        beta=beta,
        temperature=temperature,
        num_items_in_batch=batch["completion_mask"].sum(),
    )
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in student.named_parameters()}


def fastalign_loss_and_grads(model_dirs, beta, temperature) -> tuple[dict, float, dict]:
    config = TrainConfig(teacher_model_name_or_path=model_dirs[1], beta=beta, temperature=temperature)
    objective = make_objective("distill", config, CPU)
    tokenizer = tiny_tokenizer()

    def load(path):
        return fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))

    student, objective.teacher = load(model_dirs[0]).train(), load(model_dirs[1]).eval()
    examples = objective.tokenize(tiny_sft_rows(3), tokenizer)
    batch = objective.collate(tokenizer)(examples)
    loss, _ = objective.compute_loss(student, batch, torch.tensor(objective.loss_tokens(batch)))
    loss.backward()
    return batch, float(loss.detach()), {name: p.grad.clone() for name, p in student.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.5, 0.7), (1.0, 1.0), (0.3, 2.0)])
def test_loss_and_gradients_equal_trls_generalized_jsd(models, beta, temperature):  # noqa: F811
    batch, ours, our_grads = fastalign_loss_and_grads(models, beta, temperature)
    # completions of different lengths after prompts of different lengths: padding on both sides
    assert batch["completion_mask"].sum(-1).unique().numel() > 1 or batch["attention_mask"].min() == 0
    theirs, their_grads = trl_loss_and_grads(models, batch, beta, temperature)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7) and ours > 0
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def save_teacher(directory: Path, model) -> None:
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)


def run(tmp_path: Path, rows: list[dict], **options) -> list[dict]:
    teacher = tmp_path / "teacher"
    if not teacher.exists():  # a test may have saved its own
        save_teacher(teacher, tiny_model("llama", seed=1))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = TrainConfig(
        dataset_name=str(data),
        output_dir=str(tmp_path / "run"),
        teacher_model_name_or_path=str(teacher),
        max_completion_length=4,
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        max_length=64,
        seed=0,
        loss_curve_png=False,
        **options,
    )
    run_training(config, "distill")
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_steps_on_messages_with_student_and_teacher_samples(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        }
        for row in tiny_sft_rows(8)
    ]
    logged = run(tmp_path, rows, lmbda=0.5, seq_kd=True, gradient_accumulation_steps=2, beta=0.5)
    assert [row["step"] for row in logged] == [1, 2]
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 and row["grad_norm"] > 0 for row in logged)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "teacher_model_name_or_path"),
        ({"teacher_model_name_or_path": "t", "beta": 1.5}, "beta"),
        ({"teacher_model_name_or_path": "t", "seq_kd": True}, "seq_kd"),  # lmbda 1: never reached
        ({"teacher_model_name_or_path": "t", "use_vllm": True}, "use_vllm"),
        ({"teacher_model_name_or_path": "t", "reward_funcs": ["exact_match"]}, "reward_funcs"),
        ({"lmbda": 0.5}, "lmbda"),  # only distill reads it: another objective refuses it
    ],
)
def test_options_that_cannot_work_are_refused(options, key):
    name = "sft" if key == "lmbda" else "distill"
    with pytest.raises(ConfigError, match=key):
        make_objective(name, TrainConfig(**options), CPU)


@pytest.mark.slow
def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes(tmp_path):
    save_teacher(tmp_path / "teacher", tiny_model("llama", vocab_size=640))
    with pytest.raises(ConfigError, match=r"teacher's vocabulary \(640 tokens\).*student's \(512\)"):
        run(tmp_path, tiny_sft_rows(4))
