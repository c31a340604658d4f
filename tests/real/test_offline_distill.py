"""Offline distillation on the real SmolLM2-135M-Instruct, through the commands a user runs:
``fastalign teacher-logprobs`` stores the model's own top-32 log-probs of a few rows (conversational
training rows, plain-text evaluation rows into DIR/eval), which equal a plain transformers forward's full
log-softmax; then
``fastalign train distill --teacher_logprobs_path`` trains a 2-layer student cut from it on them without
ever loading the teacher, its first logged loss being TRL's top-k + tail-bucket forward KL computed here
from scratch in float64. Kept short (4 rows, 2 steps) for the suite's CPU budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastalign.cli.main import main
from fastalign.data.teacher_logprobs import EVAL_DIR, TeacherLogprobs, read_manifest, row_hash
from fastalign.train.config import TrainConfig
from fastalign.train.objectives.distill import DistillObjective
from tests.real.data import real_sft_rows
from tests.real.model import smollm2_student
from tests.train.runs import logged

pytestmark = pytest.mark.real

K = 32
MAX_LENGTH = 64
#: The training rows: conversational (through the chat template).
ROWS = real_sft_rows()[:4]
#: The evaluation rows: plain text (no template; a data set is one format or the other).
EVAL_ROWS = [
    {
        "prompt": f"Q: What is the capital of {country}?\nA:",
        "completion": f" The capital of {country} is {city}.",
    }
    for country, city in (("Norway", "Oslo"), ("Kenya", "Nairobi"))
]
#: Log-prob tolerance (nats) between the scoring pass and a plain fp32 forward in float64: the scoring
#: pass runs the patched model (its Triton kernels: RMSNorm, RoPE, SwiGLU) on a padded batch and the
#: fused head over vocabulary slices with a running fp32 log-sum-exp; the reference runs transformers'
#: modules on each row alone and one float64 log-softmax. Logits of magnitude ~20 in fp32 have an ulp of
#: ~2e-6, and the two differ by about that (at most 2.2e-6 on a log-prob, 3.1e-6 on a tail, on these
#: rows): 2e-5 is ten times that, and far below what a wrong position, token or temperature moves.
ATOL = 2e-5


def examples(tokenizer, rows: list[dict]) -> list:
    """``rows`` tokenized as ``train distill`` tokenizes them (the hashes their scores are stored by)."""
    config = TrainConfig(teacher_logprobs_path="scores", beta=0.0, max_length=MAX_LENGTH)
    return DistillObjective.from_config("distill", config, None).tokenize(rows, tokenizer)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def completion_logprobs(model, example) -> torch.Tensor:
    """The model's full next-token log-softmax [completion tokens, vocab] (float64) at the positions that
    predict ``example``'s completion, from its plain forward on the row alone (no padding)."""
    ids = torch.tensor([example.prompt_ids + example.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(example.prompt_ids) - 1 : -1]
    return logits.double().log_softmax(-1)


def check_scores(teacher, rows: list, stored: TeacherLogprobs) -> None:
    """Each row's stored top-k ids and log-probs, tail and completion-token log-probs are the teacher's
    full log-softmax's (``ATOL``)."""
    for example in rows:
        assert len(example.completion_ids) >= 7  # the answer, and its end of turn
        full = completion_logprobs(teacher, example)
        row = stored.get(row_hash(example.prompt_ids, example.completion_ids))
        ids, lps, tail = row["ids"].long(), row["logprobs"].double(), row["tail"].double()
        top = full.topk(K + 1, -1)
        assert (lps[:, 1:] <= lps[:, :-1]).all()  # sorted, best first
        torch.testing.assert_close(lps, top.values[:, :K], rtol=0, atol=ATOL)
        torch.testing.assert_close(full.gather(1, ids), lps, rtol=0, atol=ATOL)
        # torch.topk's ids, but where two of the reference's log-probs are within the tolerance (a tie)
        gaps = top.values[:, :-1] - top.values[:, 1:]  # rank i to rank i + 1, the (k+1)-th included
        gap = torch.minimum(gaps, torch.cat([torch.full_like(gaps[:, :1], math.inf), gaps[:, :-1]], 1))
        tied = gap < 2 * ATOL
        assert torch.equal(ids[~tied], top.indices[:, :K][~tied])
        assert all(len(set(token)) == K for token in ids.tolist())  # K distinct ids a token
        # the tail is the log of the rest, log(1 - Σ exp(top-k)): compared in mass, since 1 - Σ exp of
        # the stored (fp32) top-k is off by ~1e-6 in mass, which is up to 0.2 nats in log-space where the
        # teacher is sure (a tail mass of 6e-6 here); and in log-space against the reference's own rest
        torch.testing.assert_close(tail.exp(), 1 - lps.exp().sum(-1), rtol=0, atol=ATOL)
        rest = full.scatter(1, ids, -math.inf).logsumexp(-1)
        torch.testing.assert_close(tail, rest, rtol=0, atol=ATOL)
        tokens = torch.tensor(example.completion_ids)
        torch.testing.assert_close(
            row["token_logprobs"].double(), full.gather(1, tokens[:, None])[:, 0], rtol=0, atol=ATOL
        )


def test_scores_then_trains_a_student_without_the_teacher(smollm2, tmp_path, monkeypatch, capsys):
    data, held_out = write_rows(tmp_path / "rows.jsonl", ROWS), write_rows(tmp_path / "eval.jsonl", EVAL_ROWS)
    scores = tmp_path / "scores"

    # 1. the teacher's top-32 of both data sets, as the command stores them, against a plain forward's
    scoring = ["teacher-logprobs", "--model_name_or_path", str(smollm2), "--dataset_name", str(data)]
    scoring += ["--eval_dataset_name", str(held_out), "--top_k", str(K), "--output_dir", str(scores)]
    assert main([*scoring, "--max_length", str(MAX_LENGTH), "--per_device_eval_batch_size", "4"]) == 0
    assert f"scored 4 rows into {scores} and 2 eval rows into {scores / EVAL_DIR}" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    teacher = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    stored = TeacherLogprobs(scores)
    for rows, directory in ((ROWS, scores), (EVAL_ROWS, scores / EVAL_DIR)):
        manifest = read_manifest(directory)
        assert manifest.complete and (manifest.k, manifest.rows) == (K, len(rows))
        check_scores(teacher, examples(tokenizer, rows), TeacherLogprobs(directory))
    del teacher

    # 2. two steps of a 2-layer student on them: β 0, the tail bucket on, the teacher never loaded
    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr("fastalign.train.run.load_frozen_model", no_teacher)
    student = smollm2_student(tmp_path / "student")
    run = tmp_path / "run"
    training = ["train", "distill", "--model_name_or_path", str(student), "--dataset_name", str(data)]
    training += ["--teacher_logprobs_path", str(scores), "--beta", "0", "--max_length", str(MAX_LENGTH)]
    training += ["--per_device_train_batch_size", str(len(ROWS)), "--max_steps", "2", "--logging_steps", "1"]
    training += ["--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--save_strategy", "no"]
    training += ["--output_dir", str(run), "--loss_curve_png", "false", "--seed", "0"]
    assert main(training) == 0
    first, second = logged(run)
    assert (first["step"], second["step"]) == (1, 2)

    # step 1's loss: TRL's forward KL over the support [top-32 | tail] of every completion token, over
    # the tokens, from the untrained student's full logits (float64)
    initial = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for example in examples(tokenizer, ROWS):
        s = completion_logprobs(initial, example)
        row = stored.get(row_hash(example.prompt_ids, example.completion_ids))
        t_top = row["logprobs"].double()
        s_top = s.gather(1, row["ids"].long())
        t_tail, s_tail = torch.log1p(-t_top.exp().sum(-1)), torch.log1p(-s_top.exp().sum(-1))
        kl = (t_top.exp() * (t_top - s_top)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
        total, count = total + float(kl.sum()), count + kl.numel()
    expected = total / count
    assert expected > 1  # 28 layers fewer: far from the teacher (20 nats a token)
    assert first["loss"] == pytest.approx(expected, rel=1e-5)  # 3e-8 apart (fp32 Triton kernels)
    assert second["loss"] < first["loss"] and 0 < first["entropy"] < math.log(tokenizer.vocab_size)

    exported = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32)
    assert exported.config.num_hidden_layers == 2 and torch.equal(
        exported.lm_head.weight, exported.model.embed_tokens.weight
    )
    assert not torch.equal(exported.model.embed_tokens.weight, initial.model.embed_tokens.weight)  # trained
