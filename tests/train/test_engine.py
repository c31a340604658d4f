"""The engine and SFT end to end on a tiny model: learning, exact accumulation, resume, atomic saves."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastalign
import fastalign.train.checkpoint as checkpoint_module
from fastalign.builtin import tiny_model, tiny_sft_rows, tiny_tokenizer
from fastalign.data import tokenize_sft_dataset
from fastalign.train.batches import FILLER_KEY, EvaluationBatches, MicroBatches
from fastalign.train.callbacks import EarlyStopping
from fastalign.train.checkpoint import list_checkpoints
from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback, Engine, NonFiniteLossError, Schedule
from fastalign.train.objectives import SFTObjective
from fastalign.train.sft import run_sft
from tests.torchrun import run_two_processes

SINGLE = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def write_rows(path, count=64, seed=0):
    path.write_text("\n".join(json.dumps(row) for row in tiny_sft_rows(count, seed)) + "\n")
    return path


def config(tmp_path, **overrides) -> TrainConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    defaults = dict(
        dataset_name=str(write_rows(tmp_path / "train.jsonl")),
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        seed=0,
        max_length=64,
        warmup_ratio=0.0,
        loss_curve_png=False,
    )
    return TrainConfig(**{**defaults, **overrides})


def sft_in_two_processes(*configs: TrainConfig) -> None:
    """``run_sft(cfg)`` for each of ``configs`` under torchrun × 2 (gloo, FSDP2), one after the other in
    the same two processes."""
    payload = json.dumps([["sft", asdict(cfg)] for cfg in configs])
    run_two_processes(Path(__file__).with_name("train_worker.py"), payload)


def logged(output_dir) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_losses(output_dir) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in logged(output_dir) if "loss" in record}


@pytest.mark.slow
def test_loss_falls_and_the_model_is_saved(tmp_path):
    cfg = config(
        tmp_path,
        dataset_name="tiny-sft",
        max_steps=40,
        per_device_train_batch_size=8,
        logging_steps=10,
        loss_curve_png=True,
        eval_split_ratio=0.05,
        eval_strategy="steps",
        eval_steps=20,
    )
    out = run_sft(cfg)
    records = logged(out)
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(
        {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second"} <= set(r)
        for r in records
        if "loss" in r
    )
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert (out / "fastalign_config.yaml").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.model_type == "llama" and (out / "model.safetensors").is_file()
    assert reloaded.config.use_cache  # off while training, on in the model a user loads


def _engine(examples, batch_size, accumulation, steps, seed=0):
    model = fastalign.patch_model(tiny_model("llama"))  # the objectives' losses run in the fused head
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would blur gradient differences
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = MicroBatches(
        examples, batch_size=batch_size, accumulation=accumulation, pad_token_id=0, seed=seed
    )
    return Engine(
        model,
        SFTObjective(),
        optimizer,
        scheduler,
        batches,
        Schedule(max_steps=steps, logging_steps=1),
        SINGLE,
        output_dir="unused",
    )


def test_gradient_accumulation_equals_one_big_batch():
    """4 micro-batches of 1 uneven-length example = 1 batch of 4: the loss is the token mean of the
    whole accumulated batch, not a mean of per-micro-batch means."""
    examples = tokenize_sft_dataset(
        [*tiny_sft_rows(32), {"prompt": "x", "completion": " y" * 30}], tiny_tokenizer()
    )
    big, small = _engine(examples, 4, 1, 3), _engine(examples, 1, 4, 3)
    for _ in range(3):
        a, b = big.train_step(), small.train_step()
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
    for (name, p), q in zip(big.model.named_parameters(), small.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _Crash(Callback):
    """Simulates a kill after ``at`` steps (an exception out of the loop, no cleanup)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, engine, metrics):
        if engine.state.step == self.at:
            raise KeyboardInterrupt("killed")


def test_kill_and_resume_gives_the_same_losses(tmp_path):
    reference = run_sft(config(tmp_path / "a", max_steps=6, save_steps=2, lr_scheduler_type="cosine"))
    cfg = config(tmp_path / "b", max_steps=6, save_steps=2, lr_scheduler_type="cosine")
    with pytest.raises(KeyboardInterrupt):
        run_sft(cfg, callbacks=[_Crash(at=5)])
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["checkpoint-2", "checkpoint-4"]
    cfg.resume_from_checkpoint = "latest"
    resumed = run_sft(cfg)
    expected, got = train_losses(reference), train_losses(resumed)
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, expected, got)


