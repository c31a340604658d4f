"""Each piece ``patch_model`` installs, against the model's own module, on the real model's shapes on CPU.

    python benchmarks/e2e/bench_trl_cpu_pieces.py [--reps 15] [--batch 4] [--tokens 256]

SmolLM2-135M-Instruct (the real-model fixture of the tests, ``tests/real/model.py``), fp32, on the CPU:
for layer 0's RMSNorm, gated MLP and attention (RoPE), the module's own forward and the same module with
fastalign's forward bound to it (as ``patch_model`` binds it, backend "torch": the CPU path), forward and
backward on ``batch × tokens`` hidden states; and TRL 1.16's fused LM head (``_ChunkedLogProbFunction``,
the outputs ``SFTTrainer`` asks for: log-probs, entropy, top-1) against ``FusedLogProbs``
(``fastalign.integrations.trl``), called as TRL calls it on CPU (every position scored). A and B alternate
in one process, ``--reps`` times each after a warm-up; each figure is the median, with the interquartile
range over the median (the CPU may be shared: alternating keeps both sides under the same load).
Prints one JSON object: per piece, both medians in ms, the spread and ``speedup`` (own / fastalign).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastalign.patching import modules

HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")  # SFTTrainer's


def _time(function) -> float:
    start = time.perf_counter()
    function()
    return (time.perf_counter() - start) * 1e3


def interleaved(cases: dict, reps: int, warmup: int = 2) -> dict:
    """Median ms and relative interquartile range of each callable, run alternately ``reps`` times."""
    for _ in range(warmup):
        for function in cases.values():
            function()
    times = {name: [] for name in cases}
    for i in range(reps):
        order = list(cases) if i % 2 == 0 else list(reversed(cases))
        for name in order:
            times[name].append(_time(cases[name]))
    out = {}
    for name, values in times.items():
        q = statistics.quantiles(values, n=4)
        median = statistics.median(values)
        out[name] = {"ms": round(median, 2), "spread": round((q[2] - q[0]) / median, 3)}
    return out


def fwd_bwd(module, make_args):
    def run():
        args, kwargs, leaves = make_args()
        out = module(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        for leaf in leaves:
            leaf.grad = None
        module.zero_grad(set_to_none=True)

    return run


def patched(module, function):
    clone = copy.deepcopy(module)
    clone.forward = types.MethodType(function, clone)
    return clone


def pieces(model, batch: int, tokens: int, reps: int) -> dict:
    layer = model.model.layers[0]
    hidden = model.config.hidden_size
    x = torch.randn(batch, tokens, hidden)

    def hidden_args():
        leaf = x.clone().requires_grad_()
        return (leaf,), {}, [leaf]

    position_ids = torch.arange(tokens).expand(batch, tokens)
    cos, sin = model.model.rotary_emb(x, position_ids)

    def attention_args():
        leaf = x.clone().requires_grad_()
        return (leaf,), {"position_embeddings": (cos, sin), "attention_mask": None}, [leaf]

    results = {}
    norm, mlp, attention = layer.input_layernorm, layer.mlp, layer.self_attn
    cases = {
        "rms_norm": (norm, modules.rms_norm_forward(False, "torch"), hidden_args),
        "mlp": (mlp, modules.gated_mlp_forward("split", False, False, "torch"), hidden_args),
        "rope": (
            attention,
            modules.attention_forward_with_fused_rope(type(attention), "torch"),
            attention_args,
        ),
    }
    for piece, (module, function, make_args) in cases.items():
        ours = patched(module, function)
        timed = interleaved({"own": fwd_bwd(module, make_args), "fastalign": fwd_bwd(ours, make_args)}, reps)
        results[piece] = timed | {"speedup": round(timed["own"]["ms"] / timed["fastalign"]["ms"], 3)}
    return results


def head(model, batch: int, tokens: int, prompt_tokens: int, reps: int) -> dict:
    from trl.trainer import utils as trl_utils

    from fastalign.integrations.trl import FusedLogProbs

    trl_function = trl_utils._ChunkedLogProbFunction
    weight = model.lm_head.weight
    n = batch * (tokens - 1)
    h = torch.randn(n, model.config.hidden_size)
    targets = torch.randint(0, weight.shape[0], (n,))
    # TRL on CPU scores every position and zeroes the masked ones (each row's prompt) afterwards
    keep = torch.ones(batch, tokens - 1)
    keep[:, : prompt_tokens - 1] = 0
    keep = keep.reshape(-1)

    def call(function):
        def run():
            leaf = h.clone().requires_grad_()
            args = (
                1.0,
                trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE,
                None,
                1.0,
            )  # temperature, chunk, softcap, scale
            logprobs = function.apply(leaf, weight, None, targets, *args, HEAD_OUTPUTS)[0]
            (-(logprobs * keep).sum()).backward()
            weight.grad = None

        return run

    timed = interleaved({"own": call(trl_function), "fastalign": call(FusedLogProbs)}, reps)
    return {"head": timed | {"speedup": round(timed["own"]["ms"] / timed["fastalign"]["ms"], 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--prompt-tokens", type=int, default=64, help="masked positions per row in the head's case"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, the cores)")
    parser.add_argument("--only", nargs="*", choices=["rms_norm", "mlp", "rope", "head"])
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tests.real.model import smollm2_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    settings = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu",
        "threads": torch.get_num_threads(), "batch": args.batch, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "reps": args.reps, "torch": torch.__version__,
    }  # fmt: skip
    results = {}
    if not args.only or set(args.only) - {"head"}:
        results |= pieces(model, args.batch, args.tokens, args.reps)
    if not args.only or "head" in args.only:
        results |= head(model, args.batch, args.tokens, args.prompt_tokens, args.reps)
    if args.only:
        results = {k: v for k, v in results.items() if k in args.only}
    print(json.dumps({"settings": settings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
