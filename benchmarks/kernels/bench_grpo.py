"""GRPO loss head: fastalign's GRPOLoss vs plain PyTorch as TRL computes it, torch.compile and Liger.

    python benchmarks/kernels/bench_grpo.py --preset gpu   # 64 x 1024 and 8 x 16384 tokens, V=151936, D=4096
    python benchmarks/kernels/bench_grpo.py --preset cpu   # a small head, fp32 (quick: a tiny one)

Each step: per-token log-probs of the completions from hidden states at temperature 1, the clipped
token loss with beta=0.04 (old and reference log-probs given), dapo aggregation, backward to the hidden
states and the head. Plain PyTorch builds the [B·G·T, V] logits and a log-softmax of them, as TRL does.
Floor: 6·N·V·D FLOPs (logits once, two gradient matmuls; fastalign's log-probs recompute the logits in
backward, 8·N·V·D) at the measured matmul ceiling.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.loss_head_suite import LossHeadBenchmark, run
from fastalign.losses import GRPOLoss

PRESETS = {
    "gpu": {
        "dtype": "bfloat16",
        "shapes": [(64, 1024, 4096, 151936), (8, 16384, 4096, 151936)],
        "repeats": 0,
    },
    "cpu": {"dtype": "float32", "shapes": [(8, 256, 256, 32000)], "repeats": 5},
    "quick": {"dtype": "float32", "shapes": [(2, 64, 64, 2048)], "repeats": 5, "ceiling_repeats": 1},
}
BETA, EPSILON, EPSILON_HIGH = 0.04, 0.2, 0.28


def trl_style(hidden, weight, ids, mask, advantages, old, ref):
    """TRL's path: logits, selective log-softmax, elementwise loss, dapo aggregation."""
    logits = (hidden @ weight.T).float()
    logps = torch.gather(logits.log_softmax(-1), -1, ids[..., None]).squeeze(-1)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON_HIGH)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    per_token = per_token + BETA * (torch.exp(ref - logps) - (ref - logps) - 1)
    return (per_token * mask).sum() / mask.sum()


def providers(device: torch.device) -> dict:
    # the plain k3 KL, as the other providers compute it (so every row does the same math)
    fused = GRPOLoss(
        beta=BETA, epsilon=EPSILON, epsilon_high=EPSILON_HIGH, loss_type="dapo", use_bias_correction_kl=False
    )

    def fastalign(hidden, weight, ids, mask, advantages, old, ref):
        return fused(
            hidden, weight, ids, mask, advantages, old_per_token_logps=old, ref_per_token_logps=ref
        ).loss

    table = {"fastalign": fastalign, "torch-eager": trl_style, "torch-compile": torch.compile(trl_style)}
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=BETA, epsilon_low=EPSILON, epsilon_high=EPSILON_HIGH, loss_type="dapo"
        )

        def liger_kernel(hidden, weight, ids, mask, advantages, old, ref):
            return liger(
                hidden, weight, ids, mask, advantages, ref_per_token_logps=ref, old_per_token_logps=old
            )[0]

        table["liger-kernel"] = liger_kernel
    return table


def make_inputs(shape, dtype, device):
    completions, length, dim, vocab = shape
    hidden = torch.randn(completions, length, dim, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, device=device) / dim**0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (completions, length), device=device)
    mask = (torch.rand(completions, length, device=device) < 0.9).float()
    advantages = torch.randn(completions, device=device)
    old = -torch.rand(completions, length, device=device) * 5 - 8
    ref = old + torch.randn_like(old) * 0.1
    return hidden, weight, ids, mask, advantages, old, ref


BENCH = LossHeadBenchmark(
    kernel="grpo",
    description=__doc__,
    presets=PRESETS,
    make_inputs=make_inputs,
    floor_flops=lambda shape: 6 * shape[0] * shape[1] * shape[2] * shape[3],
    floor_text="6·N·V·D FLOPs at the measured matmul ceiling",
    describe=lambda shape: f"B·G={shape[0]} T={shape[1]} D={shape[2]} V={shape[3]}",
    providers=providers,
)

if __name__ == "__main__":
    run(BENCH)
