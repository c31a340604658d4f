"""``fastalign bench gpu``: the whole GPU truth in one call, phase by phase, each phase capped in time and
recorded as soon as it ends (a phase that is killed loses only itself).

    fastalign bench gpu                  # on one H100: under 8 minutes
    fastalign bench gpu --smoke          # every phase on tiny shapes, on any device (the test suite runs it)
    fastalign bench gpu --phases lora_8b qlora_70b --out /tmp/check

Phases, in order (``PHASES``):

- ``tests``: the CUDA test subset (kernels, ops, losses, patching, the activation-memory tests, QLoRA
  training), its failures listed by node id;
- ``lora_8b``: one LoRA SFT step of the Llama-3-8B shape side by side (``benchmarks/gpu/lora_step.py``):
  transformers + peft, the same with Liger-Kernel's patch, with ``fastalign.patch_model``; checkpointing
  off at 4,096 tokens and on at 16,384 (fastalign also with offloading); then TRL's ``SFTTrainer`` on a
  patched model, with ``use_liger_kernel`` and alone, where the time allows;
- ``qlora_70b``: QLoRA steps of the Llama-3-70B shape (NF4, fastalign, the tiled MLP) at 8,192 tokens
  with and without offloading and at 12,106 offloaded, each beside the planner (which also records its
  longest for 48 GB and 80 GB in this machine's RAM);
- ``loss_heads``: linear cross-entropy at two vocabularies, the DPO, GRPO and distillation heads
  against Liger, Cut Cross-Entropy and eager (the kernel benchmark scripts);
- ``generation_1b``: rollout generation of the Llama-3.2-1B shape (``benchmarks/e2e/bench_generation.py``):
  fastalign's engine against ``model.generate`` and transformers' continuous batching;
- ``trl_1b``: DPO and GRPO steps of the Llama-3.2-1B shape, ``fastalign train`` against TRL's trainers
  (GRPO's generation and training apart);
- not in the default run, a call each: ``long_70b`` and ``long_8b``, one step of 70B QLoRA past 89,389
  tokens and of 8B LoRA past 342,733 (the long-context goals), with the tiled MLP and offloading.

Results: ``gpu_check-<device>-<date>.json`` in ``--out`` (rewritten after every phase), the kernel
scripts' own result files beside it, and ``gpu_check-tests.log``. Into ``benchmarks/results`` they
regenerate RESULTS.md. The packages the GPU image lacks travel as wheels (``scripts/gpu_wheels.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.gpu.lora_step import TILE_MIB  # noqa: E402

GiB = 2**30
KERNEL = "gpu_check"


@dataclass(frozen=True)
class Phase:
    name: str
    cap_s: float  # on a GPU; the smoke run caps every phase at SMOKE_CAP_S
    run: Callable[[Context, float], dict]
    summary: str
    default: bool = True  # in the run without --phases (the long-context goals take a call each)


@dataclass
class Context:
    out: Path
    smoke: bool
    device: torch.device
    ceiling_tflops: float
    scratch: Path


SMOKE_CAP_S = 240.0


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _python(
    args: list[str], timeout: float, log: Path | None = None, env: dict | None = None
) -> tuple[int, str]:
    """Run ``python args`` from the repository root; (exit status or 'timeout', its output's tail)."""
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True,
            env=env or os.environ.copy(), start_new_session=True,
        )  # fmt: skip
        try:
            status = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:  # the whole group: pytest's workers hold GPU memory too
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status = "timeout"
        output.seek(0)
        text = output.read()
    if log is not None:
        with open(log, "a") as f:
            f.write(text)
    return status, text[-4000:]


