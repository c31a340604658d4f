"""benchmarks/RESULTS.md is generated from benchmarks/results/*.json and must match them."""

from __future__ import annotations

import copy

from benchmarks import goals, noise, report


def test_results_md_matches_the_json_files():
    text = report.render(report.load_runs())
    assert report.RESULTS_MD.read_text() == text, (
        "benchmarks/RESULTS.md is out of date: run python benchmarks/report.py"
    )
    assert not report.missing_plots(text, report.RESULTS_MD), "plots missing: run python benchmarks/report.py"


def _run(device: str, date: str, fwd_bwd_ms: float, device_type: str = "cpu", kernel: str = "k") -> dict:
    row = {
        "N": 8,
        "D": 4,
        "V": 16,
        "dtype": "float32",
        "fwd_ms": 1.0,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_bwd_spread": 0.01,
        "floor_ms": 1.0,
        "fwd_bwd_over_floor": fwd_bwd_ms,
        "peak_extra_mib": 2.0,
    }
    return {
        "suite": "kernels",
        "kernel": kernel,
        "preset": "cpu",
        "floor": "f",
        "matmul_tflops": 1.0,
        "skipped": {"liger-kernel": "needs CUDA"},
        "env": {
            "device": device,
            "device_type": device_type,
            "date": date,
            "torch": "t",
            "triton": "x",
            "transformers": "y",
            "git_commit": "c",
        },
        "rows": [
            row | {"provider": "torch-eager"},
            copy.deepcopy(row) | {"provider": "fastalign-torch", "fwd_bwd_ms": 2.0},
            copy.deepcopy(row) | {"provider": "torch-compile", "fwd_bwd_ms": 4.01, "fwd_bwd_spread": 0.1},
        ],
    }


def test_render_keeps_the_latest_run_per_device_and_compares_with_eager():
    text = report.render([_run("cpu A", "2026-01-01", 9.0), _run("cpu A", "2026-02-01", 4.0)])
    assert "2026-02-01" in text and "2026-01-01" not in text
    assert (
        "| N=8 D=4 V=16 | float32 | fastalign-torch | 1.00 | 1.00 | 2.00 |" in text
        and "| 2.00× | 1.00× |" in text
    )
    assert "Not measured on GPU" in text and "liger-kernel (needs CUDA)" in text
    # torch-compile is within noise of eager (4.01 ± 0.2 vs 4.0 ± 0.02): no speed-up is claimed
    assert "| torch-compile |" in text and "| ≈ | 1.00× |" in text
    assert "| N=8 D=4 V=16 | fastalign-torch | 2.00× · 1.00× | 2.00× · 1.00× |" in text
    assert "![k on cpu A](plots/k-cpu-a-cpu.png)" in text


def test_end_to_end_rows_render_their_own_figures():
    run = _run("cpu A", "2026-02-01", 4.0, kernel="e2e_alignment_step")
    step = {
        "shape": "llama",
        "objective": "dpo",
        "step_ms": 100.0,
        "step_spread": 0.02,
        "tokens_per_s": 5e3,
        "peak_memory_gib": 0.5,
    }
    run["rows"] = [
        step | {"provider": "fastalign"},
        step | {"provider": "fastalign-unpatched", "step_ms": 150.0},
    ]
    text = report.render([run])
    assert "| shape | objective | provider | step ms | spread | tokens/s | peak GiB |" in text
    assert "| llama | dpo | fastalign | 100.0 | 2% | 5,000 | 0.50 | 1.50× | 1.00× |" in text


def test_the_summary_judges_gpu_runs_against_each_goal():
    run = _run("GPU A", "2026-02-01", 4.0, device_type="cuda", kernel="linear_cross_entropy")
    for row, provider, over in zip(
        run["rows"], ("fastalign-triton", "liger-kernel", "torch-eager"), (1.3, 1.1, 1.5), strict=True
    ):
        row |= {"provider": provider, "fwd_bwd_over_floor": over}
    summary = report.render_summary([run])
    assert "| linear_cross_entropy | fwd+bwd ≤ 1.15× the matmul floor | GPU A | missed |" in summary
    assert "- linear_cross_entropy on GPU A: N=8 D=4 V=16: 1.30× floor" in summary
    assert "| rms_norm |" in summary and "not measured on GPU" in summary
    assert goals.assess(goals.GOALS[0], run).verdict == "missed"


def test_noise_control():
    assert noise.within_noise((100.0, 0.1), (104.0, 0.0))  # 4 ms apart, ±5 ms
    assert not noise.within_noise((100.0, 0.02), (110.0, 0.02))
    noisy = _run("cpu A", "2026-02-01", 4.0)
    noisy["rows"][0]["fwd_bwd_spread"] = 0.6
    noisy["rows"][1]["fwd_bwd_over_floor"] = 0.5  # faster than the floor: the ceiling was measured low
    assert noise.noisy_rows(noisy) == [
        "torch-eager N=8 D=4 V=16: spread 60%",
        "fastalign-torch N=8 D=4 V=16: 0.50× its floor, below it",
    ]
