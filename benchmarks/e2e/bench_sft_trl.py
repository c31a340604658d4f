"""End to end: SFT training throughput and memory, fastalign's ``run_sft`` vs TRL's ``SFTTrainer``.

    python benchmarks/e2e/bench_sft_trl.py --preset cpu            # fastalign (patched/unpatched) vs TRL
    python benchmarks/e2e/bench_sft_trl.py --preset gpu            # Llama-3-8B shape, LoRA, bf16, seq 4096
    python benchmarks/e2e/bench_sft_trl.py --preset gpu --smoke    # the gpu providers on a tiny shape (CPU)

Random weights built from a config (no download); prompt-completion rows of arithmetic questions (the
completion's tokens are the loss), filled to about ``max_length`` tokens. ``cpu``: a small Llama with a
32k vocabulary, so that the loss head dominates, saved once with ``save_pretrained`` and loaded by every
provider; every provider trains with the same options (max_length, batch size, gradient accumulation,
steps, learning rate and cosine schedule, AdamW, gradient clipping, seed, fp32, no packing, completion-only
loss). ``gpu``: fastalign only, Llama-3-8B's shapes (all 32 layers) with LoRA, bf16 autocast, activation
checkpointing with and without activation offloading (and neither); its random weights are initialised on
the GPU and saved once in bf16 (16 GB), which every provider loads as fastalign loads any checkpoint.

Every provider trains in a fresh process. A row: the first ``warmup`` optimizer steps are skipped, then
``tokens/s`` = non-pad tokens / wall time of the remaining steps; ``step_ms`` = median wall time of an
optimizer step (forwards, backwards, clipping, AdamW, data) and ``step_spread`` its interquartile range
over the median, ``fwd_ms`` = the forwards (loss included) of its micro-batches; ``peak_extra_mib`` = a
step's workspace: peak memory during the measured steps above what was allocated before them (weights,
gradients, optimizer states); ``peak_rss_mib`` (CPU: the process's peak resident set, all of the run up
to the end of training) or ``peak_cuda_mib`` (``torch.cuda.max_memory_allocated``); first and final step
losses; MFU where the GPU's peak is known (``fastalign.train.metrics``). On CPU each provider runs twice:
once timed, once for the workspace with freed memory returned to the system at once (which slows the
timing down); a timed run waits for a quiet machine, records ``other_cpu_load`` (the CPU share other
processes took while it was measured) and is run again, up to ``--attempts`` times, when others slowed it
down. A provider that is not installed or fails is skipped with the reason recorded.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import common
from fastalign.bench import measure
from fastalign.builtin import tiny_sft_rows, tiny_tokenizer
from fastalign.train.metrics import peak_flops, training_flops_per_token

KERNEL = "e2e_sft"
#: A timed CPU run during which other processes took more than this share of the CPU is run again.
CONTENDED = 0.05

LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                  rms_norm_eps=1e-5)  # fmt: skip
#: What ``--smoke`` trains instead of the preset's shape: every option of the preset, a few seconds on CPU.
SMOKE = {
    "config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=1024),
    "max_length": 64, "batch": 2, "accumulation": 2, "steps": 3, "warmup": 1,
}  # fmt: skip

PRESETS = {
    "cpu": {
        "config": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=32000),
        "dtype": "float32", "max_length": 256, "batch": 4, "accumulation": 2, "steps": 12, "warmup": 2,
        "learning_rate": 5e-4, "providers": ["fastalign", "fastalign-unpatched", "trl", "trl+liger"],
    },
    "gpu": {
        "config": LLAMA_3_8B, "dtype": "bfloat16", "max_length": 4096, "batch": 1, "accumulation": 1,
        "steps": 10, "warmup": 3, "learning_rate": 1e-4,
        "providers": [
            "fastalign-lora", "fastalign-lora-checkpointing", "fastalign-lora-checkpointing-offloading",
        ],
    },
}  # fmt: skip

#: Provider → (trainer, its options besides the shared ones).
PROVIDERS = {
    "fastalign": ("fastalign", {"use_liger_kernel": True}),
    "fastalign-unpatched": ("fastalign", {"use_liger_kernel": False}),
    "trl": ("trl", {}),
    "trl+liger": ("trl", {"use_liger_kernel": True}),
    "fastalign-lora": ("fastalign", {"use_liger_kernel": True, "use_peft": True}),
    "fastalign-lora-checkpointing": (
        "fastalign", {"use_liger_kernel": True, "use_peft": True, "gradient_checkpointing": True},
    ),
    "fastalign-lora-checkpointing-offloading": (
        "fastalign", {"use_liger_kernel": True, "use_peft": True, "gradient_checkpointing": True,
                      "activation_offloading": True},
    ),
}  # fmt: skip


def missing_package(provider: str) -> str | None:
    """Why ``provider`` cannot run here (a package that is not installed), or None."""
    trainer, options = PROVIDERS[provider]
    needed = (["trl"] if trainer == "trl" else []) + (
        ["liger_kernel"] if trainer == "trl" and options.get("use_liger_kernel") else []
    )
    absent = [name for name in needed if importlib.util.find_spec(name) is None]
    return f"{', '.join(absent)} not installed (pip install -e '.[bench]')" if absent else None


# ---------------------------------------------------------------------------------------------------
# The data and the model, built once by the parent process


def sft_rows(tokenizer, count: int, max_length: int, seed: int = 0) -> list[dict]:
    """``count`` prompt-completion rows, each as many arithmetic questions (prompt) and their answers
    (completion) as fit in ``max_length`` tokens with the EOS that both trainers append."""
    pairs = iter(tiny_sft_rows(count * max_length, seed=seed))
    rows = []
    for _ in range(count):
        questions, answers, length = [], [], 1  # 1: the EOS
        for pair in pairs:
            question, answer = " " + pair["prompt"], pair["completion"]
            cost = len(tokenizer(question + answer, add_special_tokens=False)["input_ids"])
            if length + cost > max_length:
                break
            questions.append(question)
            answers.append(answer)
            length += cost
        row = {"prompt": "".join(questions).lstrip(), "completion": "".join(answers)}
        while _row_length(tokenizer, row) > max_length:  # byte-level BPE splits at spaces; in case not
            questions.pop()
            answers.pop()
            row = {"prompt": "".join(questions).lstrip(), "completion": "".join(answers)}
        rows.append(row)
    return rows


def _row_length(tokenizer, row: dict) -> int:
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    return len(prompt) + len(tokenizer(row["completion"], add_special_tokens=False)["input_ids"]) + 1


def llama_config(shape: dict, max_length: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        **shape, max_position_embeddings=max(max_length, 128), tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,  # the ids of fastalign.builtin.tiny_tokenizer
    )  # fmt: skip


def build_model(config, device: torch.device | str = "cpu", seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model


def save_model(config, tokenizer, path: str, dtype: torch.dtype, device: torch.device) -> None:
    """Random weights, built on ``device`` (an 8B model initialises in seconds on a GPU) and saved in
    ``dtype`` (bf16 halves an 8B checkpoint to 16 GB), with the tokenizer."""
    model = build_model(config, device).to(dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# Measurement inside a provider's process


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class CpuShare:
    """The share of the machine's CPU time that other processes took between ``start()`` and ``stop()``
    (0: this one had the machine to itself), from /proc/stat and this process's own CPU time. On a shared
    machine a concurrent job slows every row down, and two OpenMP threads on one free core far more."""

    def start(self) -> None:
        self._begin = (self._machine(), self._own())

    def stop(self) -> float | None:
        (busy0, total0), own0 = self._begin
        (busy1, total1), own1 = self._machine(), self._own()
        if total1 <= total0:
            return None
        return round(max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0), 3)

    @staticmethod
    def _machine() -> tuple[float, float]:
        """(busy, total) CPU seconds of all cores since boot."""
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        ticks = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        total = sum(fields[:8])  # guest time is already counted in user time
        return (total - idle) / ticks, total / ticks

    @staticmethod
    def _own() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


def wait_for_quiet_machine(limit_s: float = 180.0, threshold: float = CONTENDED) -> float | None:
    """Wait (up to ``limit_s``) until other processes use less than ``threshold`` of the CPU over a second;
    returns the last share seen."""
    share, deadline = None, time.monotonic() + limit_s
    while time.monotonic() < deadline:
        probe = CpuShare()
        probe.start()
        time.sleep(1.0)
        share = probe.stop()
        if share is not None and share < threshold:
            break
    return share


class StepClock:
    """Per optimizer step: wall time, non-pad tokens, loss and forward time; memory of the measured
    steps (after ``warmup``) apart from what came before them."""

    def __init__(self, warmup: int, device: torch.device):
        self.warmup, self.device = warmup, device
        self.ends: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.forward_ms: list[float] = []
        self._forwards: list = []  # this step's (start, end) times or CUDA events
        self.peak_before = self.resident_before = self.peak_during = None
        self.cpu_share = CpuShare()
        self.other_cpu_load = None

    def time_forwards(self, model: torch.nn.Module) -> None:
        """Time every forward of ``model`` (the trainer's top-level module: the loss is computed inside it,
        and recomputation under activation checkpointing is not a forward of it)."""
        if self.device.type == "cuda":  # events: no synchronisation inside the step

            def now():
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
        else:
            now = time.perf_counter

        def before(module, args, kwargs):
            self._started = now()

        def after(module, args, kwargs, output):
            self._forwards.append((self._started, now()))

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True)

    def step_end(self, tokens: int, loss: float) -> None:
        """Call after the optimizer step, once its loss is on the host (the step has finished)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            forward = sum(start.elapsed_time(end) for start, end in self._forwards)
        else:
            forward = sum(end - start for start, end in self._forwards) * 1e3
        self._forwards = []
        self.ends.append(time.perf_counter())
        self.tokens.append(int(tokens))
        self.losses.append(float(loss))
        self.forward_ms.append(forward)
        if len(self.ends) == self.warmup:
            self._start_memory_window()
            self.cpu_share.start()
            self.ends[-1] = time.perf_counter()  # the measured steps start after the window's set-up

    def _start_memory_window(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            self.peak_before = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.resident_before = torch.cuda.memory_allocated(self.device)
        else:
            self.peak_before = _peak_rss_bytes()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident set (VmHWM) starts again from the current one
            with open("/proc/self/statm") as f:
                self.resident_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def train_end(self) -> None:
        self.other_cpu_load = self.cpu_share.stop() if self.warmup < len(self.ends) else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_during = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak_during = _peak_rss_bytes()

    def figures(self) -> dict:
        measured = range(self.warmup, len(self.ends))
        if len(measured) < 1 or self.peak_during is None:
            raise RuntimeError(f"only {len(self.ends)} steps ran; {self.warmup} warm-up steps are skipped")
        intervals = [(self.ends[i] - self.ends[i - 1]) * 1e3 for i in measured if i > 0]
        seconds = self.ends[-1] - self.ends[self.warmup - 1] if self.warmup else None
        tokens = sum(self.tokens[i] for i in measured if i > 0)
        peak = max(self.peak_before, self.peak_during)
        memory = "peak_cuda_mib" if self.device.type == "cuda" else "peak_rss_mib"
        return {
            "fwd_ms": round(statistics.median(self.forward_ms[i] for i in measured), 2),
            "step_ms": round(statistics.median(intervals), 2),
            "step_spread": round(measure.relative_spread(intervals), 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "tokens_per_step": statistics.median(self.tokens[i] for i in measured),
            "peak_extra_mib": round((self.peak_during - self.resident_before) / 2**20, 1),
            memory: round(peak / 2**20, 1),
            "first_loss": round(self.losses[0], 4),
            "final_loss": round(self.losses[-1], 4),
            "losses": [round(loss, 4) for loss in self.losses],
            "other_cpu_load": self.other_cpu_load,
        }


def run_fastalign(spec: dict, clock: StepClock) -> None:
    from fastalign.train.config import TrainConfig
    from fastalign.train.engine import Callback
    from fastalign.train.sft import run_sft

    class Clock(Callback):
        def on_train_begin(self, engine) -> None:
            clock.time_forwards(engine.model)

        def on_step_end(self, engine, metrics: dict) -> None:
            clock.step_end(metrics["tokens"], metrics["loss"])

        def on_train_end(self, engine) -> None:
            clock.train_end()

    _, options = PROVIDERS[spec["provider"]]
    config = TrainConfig(
        model_name_or_path=spec["model_dir"], dataset_name=spec["data"], output_dir=spec["output_dir"],
        max_length=spec["max_length"], packing=False, completion_only_loss=True, max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=spec["accumulation"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, seed=spec["seed"], bf16=spec["dtype"] == "bfloat16", logging_steps=spec["steps"],
        loss_curve_png=False, report_to=[], **options,
    )  # fmt: skip
    run_sft(config, callbacks=[Clock()])


def run_trl(spec: dict, clock: StepClock) -> None:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class LossPerStep(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            # Each micro-batch's loss is its share of the step's token mean: their sum is the step's loss.
            self.step_loss = getattr(self, "step_loss", 0.0) + (loss[0] if return_outputs else loss).detach()
            return loss

    class Clock(TrainerCallback):
        tokens_seen = 0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            clock.time_forwards(model)

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end(state.num_input_tokens_seen - self.tokens_seen, float(trainer.step_loss))
            self.tokens_seen, trainer.step_loss = state.num_input_tokens_seen, 0.0

        def on_train_end(self, args, state, control, **kwargs):
            clock.train_end()

    _, options = PROVIDERS[spec["provider"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    args = SFTConfig(
        output_dir=spec["output_dir"], max_length=spec["max_length"], packing=False, padding_free=False,
        completion_only_loss=True, max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["accumulation"], learning_rate=spec["learning_rate"],
        lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=spec["seed"],
        optim="adamw_torch", bf16=spec["dtype"] == "bfloat16", fp16=False, gradient_checkpointing=False,
        use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=spec["steps"], disable_tqdm=True, dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding", **options,
    )  # fmt: skip
    trainer = LossPerStep(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()


def worker(spec: dict) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec["part"] == "memory":
        measure.release_freed_memory_promptly()
    clock = StepClock(spec["warmup"], device)
    trainer, _ = PROVIDERS[spec["provider"]]
    (run_fastalign if trainer == "fastalign" else run_trl)(spec, clock)
    Path(spec["result"]).write_text(json.dumps(clock.figures()))


# ---------------------------------------------------------------------------------------------------
# The parent process


def measure_provider(spec: dict, device: torch.device, timeout: float, attempts: int) -> dict:
    """The provider's figures from fresh processes: timed, and on CPU the workspace from another one.

    On CPU each timed run starts on a quiet machine, and one that other processes slowed down (more than
    ``CONTENDED`` of the CPU) is run again, up to ``attempts`` times; the least disturbed run is kept."""
    row, runs = None, 0
    while runs < attempts:
        if device.type == "cpu" and attempts > 1:
            wait_for_quiet_machine()
        run = common.run_worker(__file__, spec | {"part": "time"}, timeout)
        runs += 1
        if row is None or (run["other_cpu_load"] or 0.0) < (row["other_cpu_load"] or 0.0):
            row = run
        if device.type != "cpu" or (row["other_cpu_load"] or 0.0) <= CONTENDED:
            break
    row["timed_runs"] = runs
    if device.type == "cpu":
        # its own output_dir: fastalign refuses to train into the timed run's (not empty)
        memory_spec = spec | {
            "part": "memory",
            "steps": spec["warmup"] + 2,
            "output_dir": f"{spec['output_dir']}-memory",
        }
        memory = common.run_worker(__file__, memory_spec, timeout)
        row["peak_extra_mib"] = memory["peak_extra_mib"]
    return row


def matmul_ceiling(device: torch.device, dtype: str, quiet: bool) -> float:
    if device.type == "cpu" and quiet:
        wait_for_quiet_machine()
    return common.matmul_tflops(device, getattr(torch, dtype))


def run(
    preset_name: str, providers: list[str] | None, out_dir: Path | None, smoke: bool, attempts: int = 3
) -> Path:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[preset_name] | (SMOKE if smoke else {})
    attempts = 1 if smoke else attempts  # a smoke run checks that it works, not how fast
    if preset_name == "gpu" and device.type != "cuda" and not smoke:
        raise SystemExit("--preset gpu needs CUDA; --smoke runs its providers on a tiny shape on CPU")
    names = common.select_providers(KERNEL, PROVIDERS, providers, preset["providers"])
    if device.type == "cpu":
        measure.release_freed_memory_promptly()  # our own figures are taken in the workers; harmless here
    shape, max_length, dtype = preset["config"], preset["max_length"], preset["dtype"]
    tflops = matmul_ceiling(device, dtype, quiet=attempts > 1)
    config = llama_config(shape, max_length)
    flops_per_token = training_flops_per_token(build_model(config, "meta"), max_length)
    device_peak = peak_flops(device)
    steps = preset["steps"]
    rows_needed = preset["batch"] * preset["accumulation"] * steps  # one epoch: no row seen twice
    skipped: dict[str, str] = {}
    rows: list[dict] = []
    description = (
        f"llama hidden={shape['hidden_size']} layers={shape['num_hidden_layers']} "
        f"vocab={shape['vocab_size']} batch={preset['batch']}x{preset['accumulation']} seq<={max_length}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_sft_") as tmp, common.keep_rows_on_termination(skipped):
        tokenizer = tiny_tokenizer(shape["vocab_size"])
        data = Path(tmp) / "train.jsonl"
        rows_text = (json.dumps(row) + "\n" for row in sft_rows(tokenizer, rows_needed, max_length))
        data.write_text("".join(rows_text))
        spec = {
            "data": str(data), "max_length": max_length, "batch": preset["batch"],
            "accumulation": preset["accumulation"], "steps": steps, "warmup": preset["warmup"],
            "learning_rate": preset.get("learning_rate", 1e-4), "seed": 0, "dtype": dtype,
        }  # fmt: skip
        # Saved once: every provider loads the same weights (fp32, as both trainers load them) and tokenizer.
        spec["model_dir"] = str(Path(tmp) / "model")
        save_model(config, tokenizer, spec["model_dir"], getattr(torch, dtype), device)
        for name in names:
            reason = missing_package(name)
            if reason:
                skipped[name] = reason
                continue
            output_dir = Path(tmp) / name.replace("+", "-")
            provider_spec = spec | {
                "provider": name,
                "output_dir": str(output_dir),
                "result": str(Path(tmp) / f"{name}.json"),
            }
            try:
                figures = measure_provider(provider_spec, device, timeout=1800, attempts=attempts)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                skipped[name] = str(error)[:300]
                print(f"{name}: skipped ({skipped[name]})", flush=True)
                continue
            row = {"provider": name, "shape": description, "dtype": dtype} | figures
            row["mfu"] = (
                round(row["tokens_per_s"] * flops_per_token / device_peak, 4)
                if device_peak and row["tokens_per_s"]
                else None
            )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    if "interrupted" not in skipped:
        # The ceiling again, after the runs: the higher of the two is the least disturbed by other processes.
        tflops = max(tflops, matmul_ceiling(device, dtype, quiet=attempts > 1))
    for row in rows:
        row["floor_ms"] = round(flops_per_token * row["tokens_per_step"] / (tflops * 1e12) * 1e3, 2)
        row["fwd_bwd_over_floor"] = round(row["step_ms"] / row["floor_ms"], 3)  # the report's "× floor"
    if smoke and out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="bench_sft_smoke_"))
    return common.record(
        suite="e2e", kernel=KERNEL, preset=preset_name + ("-smoke" if smoke else ""),
        floor=(
            "6·P + 12·L·d·S FLOPs per non-pad token (S = max_length) times the step's tokens. A row is one "
            "optimizer step: step = its wall time (forwards, backwards, clipping, AdamW, data), fwd = the "
            "model's forwards (loss included) of its micro-batches, × floor = step over floor, peak extra = "
            "its workspace above weights, gradients and optimizer states, peak RSS / CUDA = the process's "
            "peak up to the end of training; other_cpu_load = the CPU share other processes took while it "
            "was timed. Floor at the measured matmul ceiling"
        ),
        ceiling={"matmul_tflops": round(tflops, 3), "flops_per_token": flops_per_token},
        device=device, rows=rows, skipped=skipped, out_dir=out_dir or common.RESULTS_DIR,
        spread=common.SPREAD,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--providers", nargs="*", help="subset of providers (default: the preset's)")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--smoke", action="store_true",
        help="the preset's providers and options on a tiny shape for a few steps (results to a temp dir)",
    )  # fmt: skip
    parser.add_argument(
        "--attempts", type=int, default=3,
        help="CPU: runs of a provider that other processes slowed down before the least disturbed is kept",
    )  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    run(args.preset, args.providers, args.out, args.smoke, args.attempts)


if __name__ == "__main__":
    main()
