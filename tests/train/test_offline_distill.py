"""Offline distillation: ``fastalign teacher-logprobs`` (shards, manifest, atomic writes and their mode,
resume, the teacher's fingerprint, ranks, an eval data set into ``eval/``) and ``fastalign train distill
--teacher_logprobs_path`` (the teacher never loaded, rows matched by hash, the manifest's checks,
evaluation on the eval data set's scores)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import stat
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from fastalign.builtin import tiny_model, tiny_sft_rows, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.data.teacher_logprobs import (
    EVAL_DIR,
    MANIFEST,
    TeacherLogprobs,
    disk_bytes_per_token,
    read_manifest,
    row_hash,
    shard_name,
    tail_uniforms,
)
from fastalign.ops.sparse_divergence import linear_topk_logprobs
from fastalign.quant import QuantOptions
from fastalign.train.config import ConfigError, TrainConfig, load_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.objectives import with_objective_defaults
from fastalign.train.objectives.distill import (
    CompletionCollator,
    DistillObjective,
    DistillOptions,
    open_teacher_logprobs,
    tail_samples_in_use,
)
from fastalign.train.run import run_training
from fastalign.train.teacher_logprobs import (
    SCORING_KEYS,
    ScoringOptions,
    _score_batch,
    score_teacher,
    teacher_weights,
)
from tests import torchrun
from tests.helpers import require
from tests.train.runs import logged, short_config

WORKER = Path(__file__).with_name("teacher_logprobs_worker.py")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("teacher")
    tiny_model("llama", seed=1).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def scoring_config(tmp_path: Path, teacher: Path, rows: list[dict], **options) -> TrainConfig:
    data = write_rows(tmp_path / "rows.jsonl", rows)
    defaults = dict(
        model_name_or_path=str(teacher),
        dataset_name=str(data),
        top_k=8,
        output_dir=str(tmp_path / "scores"),
        max_length=64,
        per_device_eval_batch_size=3,
    )
    return TrainConfig(**defaults | options)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_scores_equal_the_teachers_full_log_softmax(tmp_path, teacher_dir, family):
    """Every stored top-k, tail and completion-token log-prob is the teacher's on that row, and rows
    are found by their content hash, in any order; a Gemma-2 teacher's with its final-logit softcap
    (0.2 here, which bends its logits)."""
    overrides = {"final_logit_softcapping": 0.2} if family == "gemma2" else {}
    if family != "llama":
        teacher_dir = tmp_path / "teacher"
        tiny_model(family, seed=1, **overrides).save_pretrained(teacher_dir)
        tiny_tokenizer().save_pretrained(teacher_dir)
    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(7))
    report = score_teacher(config, ScoringOptions(shard_rows=3))
    assert (report.rows, report.shards_written) == (7, 3)
    manifest = read_manifest(config.output_dir)
    assert manifest.complete and manifest.k == 8 and manifest.rows == 7 and manifest.tokens == report.tokens
    stored = TeacherLogprobs(config.output_dir)
    objective = DistillObjective.from_config(
        "distill", dataclasses.replace(config, teacher_model_name_or_path="x", lmbda=0.0, top_k=0), None
    )
    tokenizer = tiny_tokenizer()
    examples = objective.tokenize(tiny_sft_rows(7), tokenizer)
    model = tiny_model(family, seed=1, **overrides).eval()
    for example in random.Random(0).sample(examples, len(examples)):
        ids = torch.tensor([example.prompt_ids + example.completion_ids])
        with torch.no_grad():
            full = model(ids).logits[0, len(example.prompt_ids) - 1 : -1].log_softmax(-1)
        row = stored.get(row_hash(example.prompt_ids, example.completion_ids))
        torch.testing.assert_close(row["logprobs"], full.topk(8).values, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(full.gather(1, row["ids"].long()), row["logprobs"], rtol=1e-4, atol=1e-5)
        tokens = torch.tensor(example.completion_ids)
        torch.testing.assert_close(
            row["token_logprobs"], full.gather(1, tokens[:, None])[:, 0], rtol=1e-4, atol=1e-5
        )
        assert (row["tail"] < 0).all()
    assert disk_bytes_per_token(32) == 32 * 8 + 8 and disk_bytes_per_token(32, "bfloat16") == 32 * 6 + 8


def stored_rows(directory: str, rows: list[dict]) -> dict[bytes, dict]:
    """The stored scores of ``rows`` (tokenized as ``train distill`` does), by row hash, and the
    examples."""
    stored = TeacherLogprobs(directory)
    objective = DistillObjective.from_config(
        "distill", TrainConfig(teacher_logprobs_path=directory, beta=0.0, max_length=64), None
    )
    examples = objective.tokenize(rows, tiny_tokenizer())
    return {
        row_hash(e.prompt_ids, e.completion_ids): (e, stored.get(row_hash(e.prompt_ids, e.completion_ids)))
        for e in examples
    }


def test_tail_draws_are_the_teachers_and_do_not_depend_on_batching(tmp_path, teacher_dir, capsys):
    """``--tail_samples 8``: each token's 8 stored draws are the inverse CDF of the teacher's own
    distribution outside the stored top-k (its full log-softmax here) at ``tail_uniforms(seed, row hash)``
    (seed: the run's); other batches and shards store the same draws, another ``--tail_samples_seed``
    other ones, and resuming with it is refused naming both seeds. The manifest records both keys; a
    manifest without them (written before they existed) reads as no draws."""
    rows = tiny_sft_rows(7)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(shard_rows=3, tail_samples=8))
    manifest = read_manifest(config.output_dir)
    assert (manifest.tail_samples, manifest.tail_samples_seed) == (8, config.seed)
    model = tiny_model("llama", seed=1).eval()
    scores = stored_rows(config.output_dir, rows)
    for key, (example, row) in scores.items():
        assert row["sample_ids"].dtype == torch.int32 and row["sample_ids"].shape == (
            len(example.completion_ids),
            8,
        )
        ids = torch.tensor([example.prompt_ids + example.completion_ids])
        with torch.no_grad():
            probs = model(ids).logits[0, len(example.prompt_ids) - 1 : -1].double().softmax(-1)
        tail = probs.scatter(1, row["ids"].long(), 0.0)
        cumulative = (tail / tail.sum(-1, keepdim=True)).cumsum(-1)
        draws = row["sample_ids"].long()
        after = cumulative.gather(1, draws)
        before = after - (tail / tail.sum(-1, keepdim=True)).gather(1, draws)
        uniforms = tail_uniforms(config.seed, key, len(example.completion_ids), 8)
        assert ((before - 1e-4 <= uniforms) & (uniforms < after + 1e-4)).all()
    other = dataclasses.replace(config, output_dir=str(tmp_path / "other"), per_device_eval_batch_size=1)
    score_teacher(other, ScoringOptions(shard_rows=2, tail_samples=8))
    for key, (_, row) in stored_rows(other.output_dir, rows).items():
        assert torch.equal(row["sample_ids"], scores[key][1]["sample_ids"])
    seeded = dataclasses.replace(config, output_dir=str(tmp_path / "seeded"))
    score_teacher(seeded, ScoringOptions(shard_rows=3, tail_samples=8, tail_samples_seed=7))
    assert read_manifest(seeded.output_dir).tail_samples_seed == 7
    assert any(
        not torch.equal(row["sample_ids"], scores[key][1]["sample_ids"])
        for key, (_, row) in stored_rows(seeded.output_dir, rows).items()
    )
    args = cli_args(["teacher-logprobs", "--shard_rows", "3", "--tail_samples", "8"], config)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "0 shards written, 3 already there" in out
    assert f"--teacher_logprobs_path {config.output_dir} --beta 0" in out  # the default beta is refused
    err = one_line_error([*args, "--tail_samples_seed", "7"], capsys)
    assert f"(tail_samples_seed {config.seed} there, 7 now)" in err

    data = json.loads((Path(config.output_dir) / MANIFEST).read_text())
    old = {key: value for key, value in data.items() if not key.startswith("tail_samples")}
    (Path(config.output_dir) / MANIFEST).write_text(json.dumps(old))
    assert read_manifest(config.output_dir).tail_samples == 0
    assert "sample_ids" not in next(iter(stored_rows(config.output_dir, rows).values()))[1]
    assert disk_bytes_per_token(32, tail_samples=8) == 32 * 8 + 8 + 8 * 4


@pytest.mark.parametrize("tail_samples", [0, 8])
def test_resume_after_a_kill_scores_only_missing_shards(tmp_path, teacher_dir, monkeypatch, tail_samples):
    """A run killed while writing its second shard leaves the first complete, no partial file and an
    incomplete manifest; the rerun removes what a harder kill leaves (a temporary file), writes the
    others only, and the result equals an unbroken run's (its tail draws too)."""
    import fastalign.data.teacher_logprobs as store

    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(8))
    calls = {"n": 0}
    real_save = __import__("safetensors.torch", fromlist=["save_file"]).save_file

    def dying_save(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(path).write_bytes(b"partial")  # half a file, then the kill
            raise KeyboardInterrupt
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr("safetensors.torch.save_file", dying_save)
    scoring = ScoringOptions(shard_rows=3, tail_samples=tail_samples)
    with pytest.raises(KeyboardInterrupt):
        score_teacher(config, scoring)
    out = Path(config.output_dir)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, shard_name(0)]  # no temporary left
    assert not read_manifest(out).complete
    with pytest.raises(ValueError, match="incomplete"):
        TeacherLogprobs(out)
    first = (out / shard_name(0)).stat().st_mtime_ns
    (out / f".{shard_name(1)}.0123abcd.tmp").write_bytes(b"partial")  # what a SIGKILL leaves
    monkeypatch.setattr("safetensors.torch.save_file", real_save)
    report = score_teacher(config, scoring)
    assert (report.shards_written, report.shards_skipped) == (2, 1)
    assert not list(out.glob(".*.tmp"))
    assert (out / shard_name(0)).stat().st_mtime_ns == first
    unbroken = score_teacher(dataclasses.replace(config, output_dir=str(tmp_path / "unbroken")), scoring)
    assert unbroken.tokens == read_manifest(out).tokens
    for shard in range(3):
        with (
            safe_open(str(out / shard_name(shard)), "pt") as a,
            safe_open(str(tmp_path / "unbroken" / shard_name(shard)), "pt") as b,
        ):
            assert ("sample_ids" in a.keys()) == bool(tail_samples) and a.keys() == b.keys()
            for key in a.keys():
                torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key))
    del store