def _stopped(tail: str) -> str:
    """Why a phase's process ended early at its cap, with the last line it printed (what it was doing)."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return "stopped at the phase's time cap" + (f"; its last output: {lines[-1][:200]}" if lines else "")


# ---------------------------------------------------------------------------------------------------
# Phases

TEST_PATHS = (
    "tests/train/test_decode_steps.py", "tests/kernels", "tests/losses", "tests/patching",
    "tests/train/test_memory.py", "tests/quant",
)  # fmt: skip
_RESULT = re.compile(
    r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)|(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)"
)


def parse_test_log(text: str) -> dict:
    """Counts and failed node ids from a ``pytest -v`` log, also of a run stopped before its summary."""
    outcomes: dict[str, str] = {}
    for match in _RESULT.finditer(text):
        outcome, node = (
            (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
        )
        outcomes[node] = outcome
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    failed = sorted(node for node, outcome in outcomes.items() if outcome in ("FAILED", "ERROR"))
    return {"counts": counts, "failed": failed}


def phase_tests(ctx: Context, cap: float) -> dict:
    log = ctx.out / "gpu_check-tests.log"
    log.write_text("")
    paths = ["tests/kernels/test_jit_globals.py"] if ctx.smoke else list(TEST_PATHS)
    args = ["-m", "pytest", *paths, "-v", "-p", "no:cacheprovider", "-rfE", "--no-header"]
    if not ctx.smoke and _installed("xdist"):
        args += ["-n", str(min(12, os.cpu_count() or 1))]
    status, tail = _python(args, cap, log)
    result = parse_test_log(log.read_text())
    summary = [line for line in tail.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return result | {"exit": status, "summary": summary[-1].strip("= ") if summary else None}


def _lora_worker(ctx: Context, spec: dict, deadline: float) -> tuple[list[dict], str | None]:
    """Run one ``lora_step.py`` process until ``deadline``; the rows it finished, and why it stopped
    early (None when it ended normally)."""
    rows_file = ctx.scratch / f"rows-{spec['provider']}-{spec['shape']}-{time.monotonic_ns()}.jsonl"
    spec = spec | {"out": str(rows_file), "scratch": str(ctx.scratch), "ceiling_tflops": ctx.ceiling_tflops}
    status, tail = _python(["benchmarks/gpu/lora_step.py", json.dumps(spec)], deadline - time.monotonic())
    lines = rows_file.read_text().splitlines() if rows_file.exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    killed = [row["killed"] for row in rows if "killed" in row]
    rows = [row for row in rows if "killed" not in row]
    if status == 0:
        return rows, None
    if killed:
        return rows, killed[0]
    if status == "timeout":
        return rows, _stopped(tail)
    return rows, common.error_line(tail, f"exit status {status}")


def _smoke_settings(settings: list[dict]) -> list[dict]:
    return [setting | {"tokens": 64 * (1 + i)} for i, setting in enumerate(settings)]


def phase_lora_8b(ctx: Context, cap: float) -> dict:
    deadline = time.monotonic() + cap
    short = {"tokens": 4096, "checkpointing": False}
    long = {"tokens": 16384, "checkpointing": True}
    runs = [
        ("peft", [short, long]),
        ("liger", [short, long]),
        ("fastalign", [short, long, long | {"offloading": True}]),
        # TRL's rows last, the pair the open goal compares first (TRL alone was measured twice, and the
        # phase's cap ended both runs before the other two)
        ("trl-fastalign", [short]),
        ("trl-liger", [short]),
        ("trl", [short]),
    ]
    needs = {"liger": "liger_kernel", "trl": "trl", "trl-liger": "liger_kernel", "trl-fastalign": "trl"}
    if ctx.smoke:  # one process per kind of provider: the model's own, fastalign's, TRL's trainer (with
        # fastalign inside: the row the open goal reads, and TRL's own path besides)
        runs = [run for run in runs if run[0] in ("peft", "fastalign", "trl-fastalign")]
    rows, skipped = [], {}
    for provider, settings in runs:
        module = needs.get(provider)
        if (module and not _installed(module)) or (provider.startswith("trl") and not _installed("trl")):
            skipped[provider] = f"{module if module and not _installed(module) else 'trl'} not installed"
            continue
        if time.monotonic() > deadline - 5:
            skipped[provider] = "no time left in the phase"
            continue
        spec = {"shape": "tiny-llama" if ctx.smoke else "llama-3-8b", "provider": provider, "steps": 3,
                "settings": _smoke_settings(settings) if ctx.smoke else settings}  # fmt: skip
        got, why = _lora_worker(ctx, spec, deadline)
        rows += got
        if why:
            skipped[provider] = why
    return {"rows": rows, "skipped": skipped}


PLAN_FLAGS = {"checkpointing": True, "lora_r": 16, "lora_dropout": 0.05, "base_dtype": "bf16"}


def longest_tokens(shape: str, method: str, gpu_gib: float, **flags) -> int:
    """The planner's longest sequence (a multiple of 256) whose plan fits in ``gpu_gib``."""
    from fastalign.plan import longest_sequence

    return longest_sequence(shape, method=method, gpu_memory_bytes=int(gpu_gib * GiB), **flags)


