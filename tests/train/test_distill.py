"""``fastalign train distill`` against TRL 1.16's generalized JSD (``GKDTrainer.generalized_jsd_loss``, the
divergence ``DistillationTrainer`` computes chunk by chunk), and through the runner.

Sampling is not compared: the loss is, on given completions (the data's), with the same student and
teacher: TRL's on the full [tokens, vocab] logits, fastalign's through the fused ``linear_divergence`` on
the two models' hidden states."""

from __future__ import annotations

import dataclasses
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
from tests import torchrun
from tests.helpers import require
from tests.parity.conftest import models, softcap_models  # noqa: F401 (student, perturbed teacher)
from tests.train.runs import logged, short_config, train

WORKER = Path(__file__).with_name("train_worker.py")

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def trl_loss_and_grads(model_dirs, batch, beta, temperature) -> tuple[float, float, dict]:
    require("trl")
    from trl.experimental.gkd import GKDTrainer

    student = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).train()
    teacher = AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32).eval()
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, width:] = batch["input_ids"][:, width:].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1]
    student_logits = student(**inputs).logits[:, :-1]
    # DistillationTrainer's entropy: of the student's softmax(logits / T), a mean over completion tokens
    log_p = (student_logits.detach() / temperature).log_softmax(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)[labels[:, 1:] != -100].mean()
    loss = GKDTrainer.generalized_jsd_loss(
        student_logits,
        teacher_logits,
        labels[:, 1:],
        beta=beta,
        temperature=temperature,
        num_items_in_batch=batch["completion_mask"].sum(),
    )
    loss.backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters()}
    return float(loss.detach()), float(entropy), grads


def fastalign_loss_and_grads(model_dirs, beta, temperature, train=True) -> tuple[dict, float, float, dict]:
    """The loss on the first three built-in rows' own completions, in one micro-batch (``train``: the
    student in training mode, with gradients). lmbda below 1 keeps the data's completions (with lmbda 1
    every completion is sampled, from the prompt alone)."""
    config = TrainConfig(
        teacher_model_name_or_path=model_dirs[1], beta=beta, temperature=temperature, lmbda=0.5
    )
    objective = make_objective("distill", config, CPU)
    tokenizer = tiny_tokenizer()

    def load(path):
        return fastalign.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))

    student, objective.teacher = load(model_dirs[0]).train(train), load(model_dirs[1]).eval()
    examples = objective.tokenize(tiny_sft_rows(3), tokenizer)
    batch = objective.collate(tokenizer)(examples)
    loss, metrics = objective.compute_loss(student, batch, torch.tensor(objective.loss_tokens(batch)))
    if not train:
        return batch, float(loss.detach()), float(metrics["entropy"]), {}
    loss.backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters()}
    return batch, float(loss.detach()), float(metrics["entropy"]), grads


@pytest.mark.slow
@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.5, 0.7), (1.0, 1.0), (0.3, 2.0)])
def test_loss_and_gradients_equal_trls_generalized_jsd(models, beta, temperature):  # noqa: F811
    batch, ours, our_entropy, our_grads = fastalign_loss_and_grads(models, beta, temperature)
    # completions of different lengths after prompts of different lengths: padding on both sides
    assert batch["completion_mask"].sum(-1).unique().numel() > 1 or batch["attention_mask"].min() == 0
    theirs, their_entropy, their_grads = trl_loss_and_grads(models, batch, beta, temperature)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7) and ours > 0
    assert our_entropy == pytest.approx(their_entropy, rel=1e-5)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.5, 0.7), (1.0, 2.0)])
def test_a_final_logit_softcap_equals_trls_generalized_jsd(softcap_models, beta, temperature):  # noqa: F811
    """Gemma-2 student and teacher capped at 0.2 (tests/parity/conftest.py): both models' logits are
    capped in the fused divergence, as in TRL's full logits."""
    _, ours, our_entropy, our_grads = fastalign_loss_and_grads(softcap_models, beta, temperature)
    batch, *_ = fastalign_loss_and_grads(softcap_models, beta, temperature, train=False)
    theirs, their_entropy, their_grads = trl_loss_and_grads(softcap_models, batch, beta, temperature)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7) and ours > 0
    assert our_entropy == pytest.approx(their_entropy, rel=1e-5)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def save_teacher(directory: Path, model) -> None:
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)