def test_another_scoring_in_the_same_directory_is_refused(tmp_path, teacher_dir, capsys):
    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(4))
    score_teacher(config)
    args = [
        "teacher-logprobs",
        "--model_name_or_path",
        str(teacher_dir),
        "--dataset_name",
        config.dataset_name,
    ]
    args += ["--top_k", "4", "--output_dir", config.output_dir, "--max_length", "64"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "k 8 there, 4 now" in err
    assert "(tail_samples 0 there, 8 now)" in one_line_error(
        [*args[:5], "--top_k", "8", *args[7:], "--tail_samples", "8"], capsys
    )
    assert main([*args[:5], "--top_k", "8", "--output_dir", str(tmp_path / "cli"), "--max_length", "64"]) == 0
    assert "scored 4 rows" in capsys.readouterr().out


def test_shards_missing_after_scoring_are_a_one_line_error(tmp_path, teacher_dir, monkeypatch, capsys):
    """A shard that is not there when rank 0 finishes (another rank's, in a directory rank 0 does not
    see) is a one-line CLI error saying what to do, not a traceback; the manifest stays incomplete and a
    rerun scores the missing shard."""
    import fastalign.train.teacher_logprobs as scoring

    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(6))
    real = scoring._score_shard

    def elsewhere(model, collate, part, shard, *rest):  # shard 1 written where rank 0 cannot see it
        return 0 if shard == 1 else real(model, collate, part, shard, *rest)

    monkeypatch.setattr(scoring, "_score_shard", elsewhere)
    args = cli_args(["teacher-logprobs", "--shard_rows", "3"], config)
    err = one_line_error(args, capsys)
    assert f"config key 'output_dir': {config.output_dir} lacks shards [1] after scoring" in err
    assert not read_manifest(config.output_dir).complete
    monkeypatch.setattr(scoring, "_score_shard", real)
    assert main(args) == 0 and "1 shards written, 1 already there" in capsys.readouterr().out


