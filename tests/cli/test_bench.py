"""``fastalign bench``: a tiny benchmark end to end, the noise gate, selection errors."""

from __future__ import annotations

import json

from benchmarks import runner, suites
from fastalign.cli.main import main


def test_bench_runs_a_quick_kernel_and_writes_its_json(tmp_path, capsys):
    status = main(
        [
            "bench",
            "kernels",
            "--quick",
            "--only",
            "rms_norm",
            "--providers",
            "fastalign-torch",
            "torch-eager",
            "fastalign-triton",
            "--out",
            str(tmp_path),
            "--allow-noisy",
            "--no-report",
            "--threads",
            "1",
        ]
    )
    assert status == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("rms_norm-*.json")
    result = json.loads(path.read_text())
    assert result["kernel"] == "rms_norm" and result["preset"] == "quick" and result["suite"] == "kernels"
    assert [row["provider"] for row in result["rows"]] == ["fastalign-torch", "torch-eager"]
    assert all(row["fwd_bwd_ms"] > 0 and row["floor_ms"] > 0 for row in result["rows"])
    assert result["skipped"] == {"fastalign-triton": "needs CUDA"}  # a missing provider is reported
    assert {"device", "torch", "triton", "transformers", "git_commit", "date"} <= set(result["env"])
    assert result["spread"] == "(p75 − p25) / median" and result["copy_bandwidth_gbps"] > 0
    assert result["env"]["threads"] == 1


def _staged(tmp_path, spread: float):
    row = {"provider": "torch-eager", "shape": "s", "fwd_bwd_ms": 1.0, "fwd_bwd_spread": spread}
    path = tmp_path / "staging" / "k-cpu-1.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"kernel": "k", "rows": [row]}))
    return path


def test_a_noisy_result_is_refused_unless_allowed(tmp_path, capsys):
    out = tmp_path / "results"
    assert runner._gate(_staged(tmp_path, 0.5), runner.Options(), out)[0] == "refused"
    assert not out.exists() and "--allow-noisy" in capsys.readouterr().err
    assert runner._gate(_staged(tmp_path, 0.5), runner.Options(allow_noisy=True), out)[0] == "recorded"
    assert json.loads((out / "k-cpu-1.json").read_text())["noisy"] == ["torch-eager s: spread 50%"]
    assert runner._gate(_staged(tmp_path, 0.1), runner.Options(), out)[0] == "recorded"


def test_selection(capsys):
    assert [suite.name for suite in suites.select("e2e")] == [
        "e2e_patch_model",
        "e2e_alignment_step",
        "e2e_ppo_step",
        "e2e_sft",
        "e2e_real_trl",
        "e2e_generation",
    ]
    assert main(["bench", "kernels", "--only", "e2e_sft"]) == 2
    assert "no kernels benchmark named e2e_sft" in capsys.readouterr().err
    assert main(["bench", "--list"]) == 0 and "linear_cross_entropy" in capsys.readouterr().out
