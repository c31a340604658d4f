"""CI-sized CPU benchmarks of the kernels with pytest-benchmark: fastalign's PyTorch backend vs eager.

    .venv/bin/pytest benchmarks/ --benchmark-only -q

Not collected by a plain ``pytest`` (``testpaths`` is ``tests``). Each case times one forward+backward as
the benchmark suites build it (``steps`` of each suite), on shapes that take milliseconds on a 2-core CPU;
the suites themselves (``fastalign bench``) measure realistic sizes, the floors and memory.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels import (
    bandwidth_suite,
    bench_grpo,
    bench_linear_cross_entropy,
    bench_preference,
    bench_rms_norm,
    bench_rope,
    bench_swiglu,
    loss_head_suite,
)

DEVICE = torch.device("cpu")
PROVIDERS = ("fastalign-torch", "torch-eager")


@pytest.mark.benchmark(group="linear_cross_entropy N=1024 D=256 V=16384")
@pytest.mark.parametrize("provider", PROVIDERS)
def test_linear_cross_entropy(benchmark, provider):
    _, forward_backward = bench_linear_cross_entropy.steps(provider, 1024, 256, 16384, "float32", DEVICE)
    benchmark(forward_backward)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "bench, size",
    [(bench_rms_norm.BENCH, (2048, 1024)), (bench_rope.BENCH, (1, 512)), (bench_swiglu.BENCH, (1024, 2816))],
    ids=["rms_norm", "rope", "swiglu"],
)
def test_bandwidth_kernel(benchmark, bench, size, provider):
    benchmark.group = f"{bench.kernel} {bench.describe(size)}"
    _, forward_backward = bandwidth_suite.steps(bench, provider, size, torch.float32, DEVICE)
    benchmark(forward_backward)


@pytest.mark.parametrize("provider", ["fastalign", "torch-eager"])
@pytest.mark.parametrize(
    "module, shape", [(bench_grpo, (4, 128, 128, 8192)), (bench_preference, (2, 128, 128, 8192))],
    ids=["grpo", "preference"],
)  # fmt: skip
def test_loss_head(benchmark, module, shape, provider):
    bench = module.BENCH
    benchmark.group = f"{bench.kernel} {bench.describe(shape)}"
    torch.manual_seed(0)
    inputs = bench.make_inputs(shape, torch.float32, DEVICE)
    _, forward_backward = loss_head_suite.steps(bench.providers(DEVICE)[provider], inputs)
    benchmark(forward_backward)