def offline_config(tmp_path: Path, scores: str, rows: list[dict], **options) -> TrainConfig:
    defaults = dict(teacher_logprobs_path=scores, beta=0.0, per_device_train_batch_size=2, max_length=64)
    return short_config(tmp_path, rows, **defaults | options)


def test_training_never_loads_the_teacher_and_learns(tmp_path, teacher_dir, monkeypatch):
    """Two steps of top-8 forward KL with the tail on stored scores: the teacher is never loaded (its
    loading raises), the loss is finite and positive; the rows are in another order than scored."""
    rows = tiny_sft_rows(8)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr("fastalign.train.run.load_frozen_model", no_teacher)
    (tmp_path / "t").mkdir()
    train = offline_config(tmp_path / "t", config.output_dir, rows[::-1], max_steps=3)
    run_training(train, "distill")
    metrics = logged(train.output_dir)
    assert [row["step"] for row in metrics] == [1, 2, 3]
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 and row["grad_norm"] > 0 for row in metrics)
    assert all(0 < row["entropy"] < math.log(512) for row in metrics)


@pytest.mark.parametrize(
    ("quantization", "bf16"),
    [(None, False), ("nf4", False), (None, True)],
    ids=["lora", "qlora", "lora-bf16"],
)
def test_a_lora_student_trains_on_stored_scores(quantization, bf16, tmp_path, teacher_dir):
    """A LoRA (and 4-bit QLoRA) student on stored scores: its first loss is the full student's (LoRA's
    B starts at 0), it trains, and the run saves an adapter, not a whole model. With ``bf16`` (autocast
    over fp32 weights, full and LoRA students alike) the sparse head runs in the autocast dtype, as
    ``F.linear`` would there."""
    if quantization:
        require("bitsandbytes")
    rows = tiny_sft_rows(8)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    runs = {}
    for name, options in {
        "full": {},
        "lora": dict(use_peft=True, lora_r=4, lora_dropout=0.0, quantization=quantization),
    }.items():
        (tmp_path / name).mkdir()
        options |= {"bf16": True} if bf16 else {}
        train = offline_config(tmp_path / name, config.output_dir, rows, max_steps=2, **options)
        run_training(train, "distill")
        runs[name] = logged(train.output_dir)
    # QLoRA's base is the full student's weights in 4 bits: its first loss within their rounding (1%)
    tolerance = 1e-2 if quantization else 1e-6
    assert math.isclose(runs["lora"][0]["loss"], runs["full"][0]["loss"], rel_tol=tolerance)
    assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in runs["lora"])
    assert (tmp_path / "lora" / "run" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "lora" / "run" / "model.safetensors").exists()


def test_shards_left_without_their_manifest_are_not_taken_for_a_new_scoring(tmp_path, teacher_dir):
    """A manifest removed (to start over) leaves shards of an unknown scoring: a run into that directory
    is refused, not completed with them."""
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    (Path(config.output_dir) / MANIFEST).unlink()
    with pytest.raises(
        ConfigError, match=r"holds shards \(shard-00000.safetensors, \.\.\.\) but no manifest"
    ):
        score_teacher(dataclasses.replace(config, top_k=4))


def test_a_teacher_head_of_another_size_is_refused_before_training(tmp_path):
    """The same tokenizer does not mean the same head (one may be padded past its ids): a teacher's
    vocabulary other than the student's is recorded and refused at setup, naming both, as online."""
    teacher = tmp_path / "wide-teacher"
    tiny_model("llama", seed=1, vocab_size=640).save_pretrained(teacher)
    tiny_tokenizer().save_pretrained(teacher)
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher, rows)
    score_teacher(config)
    assert read_manifest(Path(config.output_dir)).teacher_vocab == 640
    (tmp_path / "student").mkdir()
    train = offline_config(tmp_path / "student", config.output_dir, rows, max_steps=1)
    with pytest.raises(
        ConfigError, match=r"the teacher's vocabulary \(640 tokens\) is not the student's \(512\)"
    ):
        run_training(train, "distill")


def test_offline_loss_equals_the_op_on_the_teachers_own_scores(tmp_path, teacher_dir):
    """One micro-batch through the objective equals ``linear_sparse_divergence`` fed the teacher's
    top-k computed here (β 0 top-8 with the tail; β 0.5 top-1: TRL's support)."""
    import fastalign

    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    tokenizer = tiny_tokenizer()
    for beta in (0.0, 0.5):
        train = TrainConfig(teacher_logprobs_path=config.output_dir, beta=beta, max_length=64)
        objective = DistillObjective.from_config("distill", train, None)
        examples = objective.tokenize(rows, tokenizer)
        objective.teacher_logprobs = TeacherLogprobs(config.output_dir)
        batch = objective.collate(tokenizer)(examples)
        student = fastalign.patch_model(tiny_model("llama", seed=0))
        count = batch["completion_mask"].sum()
        loss, _ = objective.compute_loss(student, batch, count)
        # the same from scratch: the teacher's top-k here, TRL's support, the op on the student's logits
        teacher = tiny_model("llama", seed=1).eval()
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        mask = batch["completion_mask"].bool()
        with torch.no_grad():
            t_lp = teacher(**inputs).logits[:, width - 1 : -1].log_softmax(-1)
        s_lp = tiny_model("llama", seed=0)(**inputs).logits[:, width - 1 : -1].log_softmax(-1)
        tokens = batch["input_ids"][:, width:]
        if beta == 0:
            top = t_lp.topk(8, -1)
            s, t = s_lp.gather(-1, top.indices), top.values
            s = torch.cat([s, torch.log(-torch.expm1(s.logsumexp(-1, keepdim=True).clamp(max=-1e-7)))], -1)
            t = torch.cat([t, torch.log(-torch.expm1(t.logsumexp(-1, keepdim=True).clamp(max=-1e-7)))], -1)
            div = (t.exp() * (t - s)).sum(-1)
        else:
            from fastalign.ops.sparse_divergence import sparse_divergence_rows

            top1 = t_lp.argmax(-1)
            ids = torch.stack([top1, tokens], -1)
            support = torch.stack([torch.ones_like(mask), tokens != top1], -1)
            div = sparse_divergence_rows(s_lp.gather(-1, ids), t_lp.gather(-1, ids), support, beta, True)
        expected = div[mask].sum() / count
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-4)


