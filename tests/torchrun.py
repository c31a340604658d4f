"""A worker script under ``torchrun`` in 2 processes (gloo on the CPU), from a test: the one launcher of
the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: A test itself run under torchrun must not hand its rank and rendezvous to the workers.
_TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def finish_worker() -> None:
    """A worker's end once its checks have passed and its results are written: a barrier (no rank closes
    its gloo sockets while the other still reads), the process group destroyed, and an exit without the
    interpreter's teardown, where gloo's and FSDP2's threads sometimes abort a finished rank ("terminate
    called without an active exception", SIGABRT: up to 1 run in 3 of a worker on 2 CPU cores, under
    torch 2.11 and 2.13), failing a test whose every check passed."""
    import torch.distributed as dist

    if dist.is_initialized():  # (``shutdown_distributed`` may have closed it already)
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_processes(worker: str | Path, *args: object, timeout: int = 600) -> str:
    """``worker args...`` in 2 processes (on the CPU unless there are 2 GPUs) with the repository
    importable and one thread each (2 processes on CI's 2 cores); fails the test with the end of their
    output unless both exit 0. Returns what each rank wrote."""
    completed, ranks = _launch(worker, args, timeout)
    # the ranks' output last: a log cut in the middle keeps its end
    assert completed.returncode == 0, completed.stderr[-800:] + "\n" + ranks
    return ranks


def run_two_processes_failing(worker: str | Path, *args: object, timeout: int = 600) -> str:
    """``run_two_processes`` of a worker that must fail: the job must end (within ``timeout``, not hang)
    with a non-zero exit; returns what each rank wrote."""
    completed, ranks = _launch(worker, args, timeout)
    assert completed.returncode != 0, ranks
    return ranks


def _launch(worker: str | Path, args: tuple, timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if _cuda_devices() < 2:  # rank 1 would ask for cuda:1: the ranks run on the CPU (gloo) instead
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as logs:
        # each rank's output in its own file, so a failure shows what each rank said beside the
        # launcher's traceback
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        command += ["--log-dir", logs, "--redirects", "3"]
        completed = subprocess.run(
            [*command, str(worker), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
        )
        ranks = "".join(
            f"--- rank {log.parent.name}, {log.stem}:\n{log.read_text(errors='replace')[-2500:]}\n"
            for log in sorted(Path(logs).glob("**/attempt_*/*/std*.log"))
        )
    return completed, ranks