def host_memory_bytes() -> int:
    """This machine's RAM (``MemTotal``): what the long-context plans may offload into."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))


def phase_qlora_70b(ctx: Context, cap: float) -> dict:
    deadline = time.monotonic() + cap
    shape = "tiny-llama" if ctx.smoke else "llama-3-70b"
    host = {"host_memory_bytes": host_memory_bytes()}
    longest = {
        f"{gib}gb{'_offload' if offload else ''}": longest_tokens(
            shape, "qlora", gib, offload_activations=offload, tiled_mlp_mib=TILE_MIB, **PLAN_FLAGS, **host
        )
        for gib in (48, 80)
        for offload in (False, True)
    }
    ckpt = {"checkpointing": True}
    settings = [
        {"tokens": 8192} | ckpt,
        {"tokens": 8192, "offloading": True} | ckpt,
        {"tokens": 12106, "offloading": True, "goal": "within 48 GB"} | ckpt,
    ]
    spec = {"shape": shape, "provider": "fastalign", "quant": "nf4", "steps": 2, "tiled_mlp": True,
            "settings": _smoke_settings(settings) if ctx.smoke else settings}  # fmt: skip
    rows, why = _lora_worker(ctx, spec, deadline)
    return {"rows": rows, "planner_longest_tokens": longest, "skipped": {"rest": why} if why else {}}


#: The long-context goals of the open issue, each one training step just past its anchor's length:
#: (phase, shape, quantized, tokens, the anchor). ~4 and ~7 minutes on an H100 (estimated, not measured):
#: a call each, beside the check (``--phases long_70b``).
LONG = {
    "long_70b": ("llama-3-70b", True, 90112, "Unsloth's 89,389 tokens, 70B QLoRA on 80 GB"),
    "long_8b": ("llama-3-8b", False, 344064, "Unsloth's 342,733 tokens, 8B LoRA on 80 GB"),
}


def _phase_long(name: str) -> Callable[[Context, float], dict]:
    def phase(ctx: Context, cap: float) -> dict:
        """One step at the goal's length: checkpointing, the tiled MLP, offloading with the planner's
        keep_on_device (auto), against the planner's prediction."""
        from fastalign.plan import plan_memory

        shape, quant, tokens, anchor = LONG[name]
        shape, tokens = ("tiny-llama", 512) if ctx.smoke else (shape, tokens)
        plan = plan_memory(
            shape, method="qlora" if quant else "lora", seq_len=tokens, offload_activations=True,
            tiled_mlp_mib=TILE_MIB, gpu_memory_bytes=80 * GiB, host_memory_bytes=host_memory_bytes(),
            suggest=False, **PLAN_FLAGS,
        )  # fmt: skip
        setting = {"tokens": tokens, "checkpointing": True, "offloading": True,
                   "keep_on_device": plan.offload_keep_on_device, "goal": anchor}  # fmt: skip
        spec = {"shape": shape, "provider": "fastalign", "quant": "nf4" if quant else None, "steps": 1,
                "tiled_mlp": True, "host_limit_fraction": 0.9, "settings": [setting]}  # fmt: skip
        rows, why = _lora_worker(ctx, spec, time.monotonic() + cap)
        return {"rows": rows, "plan_fits": plan.fits, "skipped": {"rest": why} if why else {}}

    return phase