def offline_objective(scores: str, **options) -> DistillObjective:
    """The offline objective on ``scores`` as its setup opens them, without a run."""
    train = TrainConfig(teacher_logprobs_path=scores, max_length=64, **options)
    objective = DistillObjective.from_config("distill", train, None)
    objective.teacher_logprobs = TeacherLogprobs(scores)
    objective.tail_samples = tail_samples_in_use(objective.options, objective.teacher_logprobs.manifest)
    return objective


def test_loss_on_tail_draws_is_the_kl_to_the_estimate(tmp_path, teacher_dir):
    """Scored with 8 tail draws, one micro-batch's loss is KL(T̂ ‖ S) summed over the completion tokens
    over their count, T̂ the stored top-8 probabilities and r·c/8 at the stored draws (r the stored tail
    mass, c a draw's count), S the student's whole softmax (float64, dense, here); with
    ``loss_tail_samples`` false it is the tail bucket's loss on the same top-8, as files without draws
    give it."""
    import fastalign

    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(tail_samples=8))
    plain = dataclasses.replace(config, output_dir=str(tmp_path / "plain"))
    score_teacher(plain)
    tokenizer = tiny_tokenizer()
    student = fastalign.patch_model(tiny_model("llama", seed=0))

    def loss_of(objective: DistillObjective) -> tuple[torch.Tensor, dict]:
        batch = objective.collate(tokenizer)(objective.tokenize(rows, tokenizer))
        loss, _ = objective.compute_loss(student, batch, batch["completion_mask"].sum())
        return loss.detach(), batch

    objective = offline_objective(config.output_dir, beta=0.0)
    assert objective.tail_samples == 8
    loss, batch = loss_of(objective)
    mask = batch["completion_mask"].bool()
    width = batch["input_ids"].shape[1] - mask.shape[1]
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        s_lp = tiny_model("llama", seed=0)(**inputs).logits[:, width - 1 : -1].double().log_softmax(-1)
    estimate = torch.zeros_like(s_lp).scatter(
        -1, batch["teacher_ids"], batch["teacher_logprobs"].double().exp()
    )
    share = (batch["teacher_tail"].double().exp() / 8)[..., None].expand(*mask.shape, 8).contiguous()
    estimate.scatter_add_(-1, batch["teacher_sample_ids"], share)
    kl = torch.where(estimate > 0, estimate * (estimate.clamp_min(1e-300).log() - s_lp), 0.0).sum(-1)
    assert float(loss) == pytest.approx(float(kl[mask].sum() / mask.sum()), rel=1e-4)

    bucket, bucket_batch = loss_of(offline_objective(config.output_dir, beta=0.0, loss_tail_samples=False))
    assert "teacher_sample_ids" not in bucket_batch
    assert float(bucket) == pytest.approx(
        float(loss_of(offline_objective(plain.output_dir, beta=0.0))[0]), rel=1e-6
    )
    assert float(bucket) != pytest.approx(float(loss), rel=1e-3)


class NegInfScores:
    """Stored scores (k 8) of a teacher with 5 finite logits, ids 0-4 (its last 3 top-8 log-probs −inf,
    at ids 5-7), that gives the completion's token at position 1 of every row no mass."""

    def __init__(self, examples: list):
        self.lengths = {row_hash(e.prompt_ids, e.completion_ids): len(e.completion_ids) for e in examples}

    def get(self, key: bytes) -> dict:
        n = self.lengths[key]
        finite = torch.log_softmax(torch.linspace(0.0, -3.0, 5), -1)
        logprobs = torch.cat([finite, torch.full((3,), float("-inf"))]).expand(n, 8).contiguous()
        token_logprobs = torch.full((n,), -2.0)
        token_logprobs[1] = float("-inf")
        ids = torch.arange(8, dtype=torch.int32).expand(n, 8).contiguous()
        return {"ids": ids, "logprobs": logprobs, "token_logprobs": token_logprobs}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_neginf_stored_logprobs(beta):
    """Stored log-probs of −inf (a teacher with fewer than k finite logits): with β 0 the loss is
    TRL's (the −inf top-k entries off the support: tests/kernels) and finite, with finite gradients;
    with β > 0 a completion token of −inf teacher log-prob is refused naming the row, as TRL's server
    path refuses it (its reverse KL is infinite)."""
    import fastalign

    tokenizer = tiny_tokenizer()
    train = TrainConfig(
        teacher_logprobs_path="unused", beta=beta, max_length=64, loss_top_k=8 if beta == 0 else 1
    )
    objective = DistillObjective.from_config("distill", train, None)
    examples = objective.tokenize(tiny_sft_rows(3), tokenizer)
    objective.teacher_logprobs = NegInfScores(examples)
    collate = objective.collate(tokenizer)
    if beta > 0:
        with pytest.raises(ValueError, match=r"completion token 1 \(id \d+\) is -inf: with beta") as error:
            collate(examples)
        assert str(error.value).startswith(examples[0].where)
        return
    batch = collate(examples)
    student = fastalign.patch_model(tiny_model("llama", seed=0))
    loss, metrics = objective.compute_loss(student, batch, batch["completion_mask"].sum())
    loss.backward()
    assert math.isfinite(float(loss)) and float(loss) > 0 and math.isfinite(float(metrics["entropy"]))
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(grad).all() for grad in grads)


