"""DPO loss head: fastalign's PreferenceLoss vs plain PyTorch as TRL computes it, torch.compile, Liger.

    python benchmarks/kernels/bench_preference.py --preset gpu   # B=8 pairs, T=2048, V=128256, D=4096, bf16
    python benchmarks/kernels/bench_preference.py --preset cpu   # a small head, fp32 (quick: a tiny one)

One step: sequence log-probs of the chosen and rejected completions from the policy's hidden states,
reference log-probs from the reference model's hidden states (no gradient), the sigmoid DPO loss,
backward to the policy hidden states and head. Plain PyTorch builds [2B·T, V] logits for policy and
reference and a log-softmax of them, as TRL does. Floor: the policy's 6·N·V·D FLOPs plus the
reference's 2·N·V·D (N = 2B·T) at the measured matmul ceiling.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.loss_head_suite import LossHeadBenchmark, run
from fastalign.losses import PreferenceLoss

PRESETS = {
    "gpu": {"dtype": "bfloat16", "shapes": [(8, 2048, 4096, 128256)], "repeats": 0},
    "cpu": {"dtype": "float32", "shapes": [(4, 256, 256, 32000)], "repeats": 5},
    "quick": {"dtype": "float32", "shapes": [(1, 64, 64, 2048)], "repeats": 5, "ceiling_repeats": 1},
}
BETA = 0.1


def trl_style(hidden, weight, targets, mask, ref_hidden, ref_weight):
    def seq_logps(h, w):
        logps = torch.gather((h @ w.T).float().log_softmax(-1), -1, targets[..., None]).squeeze(-1)
        return (logps * mask).sum(-1)

    with torch.no_grad():
        ref = seq_logps(ref_hidden, ref_weight)
    policy = seq_logps(hidden, weight)
    pairs = hidden.shape[0] // 2
    logits = (policy[:pairs] - policy[pairs:]) - (ref[:pairs] - ref[pairs:])
    return -F.logsigmoid(BETA * logits).mean()


def providers(device: torch.device) -> dict:
    fused = PreferenceLoss(beta=BETA)

    def fastalign(hidden, weight, targets, mask, ref_hidden, ref_weight):
        return fused(hidden, weight, targets, mask, ref_hidden=ref_hidden, ref_weight=ref_weight).loss

    table = {"fastalign": fastalign, "torch-eager": trl_style, "torch-compile": torch.compile(trl_style)}
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel"):
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        liger = LigerFusedLinearDPOLoss(beta=BETA)

        def liger_kernel(hidden, weight, targets, mask, ref_hidden, ref_weight):
            labels = torch.where(mask.bool(), targets, -100)
            return liger(weight, hidden, labels, ref_input=ref_hidden, ref_weight=ref_weight)[0]

        table["liger-kernel"] = liger_kernel
    return table


def make_inputs(shape, dtype, device):
    pairs, length, dim, vocab = shape
    hidden = torch.randn(2 * pairs, length, dim, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, device=device) / dim**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2 * pairs, length), device=device)
    mask = (torch.arange(length, device=device)[None] < length // 2 + 1).expand(2 * pairs, -1).float()
    ref_hidden = (hidden.detach() + 0.1 * torch.randn_like(hidden)).to(dtype)
    return hidden, weight, targets, mask, ref_hidden, weight.detach().clone()


BENCH = LossHeadBenchmark(
    kernel="preference",
    description=__doc__,
    presets=PRESETS,
    make_inputs=make_inputs,
    floor_flops=lambda shape: 8 * 2 * shape[0] * shape[1] * shape[2] * shape[3],
    floor_text="policy 6·N·V·D + reference 2·N·V·D FLOPs at the measured matmul ceiling",
    describe=lambda shape: f"pairs={shape[0]} T={shape[1]} D={shape[2]} V={shape[3]}",
    providers=providers,
)

if __name__ == "__main__":
    run(BENCH)
