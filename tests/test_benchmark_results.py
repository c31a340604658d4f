"""benchmarks/RESULTS.md is generated from benchmarks/results/*.json and must match them."""

from __future__ import annotations

import copy

from benchmarks import report


def test_results_md_matches_the_json_files():
    assert report.RESULTS_MD.read_text() == report.render(report.load_runs()), (
        "benchmarks/RESULTS.md is out of date: run python benchmarks/report.py"
    )


def _run(device: str, date: str, fwd_bwd_ms: float) -> dict:
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
        "kernel": "k",
        "preset": "cpu",
        "floor": "f",
        "matmul_tflops": 1.0,
        "skipped": {"liger-kernel": "needs CUDA"},
        "env": {
            "device": device,
            "device_type": "cpu",
            "date": date,
            "torch": "t",
            "triton": "x",
            "transformers": "y",
            "git_commit": "c",
        },
        "rows": [
            row | {"provider": "torch-eager"},
            copy.deepcopy(row) | {"provider": "fastalign-torch", "fwd_bwd_ms": 2.0},
        ],
    }


def test_render_keeps_the_latest_run_per_device_and_compares_with_eager():
    text = report.render([_run("cpu A", "2026-01-01", 9.0), _run("cpu A", "2026-02-01", 4.0)])
    assert "2026-02-01" in text and "2026-01-01" not in text
    assert "| N=8 D=4 V=16 | float32 | fastalign-torch | 1.0 | 2.0 |" in text and "| 2.00× | 1.00× |" in text
    assert "Not measured on GPU yet" in text and "liger-kernel (needs CUDA)" in text