def test_tail_draws_refusals_are_one_line_errors(tmp_path, teacher_dir, capsys):
    """With draws: β > 0, a ``loss_top_k`` other than the stored k and ``loss_add_tail`` false are
    refused in one line saying how to turn the draws off (which then trains); ``loss_tail_samples`` true
    on files without draws is refused, left unset it trains; it applies only with teacher_logprobs_path.
    Two steps on the draws train."""
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(tail_samples=4))
    plain = dataclasses.replace(config, output_dir=str(tmp_path / "plain"))
    score_teacher(plain)

    def config_for(scores: str, **options) -> TrainConfig:
        directory = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        directory.mkdir()
        return offline_config(directory, scores, rows, **options)

    def error(scores: str = config.output_dir, **options) -> str:
        return one_line_error(cli_args(["train", "distill"], config_for(scores, **options)), capsys)

    off = "set loss_tail_samples false for TRL's tail bucket alone"
    where = f"the 4 tail draws per token of {config.output_dir}'s manifest"
    assert f"'beta' (0.5) must be 0 with {where} (they estimate forward KL only): {off}" in error(beta=0.5)
    assert f"'loss_top_k' (4) must be the stored k (8) with {where}" in error(loss_top_k=4)
    assert f"'loss_add_tail' must be true with {where}" in error(loss_add_tail=False)
    assert f"'loss_tail_samples' is true but {plain.output_dir}'s manifest records no tail draws" in error(
        plain.output_dir, loss_tail_samples=True
    )
    with pytest.raises(
        ConfigError, match="'loss_tail_samples' applies to distill with teacher_logprobs_path"
    ):
        DistillObjective.from_config(
            "distill", TrainConfig(teacher_model_name_or_path="t", loss_tail_samples=False), None
        )
    run_training(config_for(config.output_dir, beta=0.5, loss_tail_samples=False, max_steps=1), "distill")
    run_training(config_for(plain.output_dir, max_steps=1), "distill")
    drawn = config_for(config.output_dir, max_steps=2)
    run_training(drawn, "distill")
    metrics = logged(drawn.output_dir)
    assert [row["step"] for row in metrics] == [1, 2]
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 and row["grad_norm"] > 0 for row in metrics)


def cli_args(command: list[str], config: TrainConfig) -> list[str]:
    """``command`` with ``config``'s keys that differ from the defaults as command-line options."""
    args = list(command)
    for key, value in dataclasses.asdict(config).items():
        if value != getattr(TrainConfig(), key) and value is not None:
            args += [f"--{key}", json.dumps(value) if not isinstance(value, str) else value]
    return args


def one_line_error(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_manifest_mismatches_are_one_line_errors(tmp_path, teacher_dir, capsys):
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    scores = config.output_dir

    def error(**options) -> str:
        directory = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        directory.mkdir()
        train = offline_config(directory, scores, rows, **options)
        return one_line_error(cli_args(["train", "distill"], train), capsys)

    assert f"'teacher_model_name_or_path' ('other') is not the teacher of {scores}" in error(
        teacher_model_name_or_path="other"
    )
    assert "'loss_top_k' (9) is over the k of" in error(loss_top_k=9) and "(8)" in error(loss_top_k=9)
    assert "'temperature' (2.0) is not the one" in error(temperature=2.0)
    assert "'lmbda'" in error(lmbda=0.5)
    top_k = error(top_k=4)  # nothing is sampled: the sampling keys are refused, the support's key named
    assert "config key 'top_k' (4): with teacher_logprobs_path nothing is sampled (lmbda 0)" in top_k
    assert "fastalign teacher-logprobs --top_k; loss_top_k trains on fewer" in top_k
    sampling = error(top_p=0.9, min_p=0.1, generation_kwargs={"num_beams": 1}, max_completion_length=64)
    assert (
        "config keys 'top_p' (0.9), 'min_p' (0.1), 'generation_kwargs' ({'num_beams': 1}), "
        "'max_completion_length' (64): with teacher_logprobs_path nothing is sampled" in sampling
    )
    assert "--top_k" not in sampling
    assert "must be 1 with beta>0 (got loss_top_k=8)" in error(beta=0.5, loss_top_k=8)
    assert "no teacher log-probs in" in error(max_length=12, truncation=True)  # other tokens
    assert "tokenizer (hash" in error(chat_template_path=str(_template(tmp_path)))
    with pytest.raises(ConfigError, match="teacher_logprobs_path only"):
        DistillObjective.from_config(
            "distill", TrainConfig(teacher_model_name_or_path="t", loss_top_k=4), None
        )


def _template(tmp_path: Path) -> Path:
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("tail_samples", [0, 8])
def test_two_ranks_score_alternate_shards_like_one(tmp_path, teacher_dir, tail_samples):
    """Under torchrun (2 processes, gloo) each rank scores every other shard; the files equal one
    process's (the tail draws too)."""
    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(10))
    one = score_teacher(config, ScoringOptions(shard_rows=2, tail_samples=tail_samples))
    two_dir = tmp_path / "two"
    torchrun.run_two_processes(
        WORKER, json.dumps({**dataclasses.asdict(config), "output_dir": str(two_dir)}), 2, tail_samples
    )
    assert read_manifest(two_dir).complete and read_manifest(two_dir).tokens == one.tokens
    for shard in range(5):
        with (
            safe_open(str(Path(config.output_dir) / shard_name(shard)), "pt") as a,
            safe_open(str(two_dir / shard_name(shard)), "pt") as b,
        ):
            assert ("sample_ids" in a.keys()) == bool(tail_samples) and a.keys() == b.keys()
            for key in a.keys():
                torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key))
    written = [json.loads((two_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert written == [3, 2]  # rank 0 shards 0, 2, 4; rank 1 shards 1, 3


class TensorShapes(TorchDispatchMode):
    """Every aten op's output shape while active, and those of the matmuls that read ``weight`` (a
    view of it: a slice, its transpose): the logits blocks."""

    MATMULS = ("aten.mm", "aten.addmm", "aten.matmul", "aten.linear", "aten.bmm", "aten.baddbmm")

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.storage = weight.untyped_storage().data_ptr()
        self.shapes: set[tuple[int, ...]] = set()
        self.blocks: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [
            t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)
        ]
        self.shapes.update(tuple(t.shape) for t in outputs)
        if str(func).startswith(self.MATMULS) and any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage for t in args
        ):
            self.blocks.extend(tuple(t.shape) for t in outputs)
        return out


def test_scoring_pass_holds_no_full_logits(monkeypatch):
    """The scoring pass (``_score_batch``: the teacher's forward, its head fused, with tail draws) with
    vocabulary slices of 64 ids and a budget of 4 rows builds its logits a [4, 64] block at a time: every
    matmul that reads the head's weight makes at most 4 × 64 logits, together each of the 19 × 512
    logits once per walk (the top-k's, the draws'), and no tensor of the pass has a dimension of the
    vocabulary's size (a plain ``hidden @ weight.T`` head makes a [19, 512] one); the stored top-k equal
    the full log-softmax's."""
    import fastalign

    slice_width, rows, k, m = 64, 4, 4, 3
    op = partial(linear_topk_logprobs, vocab_slice=slice_width, workspace_bytes=rows * slice_width * 8)
    monkeypatch.setattr("fastalign.train.teacher_logprobs.linear_topk_logprobs", op)
    tokenizer = tiny_tokenizer()
    train = TrainConfig(teacher_logprobs_path="unused", beta=0.0, max_length=64)
    objective = DistillObjective.from_config("distill", train, None)
    batch = CompletionCollator(tokenizer.pad_token_id)(objective.tokenize(tiny_sft_rows(3), tokenizer))
    mask = batch["completion_mask"].bool()
    tokens = int(mask.sum())
    teacher = fastalign.patch_model(tiny_model("llama", seed=1)).eval()
    weight = teacher.get_output_embeddings().weight
    vocab = weight.shape[0]
    uniforms = torch.rand(tokens, m, generator=torch.Generator().manual_seed(0))
    config = with_objective_defaults("distill", TrainConfig(top_k=k, max_length=64))  # as score_teacher's
    cpu = DistributedContext(0, 1, 0, torch.device("cpu"))
    with TensorShapes(weight) as seen:
        scores = _score_batch(teacher, batch, config, cpu, uniforms)
    assert seen.blocks and all(math.prod(shape) <= rows * slice_width for shape in seen.blocks), seen.blocks
    assert sum(math.prod(shape) for shape in seen.blocks) == 2 * tokens * vocab
    assert tokens > rows and not [shape for shape in seen.shapes if vocab in shape]
    width = batch["input_ids"].shape[1] - mask.shape[1]
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        full = tiny_model("llama", seed=1)(**inputs).logits[:, width - 1 : -1][mask].log_softmax(-1)
    stored = torch.cat([row[1] for row in scores])
    torch.testing.assert_close(stored, full.topk(k).values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_files_get_the_mode_open_gives_them(tmp_path, teacher_dir, umask, mode):
    """Shards and manifests (the evaluation rows' too) are 0o666 less the umask, as a plain ``open``
    makes them, not a temporary file's 0600 (nor safetensors' own): a trainer under another uid can read
    them."""
    held_out = write_rows(tmp_path / "held_out.jsonl", tiny_sft_rows(6)[4:])
    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(4), eval_dataset_name=str(held_out))
    previous = os.umask(umask)
    try:
        score_teacher(config, ScoringOptions(shard_rows=2))
    finally:
        os.umask(previous)
    files = [path for path in Path(config.output_dir).rglob("*") if path.is_file()]
    assert len(files) == 5  # a manifest and 2 shards, a manifest and 1 shard in eval/
    modes = {
        str(path.relative_to(config.output_dir)): oct(stat.S_IMODE(path.stat().st_mode)) for path in files
    }
    assert modes == {name: oct(mode) for name in modes}


def test_a_file_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """``atomic_write`` flushes the file, renames it, then flushes the directory: after a power loss a
    shard's name never points at a file whose bytes were not written (a rerun skips the names it finds)."""
    from fastalign.data import teacher_logprobs as store

    events, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", Path(b).name)) or replace(a, b))
    store.atomic_write(tmp_path / "shard.bin", lambda tmp: Path(tmp).write_bytes(b"scores"))
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].endswith(".tmp") and events[2][1] == tmp_path.name
    assert (tmp_path / "shard.bin").read_bytes() == b"scores"