def phase_loss_heads(ctx: Context, cap: float) -> dict:
    deadline = time.monotonic() + cap
    scripts = [
        (
            "linear_cross_entropy",
            "gpu-check",
            ["fastalign-triton", "liger-kernel", "cut-cross-entropy", "torch-eager"],
        ),
        ("preference", "gpu", None),
        ("grpo", "gpu", None),
        ("linear_divergence", "gpu", None),
    ]
    if ctx.smoke:  # the cross-entropy runner and the loss-head runner, one script each
        scripts = scripts[:2]
    files, skipped = [], {}
    for name, preset, providers in scripts:
        if time.monotonic() > deadline - 5:
            skipped[name] = "no time left in the phase"
            continue
        args = [
            f"benchmarks/kernels/bench_{name}.py",
            "--preset",
            "quick" if ctx.smoke else preset,
            "--out",
            str(ctx.out),
        ]
        if ctx.smoke:  # the PyTorch paths, no compilation: seconds on a CPU
            head = name == "linear_cross_entropy"
            providers = ["fastalign-torch", "torch-eager"] if head else ["fastalign"]
        args += ["--providers", *providers] if providers else []
        before = set(ctx.out.glob(f"{name}-*.json"))
        status, tail = _python(args, deadline - time.monotonic())
        new = sorted(set(ctx.out.glob(f"{name}-*.json")) - before)
        files += [path.name for path in new]
        if status != 0:
            skipped[name] = _stopped(tail) if status == "timeout" else tail.strip().splitlines()[-1][:300]
    return {"files": files, "skipped": skipped}


def _script_phase(ctx: Context, cap: float, script: str, kernel: str, preset: str, smoke_preset: str) -> dict:
    """Run one benchmark script under the phase's cap: the result files it wrote, and why it stopped
    early if it did."""
    before = set(ctx.out.glob(f"{kernel}-*.json"))
    args = [script, "--preset", smoke_preset if ctx.smoke else preset, "--out", str(ctx.out)]
    status, tail = _python(args, cap)
    result: dict = {"files": sorted(path.name for path in set(ctx.out.glob(f"{kernel}-*.json")) - before)}
    if status != 0:
        result["skipped"] = {
            "rest": _stopped(tail) if status == "timeout" else tail.strip().splitlines()[-1][:300]
        }
    return result


def phase_generation_1b(ctx: Context, cap: float) -> dict:
    return _script_phase(ctx, cap, "benchmarks/e2e/bench_generation.py", "e2e_generation", "gpu", "quick")


def phase_trl_1b(ctx: Context, cap: float) -> dict:
    if not _installed("trl"):
        return {"skipped": {"all": "trl not installed"}}
    return _script_phase(
        ctx, cap, "benchmarks/e2e/bench_real_trl.py", "e2e_real_trl", "gpu-1b", "smoke-random"
    )


PHASES = (
    Phase("tests", 60, phase_tests, "the CUDA test subset"),
    Phase("lora_8b", 140, phase_lora_8b, "Llama-3-8B-shape LoRA SFT steps side by side"),
    Phase("qlora_70b", 115, phase_qlora_70b, "Llama-3-70B-shape QLoRA: long context and offloading"),
    Phase("loss_heads", 55, phase_loss_heads, "loss heads against Liger, CCE and eager"),
    Phase(
        "generation_1b", 45, phase_generation_1b, "Llama-3.2-1B-shape rollout generation: engine vs generate"
    ),
    Phase("trl_1b", 65, phase_trl_1b, "Llama-3.2-1B-shape DPO and GRPO against TRL"),
    Phase("long_70b", 540, _phase_long("long_70b"), LONG["long_70b"][3], default=False),
    Phase("long_8b", 540, _phase_long("long_8b"), LONG["long_8b"][3], default=False),
)
BY_NAME = {phase.name: phase for phase in PHASES}


