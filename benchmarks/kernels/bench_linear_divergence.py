"""Distillation loss head: fastalign's linear_divergence vs TRL's generalized JSD on full logits (eager
and torch.compile) and Liger-Kernel's LigerFusedLinearJSDLoss.

    python benchmarks/kernels/bench_linear_divergence.py --preset gpu   # N=8192, Ds=2048, Dt=4096, V=128256
    python benchmarks/kernels/bench_linear_divergence.py --preset cpu   # a small pair of heads, fp32

One step: the generalized JSD (beta=0.5, temperature 1, no hard-label term) between a student's and a
wider teacher's next-token distributions over N tokens (every 7th ignored), from their hidden states and
LM heads; the teacher without gradient; backward to the student's hidden states and head. The eager
provider builds both [N, V] logits and applies ``GKDTrainer.generalized_jsd_loss`` (TRL 1.16) to them,
as GKD does. Liger-Kernel runs on CUDA only (its beta weighs the mixture the other way round; at 0.5
the two agree). Floor: the student's 6·N·V·Ds FLOPs (logits, two gradient matmuls) plus the teacher's
2·N·V·Dt at the measured matmul ceiling.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.loss_head_suite import LossHeadBenchmark, run
from fastalign.ops import linear_divergence

PRESETS = {
    "gpu": {"dtype": "bfloat16", "shapes": [(8192, 2048, 4096, 128256)], "repeats": 0},
    "cpu": {"dtype": "float32", "shapes": [(1024, 256, 384, 32000)], "repeats": 5},
    "quick": {"dtype": "float32", "shapes": [(128, 64, 96, 2048)], "repeats": 5, "ceiling_repeats": 1},
}
BETA = 0.5
IGNORE = -100


def providers(device: torch.device) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "importing from trl.experimental"
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

    def fastalign(hidden, weight, teacher_hidden, teacher_weight, labels):
        return linear_divergence(hidden, weight, teacher_hidden, teacher_weight, labels, beta=BETA)

    def trl_eager(hidden, weight, teacher_hidden, teacher_weight, labels):
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden, teacher_weight)
        student_logits = F.linear(hidden, weight)
        return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta=BETA)

    table = {"fastalign": fastalign, "torch-eager": trl_eager, "torch-compile": torch.compile(trl_eager)}
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA)
        # Older releases take no biases.
        biases = {"student_bias": None, "teacher_bias": None}
        biases = {k: v for k, v in biases.items() if k in inspect.signature(liger.forward).parameters}

        def liger_kernel(hidden, weight, teacher_hidden, teacher_weight, labels):
            return liger(hidden, weight, teacher_hidden, teacher_weight, labels, **biases)

        table["liger-kernel"] = liger_kernel
    return table


def make_inputs(shape, dtype, device):
    tokens, student_dim, teacher_dim, vocab = shape
    hidden = torch.randn(tokens, student_dim, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, student_dim, device=device) / student_dim**0.5).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(tokens, teacher_dim, device=device, dtype=dtype)
    teacher_weight = (torch.randn(vocab, teacher_dim, device=device) / teacher_dim**0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::7] = IGNORE
    return hidden, weight, teacher_hidden, teacher_weight, labels


BENCH = LossHeadBenchmark(
    kernel="linear_divergence",
    description=__doc__,
    presets=PRESETS,
    make_inputs=make_inputs,
    floor_flops=lambda shape: 2 * shape[0] * shape[3] * (3 * shape[1] + shape[2]),
    floor_text="student 6·N·V·Ds + teacher 2·N·V·Dt FLOPs at the measured matmul ceiling",
    describe=lambda shape: f"N={shape[0]} Ds={shape[1]} Dt={shape[2]} V={shape[3]}",
    providers=providers,
)

if __name__ == "__main__":
    run(BENCH)