def test_eval_dataset_is_scored_into_eval_and_evaluated_on(tmp_path, teacher_dir, capsys):
    """``teacher-logprobs --eval_dataset_name`` scores the held-out rows into DIR/eval (a directory whose
    training rows are scored already scores only those), and ``train distill`` evaluates on them; before
    that, or with rows DIR/eval lacks, the error says what to run, in one line."""
    rows, held_out = tiny_sft_rows(10)[:6], tiny_sft_rows(10)[6:]
    held_out_file = write_rows(tmp_path / "held_out.jsonl", held_out)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(shard_rows=3))
    scores = Path(config.output_dir)
    (tmp_path / "t").mkdir()
    train = offline_config(
        tmp_path / "t", str(scores), rows, eval_dataset_name=str(held_out_file), eval_strategy="steps"
    )
    err = one_line_error(cli_args(["train", "distill"], train), capsys)
    assert (
        f"'eval_dataset_name' ({str(held_out_file)!r})" in err
        and f"{scores / EVAL_DIR / MANIFEST} is missing" in err
    )
    assert (
        f"teacher-logprobs with this run's keys, eval_dataset_name included, and --output_dir {scores}" in err
    )

    first = (scores / shard_name(0)).stat().st_mtime_ns
    scoring = cli_args(
        ["teacher-logprobs", "--shard_rows", "3"],
        dataclasses.replace(config, eval_dataset_name=str(held_out_file)),
    )
    assert main(scoring) == 0
    out = capsys.readouterr().out
    assert f"scored 6 rows into {scores} and 4 eval rows into {scores / EVAL_DIR}" in out
    assert "2 shards written, 2 already there" in out  # the training rows' shards kept
    assert "--beta 0" not in out  # no draws stored: distill's default beta is fine
    assert (scores / shard_name(0)).stat().st_mtime_ns == first
    manifest = read_manifest(scores / EVAL_DIR)
    assert manifest.complete and manifest.rows == 4 and manifest.shards == 2
    assert manifest.teacher_weights == read_manifest(scores).teacher_weights

    run_training(train, "distill")
    capsys.readouterr()  # its progress bar
    evaluations = [row["eval_loss"] for row in logged(train.output_dir) if "eval_loss" in row]
    assert evaluations and all(math.isfinite(loss) and loss > 0 for loss in evaluations)

    (tmp_path / "u").mkdir()  # a held-out row DIR/eval lacks
    other = write_rows(tmp_path / "other.jsonl", tiny_sft_rows(12)[6:])
    unscored = dataclasses.replace(
        train, eval_dataset_name=str(other), output_dir=str(tmp_path / "u" / "run")
    )
    err = one_line_error(cli_args(["train", "distill"], unscored), capsys)
    assert (
        f"no teacher log-probs in {scores / EVAL_DIR} for this row of eval_dataset_name {str(other)!r}" in err
    )
    assert "remove it, then score them" in err

    data = json.loads((scores / EVAL_DIR / MANIFEST).read_text())  # scored by another teacher than DIR
    for name, other in (
        ("v", {"teacher_weights": "files:1:0123"}),
        ("w", {"teacher_dtype": "bfloat16"}),
        ("x", {"teacher_quantization": "nf4+double_quant"}),
    ):
        (scores / EVAL_DIR / MANIFEST).write_text(json.dumps(data | other))
        (tmp_path / name).mkdir()
        run = dataclasses.replace(train, output_dir=str(tmp_path / name / "run"))
        err = one_line_error(cli_args(["train", "distill"], run), capsys)
        key, value = next(iter(other.items()))
        assert f"{scores / EVAL_DIR} was not scored as {scores} was ({key} {value!r}" in err


