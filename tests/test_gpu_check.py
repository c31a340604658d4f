"""``fastalign bench gpu``: every phase runs on tiny shapes on CPU (``--smoke``), so the command cannot rot
between the sessions that have a GPU; its log parser, the planner's longest sequence and the report's
goal verdicts are checked on fixed inputs."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu import check
from benchmarks.gpu import report as gpu_report


def test_the_test_log_parser_reads_xdist_and_plain_lines_also_of_a_run_cut_short():
    log = "\n".join(
        [
            "[gw0] [ 10%] PASSED tests/kernels/test_a.py::test_one[bf16]",
            "[gw1] [ 20%] FAILED tests/kernels/test_a.py::test_two",
            "tests/losses/test_b.py::test_three SKIPPED (needs trl)",
            "tests/losses/test_b.py::test_four PASSED",
            "[gw1] [ 30%] ERROR tests/patching/test_c.py::test_five",
        ]
    )  # no summary line: the phase's cap stopped the run
    parsed = check.parse_test_log(log)
    assert parsed["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "error": 1}
    assert parsed["failed"] == ["tests/kernels/test_a.py::test_two", "tests/patching/test_c.py::test_five"]


def test_longest_tokens_is_the_last_multiple_of_256_that_fits():
    from fastalign.plan import plan_memory

    flags = {"checkpointing": True, "lora_r": 16, "lora_dropout": 0.05}
    longest = check.longest_tokens("llama-3-8b", "qlora", 24, **flags)
    assert longest % 256 == 0 and longest > 0

    def total(tokens: int) -> int:
        return plan_memory("llama-3-8b", method="qlora", seq_len=tokens, suggest=False, **flags).total_per_gpu

    assert total(longest) <= 24 * 2**30 < total(longest + 256)


def test_the_default_run_leaves_the_long_context_goals_to_calls_of_their_own():
    default = [phase.name for phase in check.selected_phases(None)]
    assert default == ["tests", "lora_8b", "qlora_70b", "loss_heads", "generation_1b", "trl_1b"]
    assert sum(phase.cap_s for phase in check.selected_phases(None)) <= 8 * 60
    assert [phase.name for phase in check.selected_phases(["long_8b", "tests"])] == ["tests", "long_8b"]
    assert all(phase.cap_s <= 570 for phase in check.PHASES)  # a call may run 600 s, with the set-up


def test_a_phase_stopped_at_its_cap_says_what_it_was_doing():
    assert check._stopped("loading\n{'step': 1}\n\n") == (
        "stopped at the phase's time cap; its last output: {'step': 1}"
    )
    assert check._stopped("") == "stopped at the phase's time cap"


def _run(phases: dict, date: str = "2026-11-26T23:39:39Z") -> dict:
    env = {"device": "NVIDIA H100 80GB HBM3", "date": date, "torch": "2.11", "triton": "3.6",
           "transformers": "5.17", "git_commit": "abc1234", "device_type": "cuda"}  # fmt: skip
    return {"kernel": check.KERNEL, "preset": "gpu", "env": env, "matmul_tflops": 780.0, "phases": phases}


def _qlora_row(tokens: int, offloading: bool, step_s: float, peak: float, host: float) -> dict:
    return {"shape": "llama-3-70b", "provider": "fastalign", "tokens": tokens, "checkpointing": True,
            "offloading": offloading, "step_s": step_s, "tokens_per_s": tokens / step_s, "peak_gib": peak,
            "planned_gib": peak * 1.02, "host_peak_gib": host, "first_loss": 13.0}  # fmt: skip


def test_the_report_judges_the_goals_from_the_latest_run_of_each_phase():
    failed = _run({"qlora_70b": {"error": "ImportError: bitsandbytes", "seconds": 1}})
    rows = [_qlora_row(8192, False, 8.3, 54.9, 1.6), _qlora_row(8192, True, 8.5, 46.1, 11.6),
            _qlora_row(12106, True, 12.5, 49.0, 26.5)]  # fmt: skip
    rerun = _run({"qlora_70b": {"rows": rows, "seconds": 100}}, date="2026-11-26T23:45:00Z")
    lora = _run({"lora_8b": {"rows": [], "seconds": 1}})
    text = "".join(gpu_report.sections([failed, rerun, lora]))
    assert "within 48 GB: **missed** — 12,106 tokens (offloaded) peak 49.0 GiB" in text
    assert "- 70B / 8,192 tokens host memory ≤ 12 GiB: **met** — 11.6 GiB" in text
    assert "- offloaded step ≤ 1.15× the step without: **met** — 1.02×" in text
    assert "- 70B QLoRA > 89,389 tokens on 80 GB: not measured on GPU" in text
    assert "ImportError" not in text  # the rerun's rows replace the failed phase
    assert "- 8B LoRA > 342,733 tokens on 80 GB: not measured on GPU (not run: `--phases long_8b`)" in text

    long_row = _qlora_row(90112, True, 240.0, 77.5, 104.0)
    long_run = _run({"long_70b": {"rows": [long_row], "seconds": 300}}, date="2026-11-27T00:00:00Z")
    text = "".join(gpu_report.sections([failed, rerun, lora, long_run]))
    assert (
        "- 70B QLoRA > 89,389 tokens on 80 GB: **met** — 90,112 tokens, peak 77.5 GiB (planner 79.0)" in text
    )
    assert "### long_70b" in text and "| 90,112 | True |" in text
    assert "- rollout generation ≥ 3× `generate`'s tokens/s on the 1B shape: not measured on GPU" in text

    rows = [{"provider": "generate", "tokens_per_s": 1000.0},
            {"provider": "fastalign", "tokens_per_s": 3500.0, "decode": "graphs"},
            {"provider": "fastalign-eager", "tokens_per_s": 1400.0}]  # fmt: skip
    generation = {"kernel": "e2e_generation", "preset": "gpu", "env": long_run["env"], "rows": rows}
    text = "".join(gpu_report.sections([failed, rerun, lora, long_run, generation]))
    assert (
        "- rollout generation ≥ 3× `generate`'s tokens/s on the 1B shape: **met** — 3.50× (3,500 vs 1,000 "
        "tokens/s, decode graphs; without graphs 1.40×)" in text
    )


@pytest.mark.slow
@pytest.mark.parametrize("phase", [phase.name for phase in check.PHASES])
def test_every_phase_runs_on_tiny_shapes(phase, tmp_path):
    path = check.run(tmp_path, smoke=True, names=[phase])
    outcome = json.loads(path.read_text())["phases"][phase]
    assert "error" not in outcome, outcome
    if phase == "tests":
        assert outcome["exit"] == 0 and outcome["counts"].get("passed", 0) > 0 and not outcome["failed"]
    elif phase in ("lora_8b", "qlora_70b", "long_70b", "long_8b"):
        rows = [row for row in outcome["rows"] if "error" not in row]
        assert rows and all(row["tokens_per_s"] > 0 and row["first_loss"] > 0 for row in rows), outcome
        # where a provider's process spends its time before its first step (the phases' caps are sized by it)
        parts = ("start_s", "build_s", "adapt_s")
        assert all(all(row[key] >= 0 for key in parts) and row["load_s"] >= row["build_s"] for row in rows)
        if phase == "lora_8b":  # one seed, one batch: every provider starts from the same loss
            first = {row["first_loss"] for row in rows if row["tokens"] == 64}
            assert max(first) - min(first) < 1e-3, first
    else:
        assert outcome["files"], outcome
        for name in outcome["files"]:
            assert json.loads((tmp_path / name).read_text())["rows"], name


def test_fastalign_bench_gpu_passes_its_options_to_the_check(monkeypatch, tmp_path):
    """docs/benchmarks.md's ``fastalign bench gpu --phases trl_1b --cap 300``: before, --cap was the check
    script's own option only, and the documented command failed on it."""
    from fastalign.cli.main import main

    seen = []
    monkeypatch.setattr(check, "main", lambda argv: seen.append(argv) or 0)
    assert main(["bench", "gpu", "--phases", "trl_1b", "--cap", "300", "--out", str(tmp_path)]) == 0
    assert seen == [["--out", str(tmp_path), "--phases", "trl_1b", "--cap", "300.0"]]