def selected_phases(names: list[str] | None) -> list[Phase]:
    """``names`` in the check's order, or without names the default run (all but the long-context goals)."""
    return [phase for phase in PHASES if (phase.name in names if names else phase.default)]


def run(out: Path, smoke: bool, names: list[str] | None = None, cap_s: float | None = None) -> Path:
    """Run the phases (the default ones, or ``names``), each within its cap (or ``cap_s``), and write the
    check's result file; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not smoke and device.type != "cuda":
        raise SystemExit(
            "error: fastalign bench gpu needs a CUDA device (--smoke runs it on tiny shapes anywhere)"
        )
    # bf16 on a GPU; on a CPU (the smoke run) fp32, which every x86 CPU multiplies at full speed; the smoke
    # run's ceiling is one timed product (ten 2048² products take ~7 s on one CPU thread, and its MFU
    # figures are not read)
    ceiling = common.matmul_tflops(
        device, torch.bfloat16 if device.type == "cuda" else torch.float32, repeats=1 if smoke else 10
    )
    env = common.environment(device)
    result = {"suite": "gpu", "kernel": KERNEL, "preset": "smoke" if smoke else "gpu", "env": env,
              "matmul_tflops": round(ceiling, 1), "phases": {}, "rows": []}  # fmt: skip
    path = out / f"{KERNEL}-{common.slug(env['device'])}-{env['date'].replace(':', '').replace('-', '')}.json"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        ctx = Context(out, smoke, device, ceiling, Path(scratch))
        for phase in selected_phases(names):
            cap = SMOKE_CAP_S if smoke else cap_s or phase.cap_s
            print(f"== {phase.name} ({phase.summary}), at most {cap:.0f} s", flush=True)
            started = time.monotonic()
            try:
                outcome = phase.run(ctx, cap)
            except Exception as error:  # the phase is lost, the others still run
                outcome = {"error": f"{type(error).__name__}: {error}"[:400]}
            outcome["seconds"] = round(time.monotonic() - started, 1)
            result["phases"][phase.name] = outcome
            result["rows"] = [
                row | {"phase": name}
                for name, done in result["phases"].items()
                for row in done.get("rows", [])
            ]
            common.write_json_atomically(path, result)
            print(
                json.dumps({phase.name: {k: v for k, v in outcome.items() if k != "rows"}})[:2000], flush=True
            )
            for row in outcome.get("rows", []):
                print(json.dumps(row), flush=True)
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="every phase on tiny shapes, on any device")
    parser.add_argument(
        "--out", type=Path, help="results folder (default: benchmarks/results; smoke: a temp dir)"
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=list(BY_NAME),
        help="these phases only (default: all but the long-context goals, long_70b and long_8b)",
    )
    parser.add_argument(
        "--cap", type=float, help="seconds each phase may take (default: its own cap; the caps sum to 8 min)"
    )
    args = parser.parse_args(argv)
    out = args.out or (
        Path(tempfile.mkdtemp(prefix="gpu_check_smoke_")) if args.smoke else common.RESULTS_DIR
    )
    if args.cap is not None and args.cap <= 0:
        parser.error(f"--cap must be a positive number of seconds, got {args.cap:g}")
    path = run(out, args.smoke, args.phases, args.cap)
    phases = json.loads(path.read_text())["phases"]
    failed = [name for name, outcome in phases.items() if outcome.get("error") or outcome.get("failed")]
    if failed:
        print(f"phases with errors or failed tests: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