def test_a_teacher_retrained_in_place_is_refused_on_resume(tmp_path, teacher_dir, capsys):
    """The manifest fingerprints a local teacher's weight files (names, sizes, mtimes) and records
    whether it was patched: a rerun after the weights changed, or with use_liger_kernel off, is refused in
    one line naming both values; the same teacher resumes (nothing left to score)."""
    teacher = Path(shutil.copytree(teacher_dir, tmp_path / "teacher"))
    config = scoring_config(tmp_path, teacher, tiny_sft_rows(4))
    score_teacher(config)
    manifest = read_manifest(config.output_dir)
    assert manifest.teacher_weights.startswith("files:1:") and manifest.teacher_patched is True
    args = cli_args(["teacher-logprobs"], config)
    assert main(args) == 0 and "0 shards written, 1 already there" in capsys.readouterr().out

    err = one_line_error([*args, "--use_liger_kernel", "false"], capsys)
    assert "(teacher_patched True there, False now)" in err

    weights = teacher / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # retrained in place: the same size, a new mtime
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    err = one_line_error(args, capsys)
    now = teacher_weights(config, teacher)
    assert now != manifest.teacher_weights
    assert f"(teacher_weights {manifest.teacher_weights!r} there, {now!r} now): use another directory" in err


def test_the_teachers_dtype_and_attention_are_recorded_and_resumed_alike(tmp_path, teacher_dir, capsys):
    """The manifest records the teacher's weights' dtype and attention kernel: a rerun in another dtype
    or with another kernel (``dtype``, ``model_init_kwargs``) is refused in one line naming both values,
    a bf16 teacher's scores are stored (its scores, not the fp32 teacher's); a manifest written before
    they were recorded still opens for training."""
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    manifest = read_manifest(config.output_dir)
    assert (manifest.teacher_dtype, manifest.teacher_attn_implementation) == ("float32", "sdpa")
    args = cli_args(["teacher-logprobs"], config)
    err = one_line_error([*args, "--dtype", "bfloat16"], capsys)
    assert "(teacher_dtype 'float32' there, 'bfloat16' now): use another directory" in err
    eager = ["--model_init_kwargs", json.dumps({"attn_implementation": "eager"})]
    assert "(teacher_attn_implementation 'sdpa' there, 'eager' now)" in one_line_error(
        [*args, *eager], capsys
    )

    low = dataclasses.replace(config, output_dir=str(tmp_path / "bf16"), dtype="bfloat16")
    score_teacher(low)
    assert read_manifest(low.output_dir).teacher_dtype == "bfloat16"
    full, half = stored_rows(config.output_dir, rows), stored_rows(low.output_dir, rows)
    assert all(
        torch.allclose(half[key][1]["logprobs"], row["logprobs"], atol=0.1) for key, (_, row) in full.items()
    )
    assert any(not torch.equal(half[key][1]["logprobs"], row["logprobs"]) for key, (_, row) in full.items())

    data = json.loads((Path(config.output_dir) / MANIFEST).read_text())
    old = {
        key: value
        for key, value in data.items()
        if key not in ("teacher_dtype", "teacher_attn_implementation")
    }
    (Path(config.output_dir) / MANIFEST).write_text(json.dumps(old))
    options = DistillOptions.from_config(TrainConfig(teacher_logprobs_path=config.output_dir, beta=0.0))
    stored = open_teacher_logprobs(options, tiny_tokenizer(), 8)
    assert stored.manifest.teacher_dtype is None and len(stored) == len(full)


def test_teacher_logprobs_refuses_the_training_keys(tmp_path, teacher_dir, capsys):
    """Scoring reads ``SCORING_KEYS`` only: every training key set (on the command line, in the YAML
    file or in code) is named in one line, never ignored, ``loss_top_k`` included; ``quantization``
    needs no ``use_peft`` there, nor fp16 over float16 weights a gradient scaler."""
    config = scoring_config(tmp_path, teacher_dir, tiny_sft_rows(4))
    args = cli_args(["teacher-logprobs"], config)
    training = ["--use_peft", "true", "--learning_rate", "5", "--packing", "true", "--beta", "0.7"]
    err = one_line_error(
        [*args, "--quantization", "nf4", "--bf16", "true", *training, "--max_steps", "3"], capsys
    )
    named = ", ".join(f"'{key}' (on the command line)" for key in ("packing", "max_steps", "learning_rate"))
    assert (
        f"config keys {named}, 'use_peft' (on the command line), 'beta' (on the command line) are training "
        "keys: this command trains nothing and does not read them; remove them (it reads "
        "attn_implementation, bf16,"
    ) in err
    assert "'quantization'" not in err and "'bf16' (" not in err
    err = one_line_error([*args, "--loss_top_k", "4"], capsys)
    assert (
        "config key 'loss_top_k' (on the command line) is a training key: this command trains nothing" in err
    )
    yaml_file = tmp_path / "train.yaml"
    yaml_file.write_text("learning_rate: 1.0e-5\ntop_k: 8\n")
    err = one_line_error([*args, "--config", str(yaml_file)], capsys)
    assert f"config key 'learning_rate' (in {yaml_file}) is a training key" in err
    assert not Path(config.output_dir).exists()  # refused before anything is loaded or written
    with pytest.raises(ConfigError, match="'eval_split_ratio' is a training key"):
        score_teacher(dataclasses.replace(config, eval_split_ratio=0.1))
    for flags, training_error in (
        (["--quantization", "nf4"], "needs use_peft"),
        (["--dtype", "float16", "--fp16", "true"], "cannot train in full with fp16"),
    ):
        load_config(None, flags, reads=SCORING_KEYS)
        with pytest.raises(ConfigError, match=training_error):
            load_config(None, flags)