def distill_config(tmp_path: Path, rows: list[dict], **options) -> TrainConfig:
    teacher = tmp_path / "teacher"
    if not teacher.exists():  # a test may have saved its own
        save_teacher(teacher, tiny_model("llama", seed=1))
    defaults = dict(teacher_model_name_or_path=str(teacher), per_device_train_batch_size=2, max_length=64)
    if options.get("lmbda", 1.0) != 0 or options.get("seq_kd"):  # else nothing is sampled, nor read
        defaults["max_completion_length"] = 4
    return short_config(tmp_path, rows, **defaults | options)


def run(tmp_path: Path, rows: list[dict], **options) -> list[dict]:
    return train(distill_config(tmp_path, rows, **options), "distill")


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
    assert all(0 < row["entropy"] < math.log(512) for row in logged)  # nats, below the uniform's


@pytest.mark.slow
def test_two_processes_under_fsdp2_equal_one(tmp_path):
    """Under FSDP2 the teacher's LM head is its root unit's gathered weight, which the teacher's forward
    reshards as it returns, before the student's forward reads it: each step's loss, gradient norm and
    entropy on 2 processes (half the rows each, both models sharded) equal 1 process's."""
    rows = tiny_sft_rows(8)
    one = distill_config(
        tmp_path, rows, lmbda=0.0, per_device_train_batch_size=4, output_dir=str(tmp_path / "one")
    )
    two = dataclasses.replace(one, per_device_train_batch_size=2, output_dir=str(tmp_path / "two"))
    run_training(one, "distill")
    torchrun.run_two_processes(WORKER, json.dumps([["distill", dataclasses.asdict(two)]]))
    for one_row, two_row in zip(logged(one.output_dir), logged(two.output_dir), strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), key


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


# --- prompt-only rows and evaluation ---------------------------------------------------------------
def prompt_only(rows: list[dict]) -> list[dict]:
    return [{"prompt": row["prompt"]} for row in rows]


def held_out_file(tmp_path: Path, rows: list[dict]) -> str:
    """``rows`` as the held-out data file (``eval_dataset_name``)."""
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [{}, {"lmbda": 0.5, "seq_kd": True}], ids=["student-samples-all", "teacher-samples-the-rest"]
)
def test_prompt_only_rows_train_when_every_micro_batch_is_sampled(tmp_path, options):
    """TRL's DistillationTrainer reads only the ``prompt`` column: prompt-only rows (standard text, and
    messages ending with the user's) train wherever every micro-batch's completions are sampled."""
    text = prompt_only(tiny_sft_rows(2))
    chat = [{"messages": [{"role": "user", "content": row["prompt"]}]} for row in tiny_sft_rows(4)[2:]]
    logged = run(tmp_path, text + chat, gradient_accumulation_steps=2, **options)
    assert [row["step"] for row in logged] == [1, 2]
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 and row["grad_norm"] > 0 for row in logged)


def test_a_prompt_only_row_where_the_data_completion_is_read_is_named(tmp_path):
    """lmbda < 1 without seq_kd trains some micro-batches on the data's completions: the first
    prompt-only row is named, with the field and the way out, before any step."""
    rows = tiny_sft_rows(4)
    rows[2] = {"prompt": rows[2]["prompt"]}
    with pytest.raises(ValueError, match=r"rows.jsonl line 3: no 'completion' .*lmbda 0.5.*seq_kd true"):
        run(tmp_path, rows, lmbda=0.5)


def test_a_prompt_only_held_out_row_is_named_when_evaluation_reads_completions(tmp_path):
    """With lmbda < 1 evaluation scores the held-out completions (GKD's): seq_kd samples every training
    batch, but a prompt-only held-out row is named."""
    held_out = held_out_file(tmp_path, [*tiny_sft_rows(1), *prompt_only(tiny_sft_rows(2))])
    with pytest.raises(ValueError, match=r"held_out.jsonl line 2: no 'completion' .*evaluation.*lmbda 1"):
        run(
            tmp_path,
            tiny_sft_rows(4),
            lmbda=0.5,
            seq_kd=True,
            eval_dataset_name=held_out,
            eval_strategy="steps",
        )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "system", "content": "Be brief."}]},
            r"row 0: 'messages' ends with a 'system'",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, r"row 0: messages\[0\] must be a message"),
        ({"prompt": "What is 40 plus 2? " * 20}, r"row 0: the prompt has \d+ tokens, over max_length=16"),
        (
            {"text": "What is 40 plus 2?"},
            r"row 0: distill reads 'prompt' .*'messages'; the row has \['text'\]",
        ),
    ],
)
def test_rows_that_cannot_be_read_are_named(row, message):
    objective = make_objective("distill", TrainConfig(teacher_model_name_or_path="t", max_length=16), CPU)
    with pytest.raises(ValueError, match=message):
        objective.tokenize([row], tiny_tokenizer())


