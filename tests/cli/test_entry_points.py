"""Every command on a CPU machine: it runs with only its required arguments, a problem is one line (no
usage text, no traceback), and a reader that closes the pipe early (``| head``) ends it quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fastalign.cli import demo
from fastalign.cli.main import BROKEN_PIPE_STATUS, INTERRUPTED_STATUS, main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return one_error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ((), "fastalign: the following arguments are required: command"),
        (("nope",), "fastalign: argument command: invalid choice: 'nope'"),
        (("train",), "fastalign train: the objective comes first"),
        (("train", "--config", "c.yaml", "--max_steps", "1"), "fastalign train: '1' is not an objective"),
        (("train", "-h", "dpoo"), "fastalign train: 'dpoo' is not an objective; did you mean 'dpo'?"),
        (("merge",), "fastalign merge: the following arguments are required: run_dir"),
        (("demo", "--tokens", "0"), "fastalign demo: argument --tokens: must be a positive integer"),
        (("bench", "nope"), "fastalign bench: argument suite: invalid choice: 'nope'"),
    ],
)
def test_a_usage_error_is_one_line(capsys, argv, says):
    assert says in usage_error(capsys, *argv)


def test_an_input_error_is_one_line(tmp_path, capsys):
    assert main(["plan"]) == 2
    assert one_error_line(capsys).startswith("error: --model: required")
    assert main(["merge", str(tmp_path / "nope")]) == 2
    assert one_error_line(capsys) == f"error: run directory {tmp_path / 'nope'} not found"
    assert main(["train", "sft", "--max_steps", "0"]) == 2
    assert "'max_steps'" in one_error_line(capsys)


def test_demo_with_no_arguments_runs_on_the_cpu(monkeypatch, capsys):
    """Before: ``torch.device("auto")`` raised on a machine without CUDA. The built-in CPU sizes take
    about two minutes on a 2-core CPU, so this runs the no-argument path on smaller ones."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert demo.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setitem(demo.DEFAULT_SIZES, "cpu", (64, 16, 300, "float32"))
    assert main(["demo"]) == 0
    assert "float32, on CPU" in capsys.readouterr().out


def test_demo_on_cuda_without_cuda_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    assert one_error_line(capsys) == (
        "error: --device cuda: no CUDA device is available here (--device cpu, or leave it out)"
    )


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("fastalign.cli.plan.run", interrupted)
    assert main(["plan"]) == INTERRUPTED_STATUS
    assert one_error_line(capsys) == "error: interrupted"


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (("plan", "--model", "llama-3-8b", "--json"), BROKEN_PIPE_STATUS),  # print()
        (("plan", "--model", "llama-3-8b"), BROKEN_PIPE_STATUS),  # a rich table
        (("bench", "--list"), BROKEN_PIPE_STATUS),
        # argparse's own write of its help ignores the closed pipe (0), the flush at exit does not (141):
        # which one meets it depends on the help's length and the pipe's buffering; both end quietly
        (("train", "--help"), (0, BROKEN_PIPE_STATUS)),
    ],
)
def test_a_closed_pipe_ends_quietly(argv, status):
    """``fastalign plan --json | head``: before, a BrokenPipeError traceback. The reading end is closed
    before the command (seconds of imports) writes anything."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fastalign", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    err = process.stderr.read().decode()
    expected = status if isinstance(status, tuple) else (status,)
    assert process.wait(timeout=120) in expected and err == "", err