def test_autocast_and_quantization_are_honoured_and_recorded(tmp_path, teacher_dir, capsys):
    """``bf16`` runs the teacher's forward under bf16 autocast (its head's logits accumulated in fp32, as
    ``F.linear`` would run them under autocast), ``quantization`` loads it in 4 bits as training loads
    its teacher: the stored scores are those, the manifest records both, and resuming without them is
    refused in one line naming both values."""
    rows = tiny_sft_rows(4)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config)
    full = stored_rows(config.output_dir, rows)

    low = dataclasses.replace(config, output_dir=str(tmp_path / "bf16"), bf16=True)
    score_teacher(low)
    manifest = read_manifest(low.output_dir)
    assert (manifest.teacher_autocast, manifest.teacher_dtype, manifest.teacher_quantization) == (
        "bfloat16",
        "float32",
        None,
    )
    half = stored_rows(low.output_dir, rows)
    assert all(
        torch.allclose(half[key][1]["logprobs"], row["logprobs"], atol=0.1) for key, (_, row) in full.items()
    )
    assert any(not torch.equal(half[key][1]["logprobs"], row["logprobs"]) for key, (_, row) in full.items())
    err = one_line_error(cli_args(["teacher-logprobs"], dataclasses.replace(low, bf16=False)), capsys)
    assert "(teacher_autocast 'bfloat16' there, None now): use another directory" in err

    g = torch.Generator().manual_seed(0)  # the head under autocast: the op on bf16 inputs, fp32 logits
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(40, 8, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = linear_topk_logprobs(hidden, weight, 4)
    outside = linear_topk_logprobs(hidden.bfloat16(), weight.bfloat16(), 4)
    assert inside.logprobs.dtype == torch.float32 and torch.equal(inside.logprobs, outside.logprobs)

    quantized = dataclasses.replace(config, output_dir=str(tmp_path / "nf4"))
    assert main([*cli_args(["teacher-logprobs"], quantized), "--quantization", "nf4"]) == 0
    assert read_manifest(quantized.output_dir).teacher_quantization == "nf4+double_quant"
    model, _ = load_model_and_tokenizer(teacher_dir, QuantOptions("nf4"))
    model.eval()
    for example, row in stored_rows(quantized.output_dir, rows).values():
        ids = torch.tensor([example.prompt_ids + example.completion_ids])
        with torch.no_grad():
            logprobs = model(ids).logits[0, len(example.prompt_ids) - 1 : -1].log_softmax(-1)
        torch.testing.assert_close(row["logprobs"], logprobs.topk(8).values, rtol=1e-4, atol=1e-4)
    err = one_line_error([*cli_args(["teacher-logprobs"], quantized), "--quantization", "fp4"], capsys)
    assert "(teacher_quantization 'nf4+double_quant' there, 'fp4+double_quant' now)" in err


def test_teacher_weights_of_hub_and_builtin_models():
    """A Hub id is identified by the commit its revision resolved to (its snapshot directory), a
    built-in model by its name."""
    snapshot = Path("/cache/models--org--name/snapshots/0123abcd")
    assert teacher_weights(TrainConfig(model_name_or_path="org/name"), snapshot) == "revision 0123abcd"
    assert (
        teacher_weights(TrainConfig(model_name_or_path="tiny-llama"), "tiny-llama") == "built-in tiny-llama"
    )


@pytest.mark.slow
def test_two_processes_train_on_stored_scores_as_one(tmp_path, teacher_dir):
    """Offline distillation under torchrun (2 gloo processes, FSDP2, half the batch each) logs the losses
    one process logs on the whole batch: each rank finds its own rows' scores, tail draws included, by
    their hash (`fastalign plan --method distill-offline` suggests more GPUs when a student does not fit)."""
    rows = tiny_sft_rows(8)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(shard_rows=3, tail_samples=4))
    runs = {}
    for label, batch in (("one", 4), ("two", 2)):
        (tmp_path / label).mkdir()
        runs[label] = offline_config(
            tmp_path / label, config.output_dir, rows, per_device_train_batch_size=batch, max_steps=2
        )
    run_training(dataclasses.replace(runs["one"], save_strategy="no"), "distill")
    worker = Path(__file__).with_name("train_worker.py")
    torchrun.run_two_processes(
        worker, json.dumps([["distill", dataclasses.asdict(runs["two"])]]), timeout=900
    )
    one, two = logged(runs["one"].output_dir), logged(runs["two"].output_dir)
    assert [row["step"] for row in one] == [row["step"] for row in two] == [1, 2]
    for one_row, two_row in zip(one, two, strict=True):
        assert math.isfinite(one_row["loss"]) and one_row["loss"] > 0
        assert two_row["loss"] == pytest.approx(one_row["loss"], rel=1e-4, abs=1e-6)
    assert (Path(runs["two"].output_dir) / "model.safetensors").is_file()


def test_a_corrupt_shard_is_a_one_line_error_and_a_rerun_scores_it_again(tmp_path, teacher_dir):
    """Before: safetensors' SafetensorError traceback from the first lookup of the store."""
    rows = tiny_sft_rows(6)
    config = scoring_config(tmp_path, teacher_dir, rows)
    score_teacher(config, ScoringOptions(shard_rows=3))
    shard = Path(config.output_dir) / shard_name(1)
    shard.write_bytes(b"not a safetensors file")
    with pytest.raises(
        ValueError, match=f"'teacher_logprobs_path': {shard} cannot be read .*remove it and rerun"
    ):
        TeacherLogprobs(config.output_dir)
    shard.unlink()
    score_teacher(config, ScoringOptions(shard_rows=3))
    assert len(TeacherLogprobs(config.output_dir)) == 6