def test_a_resume_between_log_lines_logs_the_same_means(tmp_path):
    """save_steps 3, logging_steps 2: the checkpoint falls inside a log window (step 3 of the window 3-4);
    the resumed run's log line at step 4 averages steps 3 and 4, as the uninterrupted run's does."""
    options = dict(max_steps=6, save_steps=3, logging_steps=2, lr_scheduler_type="cosine")
    reference = run_sft(config(tmp_path / "a", **options))
    cfg = config(tmp_path / "b", **options)
    with pytest.raises(KeyboardInterrupt):
        run_sft(cfg, callbacks=[_Crash(at=4)])
    cfg.resume_from_checkpoint = "latest"
    resumed = run_sft(cfg)
    expected, got = train_losses(reference), train_losses(resumed)
    for step in (4, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, expected, got)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = config(tmp_path, max_steps=4, save_steps=2)
    real_save = checkpoint_module.dcp.save
    calls = []

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        run_sft(cfg)
    root = tmp_path / "run"
    assert [p.name for p in list_checkpoints(root)] == ["checkpoint-2"]
    assert (root / ".tmp-checkpoint-4").exists()  # the half-written one, never picked
    monkeypatch.setattr(checkpoint_module.dcp, "save", real_save)
    cfg.resume_from_checkpoint = "latest"
    run_sft(cfg)
    assert [p.name for p in list_checkpoints(root)] == ["checkpoint-2", "checkpoint-4"]
    assert not (root / ".tmp-checkpoint-4").exists()
    assert max(train_losses(root)) == 4


def test_save_total_limit_keeps_the_last_checkpoints(tmp_path):
    out = run_sft(config(tmp_path, max_steps=4, save_steps=1, save_total_limit=2))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]


def test_non_finite_loss_stops_with_a_clear_error(tmp_path):
    class NanObjective(SFTObjective):
        def compute_loss(self, model, batch, num_items_in_batch):
            loss, metrics = super().compute_loss(model, batch, num_items_in_batch)
            return loss * float("nan"), metrics

    engine = _engine(tokenize_sft_dataset(tiny_sft_rows(16), tiny_tokenizer()), 4, 1, 2)
    engine.objective = NanObjective()
    before = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(NonFiniteLossError, match=r"step 1: loss nan.*no checkpoint"):
        engine.train()
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters(), strict=True))


def test_lora_adapter_is_saved_in_peft_format(tmp_path):
    import peft

    out = run_sft(config(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, max_steps=2))
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), out)
    assert any("lora_A" in name for name, _ in loaded.named_parameters())


def test_early_stopping_callback_ends_the_run(tmp_path):
    stopper = EarlyStopping(patience=1, min_delta=100.0)  # no evaluation can improve by 100
    cfg = config(tmp_path, max_steps=50, eval_split_ratio=0.25, eval_strategy="steps", eval_steps=1)
    out = run_sft(cfg, callbacks=[stopper])
    assert max(train_losses(out)) == 2  # first evaluation sets the best, the second stops


def test_a_data_set_too_small_for_one_step_is_a_clear_error(tmp_path):
    cfg = config(tmp_path, dataset_name=str(write_rows(tmp_path / "few.jsonl", count=3)))
    with pytest.raises(ValueError, match=r"3 examples, fewer than one step needs.*= 4"):
        run_sft(cfg)


def test_checkpointing_and_offloading_leave_the_losses_unchanged(tmp_path):
    plain = train_losses(run_sft(config(tmp_path / "plain", max_steps=3)))
    saver = run_sft(
        config(tmp_path / "saver", max_steps=3, gradient_checkpointing=True, activation_offloading=True)
    )
    for step, loss in plain.items():
        assert train_losses(saver)[step] == pytest.approx(loss, rel=1e-5)


def test_bf16_single_process_trains(tmp_path):
    losses = train_losses(run_sft(config(tmp_path, max_steps=3, bf16=True)))
    assert all(math.isfinite(loss) for loss in losses.values()) and len(losses) == 3