def test_a_long_prompt_only_row_keeps_its_end_under_truncation():
    """Its end is where sampling starts (the generation prompt of a conversation), whatever
    truncation_mode says of prompt-completion rows."""
    config = TrainConfig(teacher_model_name_or_path="t", max_length=16, truncation=True)
    objective = make_objective("distill", config, CPU)
    prompt = "What is 40 plus 2? " * 20
    (example,) = objective.tokenize([{"prompt": prompt}], tiny_tokenizer())
    assert example.prompt_ids == tiny_tokenizer()(prompt, add_special_tokens=False)["input_ids"][-16:]
    assert example.completion_ids == []


def evaluated(output_dir) -> dict:
    return next(row for row in logged(output_dir) if "eval_loss" in row)


@pytest.mark.slow
def test_on_policy_evaluation_equals_trls_distillation_trainer(models, tmp_path):  # noqa: F811
    """lmbda 1 is TRL's DistillationTrainer, whose evaluation samples the student's completions of the
    held-out prompts (their own completions unread) and weighs each batch's token-mean loss by its rows.
    Both sides decode greedily (``generation_kwargs``), so they score the same completions: the
    evaluation loss and entropy before the first step are TRL's ``evaluate()``'s, and the first training
    step's completion lengths (one step of every training row, whatever their order) are TRL's."""
    import datasets
    from torch.utils.data import SequentialSampler

    require("trl")
    from trl import DistillationConfig, DistillationTrainer

    rows = tiny_sft_rows(8)
    held_out = rows[4:6] + prompt_only(rows[6:8])  # two batches of two; the completions are not read
    shared = dict(
        per_device_eval_batch_size=2,
        max_completion_length=4,
        generation_kwargs={"do_sample": False},
        beta=0.5,
        temperature=0.8,
        seed=0,
        per_device_train_batch_size=4,
    )
    ours = distill_config(
        tmp_path,
        prompt_only(rows[:4]),
        model_name_or_path=models[0],  # the teacher: another tiny Llama (distill_config's)
        max_steps=1,
        eval_dataset_name=held_out_file(tmp_path, held_out),
        eval_strategy="steps",
        eval_on_start=True,
        **shared,
    )
    ours_logged = logged(run_training(ours, "distill"))
    ours = next(row for row in ours_logged if "eval_loss" in row)
    our_step = next(row for row in ours_logged if "loss" in row)

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    args = DistillationConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        max_steps=1,
        logging_steps=1,
        **shared,
    )
    trainer = DistillationTrainer(
        model=load(models[0]),
        teacher_model=load(str(tmp_path / "teacher")),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(prompt_only(rows[:4])),
        eval_dataset=datasets.Dataset.from_list(held_out),
    )
    trainer._get_eval_sampler = SequentialSampler  # the held-out rows in their order, as fastalign's
    theirs = trainer.evaluate()

    assert ours["step"] == 0
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5) and ours["eval_loss"] > 0
    assert ours["eval_entropy"] == pytest.approx(theirs["eval_entropy"], rel=1e-5)
    trainer.train()
    their_step = next(row for row in trainer.state.log_history if "loss" in row)
    lengths = sorted(key for key in their_step if key.startswith("completions/"))
    assert len(lengths) == 7 and lengths == sorted(key for key in our_step if key.startswith("completions/"))
    for key in lengths:
        assert our_step[key] == pytest.approx(their_step[key]), key


@pytest.mark.slow
def test_evaluation_below_lmbda_1_scores_the_held_out_completions(models, tmp_path):  # noqa: F811
    """GKD's evaluation (lmbda < 1): the loss on the held-out rows' own completions, a token mean over
    them all (micro-batches of 2 and 1 rows), as one forward of all three rows gives it."""
    config = distill_config(
        tmp_path,
        tiny_sft_rows(4),
        model_name_or_path=models[0],
        teacher_model_name_or_path=models[1],
        lmbda=0.5,
        max_steps=1,
        per_device_eval_batch_size=2,
        eval_dataset_name=held_out_file(tmp_path, tiny_sft_rows(3)),
        eval_strategy="steps",
        eval_on_start=True,
    )
    ours = evaluated(run_training(config, "distill"))

    _, loss, entropy, _ = fastalign_loss_and_grads(models, beta=1.0, temperature=1.0, train=False)
    assert ours["step"] == 0
    assert ours["eval_loss"] == pytest.approx(loss, rel=1e-5) and loss > 0
    assert ours["eval_entropy"] == pytest.approx(entropy, rel=1e-5)
