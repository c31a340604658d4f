"""fastalign.train.distributed: single-process no-ops, and a real 2-process FSDP2 run (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastalign.builtin import tiny_model
from fastalign.train.distributed import (
    DistributedContext,
    all_reduce_sum,
    broadcast_object,
    init_distributed,
    shard_model,
    shutdown_distributed,
)
from tests.torchrun import run_two_processes
from tests.train.fsdp_worker import LR, STEPS, TEXTS, batch_of, build_model

WORKER = Path(__file__).with_name("fsdp_worker.py")
_TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in _TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_context_properties():
    main = DistributedContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    other = DistributedContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    assert main.is_main and main.enabled
    assert not other.is_main


def test_single_process_is_a_no_op(no_torchrun):
    ctx = init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
    assert ctx.is_main and not ctx.enabled
    assert ctx.device == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    assert not dist.is_initialized()

    model = tiny_model("llama")
    assert shard_model(model, mixed_precision=True) is model
    assert all(type(param) is torch.nn.Parameter for param in model.parameters())

    assert all_reduce_sum(7, ctx).item() == 7
    assert all_reduce_sum(2.5, ctx).item() == 2.5
    value = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(all_reduce_sum(value, ctx), value.to(ctx.device))
    assert broadcast_object({"a": 1}, ctx) == {"a": 1}
    shutdown_distributed()  # nothing was created: nothing to destroy


def _reference(tie_word_embeddings: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps in one process on the whole batch: the loss is the mean over all label tokens."""
    model = build_model(tie_word_embeddings)
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch = batch_of(TEXTS)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    updates = {name: param.detach() - initial[name] for name, param in model.named_parameters()}
    return losses, updates


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> dict[bool, dict]:
    """tie_word_embeddings → what rank 0 of the 2-process run wrote; both runs in one torchrun launch
    (starting the two processes costs more than the runs)."""
    root = tmp_path_factory.mktemp("fsdp")
    outs = {tie: root / f"tied-{tie}.json" for tie in (False, True)}
    run_two_processes(WORKER, *[arg for tie, out in outs.items() for arg in (out, tie)], timeout=300)
    return {tie: json.loads(out.read_text()) for tie, out in outs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_two_process_fsdp_matches_single_process(two_process_results, tie_word_embeddings):
    result = two_process_results[tie_word_embeddings]

    # the halves hold different numbers of label tokens: per-rank means would not give the global mean
    first, second = result["local_tokens"]
    assert first != second
    assert result["tied"] is tie_word_embeddings
    assert result["broadcast"] == {"from": 0}

    losses, updates = _reference(tie_word_embeddings)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
    assert result["updates"].keys() == updates.keys()
    for name, update in updates.items():
        torch.testing.assert_close(
            torch.tensor(result["updates"][name]),
            update,
            rtol=1e-4,
            atol=1e-7,
            msg=lambda text, name=name: f"{name}: {text}",
        )


def test_an_error_on_one_rank_ends_the_job_with_it(tmp_path):
    """Before: the failing rank waited in the final barrier while the other waited in the step's
    collective, both until gloo's 30-minute timeout, and the error was never printed."""
    from tests.torchrun import run_two_processes_failing

    ranks = run_two_processes_failing(
        Path(__file__).with_name("one_rank_fails_worker.py"), tmp_path / "run", timeout=240
    )
    assert "rank 1 alone failed at step 1" in ranks


def test_the_command_line_under_torchrun_says_each_thing_once(tmp_path):
    """Before: every rank printed each step's line, the final "saved to" and a config error, and a finished
    rank sometimes aborted in the interpreter's teardown, failing the job (1 run in 45)."""
    from tests.torchrun import run_two_processes, run_two_processes_failing

    worker = Path(__file__).with_name("cli_worker.py")
    flags = ["train", "sft", "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_length", "32"]
    flags += ["--logging_steps", "1", "--loss_curve_png", "false", "--save_strategy", "no"]
    ranks = run_two_processes_failing(
        worker, *flags, "--output_dir", tmp_path / "fp16", "--fp16", "true", timeout=240
    )
    assert ranks.count("error: config key 'fp16'") == 1, ranks
    ranks = run_two_processes(worker, *flags, "--output_dir", tmp_path / "run", timeout=240)
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert ranks.count("saved to") == 1 and ranks.count("step 2: loss") == 1, ranks