#: The 2-process runs of the tests below (label → options of ``config``, with
#: ``model_name_or_path`` from_checkpoint: the local checkpoint of ``two_process_runs``).
TWO_PROCESS_RUNS = {
    "builtin": dict(max_steps=3, per_device_train_batch_size=2, save_steps=3),
    "full": dict(from_checkpoint=True, max_steps=3, save_strategy="no", per_device_train_batch_size=2),
    "lora": dict(
        from_checkpoint=True, max_steps=3, save_strategy="no", per_device_train_batch_size=2,
        use_peft=True, lora_r=4, lora_dropout=0.0,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict:
    """The runs of ``TWO_PROCESS_RUNS`` under torchrun × 2, in one launch (starting the two processes
    costs more than the runs): ``{"checkpoint": the local checkpoint, label: the run's config}``."""
    root = tmp_path_factory.mktemp("two_process")
    checkpoint = root / "checkpoint"
    tiny_model("llama").save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    runs = {}
    for label, options in TWO_PROCESS_RUNS.items():
        options = dict(options)
        if options.pop("from_checkpoint", False):
            options["model_name_or_path"] = str(checkpoint)
        runs[label] = config(root / label, **options)
    sft_in_two_processes(*runs.values())
    return {"checkpoint": checkpoint, **runs}


@pytest.mark.slow
def test_two_process_fsdp2_run_matches_one_process(tmp_path, two_process_runs):
    """torchrun × 2 (gloo, FSDP2), 2 examples per rank = 1 process with 4: the same losses."""
    single = train_losses(run_sft(config(tmp_path / "one", max_steps=3, per_device_train_batch_size=4)))
    cfg = two_process_runs["builtin"]
    two = train_losses(Path(cfg.output_dir))
    for step, loss in single.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), (single, two)
    assert [p.name for p in list_checkpoints(cfg.output_dir)] == ["checkpoint-3"]
    assert AutoModelForCausalLM.from_pretrained(cfg.output_dir).config.model_type == "llama"


@pytest.mark.slow
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_runs_from_a_checkpoint_are_sharded_before_their_weights_exist(tmp_path, use_peft, two_process_runs):
    """A local checkpoint becomes a meta skeleton that is wrapped and sharded before its weights are
    read (each rank keeps only its shard): 2 processes give the losses of 1, and the first loss is the
    one the same weights give as a built-in model."""
    checkpoint = two_process_runs["checkpoint"]
    lora = dict(use_peft=True, lora_r=4, lora_dropout=0.0) if use_peft else {}
    options = dict(max_steps=3, save_strategy="no", **lora)
    builtin = train_losses(run_sft(config(tmp_path / "builtin", **options)))
    single = train_losses(run_sft(config(tmp_path / "one", model_name_or_path=str(checkpoint), **options)))
    assert single[1] == pytest.approx(builtin[1], rel=1e-6)
    cfg = two_process_runs["lora" if use_peft else "full"]
    assert cfg.model_name_or_path == str(checkpoint) and cfg.use_peft == use_peft
    two = train_losses(Path(cfg.output_dir))
    for step, loss in single.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), (single, two)


def test_a_checkpoint_restores_the_python_and_numpy_generators(tmp_path):
    """Beside torch's: a reward function or data hook drawing from ``random``/``numpy`` resumes exactly."""
    import random

    import numpy as np

    from fastalign.train.checkpoint import load_checkpoint, save_checkpoint

    model = tiny_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, SINGLE, None)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(path, model, optimizer, SINGLE)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_rows_that_do_not_fill_a_step_are_said(caplog):
    """12 examples in steps of 8: each epoch trains 8, and one log line says so (transformers would
    train the other 4 as a smaller last step; docs/trl.md lists the difference)."""
    examples = tokenize_sft_dataset(tiny_sft_rows(12), tiny_tokenizer())
    with caplog.at_level("WARNING", logger="fastalign.train.batches"):
        batches = MicroBatches(examples, batch_size=4, accumulation=2, pad_token_id=0, seed=0)
        MicroBatches(examples, batch_size=4, accumulation=3, pad_token_id=0, seed=0)  # 12: fills steps
    assert batches.steps_per_epoch == 1
    said = [r.message for r in caplog.records if "left out" in r.message]
    assert said == [
        "fastalign: each epoch trains 8 of the 12 examples: the 4 that do not fill a step of 8 are left out "
        "(others each epoch, the order being reshuffled); a batch size that divides the data trains them all"
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_evaluation_batches_deal_every_example_once_and_collate_only_their_ranks(world_size):
    """7 examples in micro-batches of 2 (4 batches): every rank gets as many (short ranks a marked
    filler), the ranks' own batches hold every example once, and a rank collates only its own batches,
    when they are read (nothing held between evaluations)."""
    examples = list(range(7))
    collated = []

    def collate(rows):
        collated.append(list(rows))
        return {"rows": list(rows)}

    ranks = [
        EvaluationBatches(examples, 2, 0, rank, world_size, collate=collate) for rank in range(world_size)
    ]
    assert not collated and len({len(batches) for batches in ranks}) == 1
    assert len(ranks[0]) == -(-4 // world_size)
    seen = []
    for batches in ranks:
        collated.clear()
        read = list(batches)
        assert [batch["rows"] for batch in read] == collated  # each read once, only this rank's
        own = [batch for batch in read if FILLER_KEY not in batch]
        assert all(batch == {"rows": [0, 1], FILLER_KEY: True} for batch in read[len(own) :])
        seen += [row for batch in own for row in batch["rows"]]
        assert batches[-1] == read[-1]
    assert sorted(seen) == examples
    with pytest.raises(IndexError):
        ranks[0][len(ranks[0])]
    assert len(EvaluationBatches([], 2, 0, 0, world_size)) == 0


def test_the_seed_seeds_numpy_as_transformers_set_seed():
    """A reward function drawing from numpy's global generator draws the same in every run of a seed."""
    import numpy as np
    from transformers import set_seed

    from fastalign.train.run import _seed_everything

    _seed_everything(7)
    ours = np.random.rand(3), torch.rand(3)
    set_seed(7)
    theirs = np.random.rand(3), torch.rand(3)
    assert np.array_equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
