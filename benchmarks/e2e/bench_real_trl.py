"""End to end on a real model: ``fastalign train`` vs TRL 1.16's own trainers, for every objective.

    python benchmarks/e2e/bench_real_trl.py --preset cpu                  # the full table (hours on 2 cores)
    python benchmarks/e2e/bench_real_trl.py --preset cpu --objectives dpo dpo-lora --settings fp32
    python benchmarks/e2e/bench_real_trl.py --preset gpu                  # the same rows on one GPU
    python benchmarks/e2e/bench_real_trl.py --preset quick                # tiny rows, two steps: it works
    python benchmarks/e2e/bench_real_trl.py --preset cpu-grpo-g8          # GRPO at G = 8, 4 prompts a step

The model is SmolLM2-135M-Instruct (30 layers, 49k vocabulary, tied embeddings), the real-model fixture of
the tests (``tests/real/model.py``: built once into ``.cache/`` from the PyPI GGUF). Objectives: SFT, DPO
(full, and LoRA r 16 α 32 dropout 0.05 on all linear layers), KTO and GRPO; each with TRL's trainer
(``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``) and with ``fastalign train`` (its
``run_training``), each run in a fresh process so that its peak resident set is its own. Providers:
``trl``, ``fastalign`` and ``trl-fastalign`` (TRL's trainer with fastalign inside, as docs/trl.md tells
its users: the patched model, TRL's fused head served, and for GRPO its ``generate`` served by the rollout
engine, whose draws differ from ``generate``'s); ``trl-fastalign-head``, asked for by name, the same
without the served ``generate``: TRL's own completions, so its losses equal TRL alone's.

Both sides train on the same rows: one batch of ``batch`` rows, seen every step (so that both start from
the same batch whatever order each samples in: the first-step losses of identical math are identical),
cut from real English prose (the Python documentation's topics, ``pydoc_data``) at ``prompt_tokens`` +
``completion_tokens`` (DPO: a chosen and a rejected completion; KTO: every other row undesirable; GRPO:
the prompts, completions sampled at exactly ``completion_tokens``, ``min_new_tokens`` on both sides, and
one reward function, ``distinct_tokens``, given to both). The same batch size, learning rate, linear
schedule, AdamW (``adamw_torch_fused``, both tools' default), seed and steps; dropout as each objective's
default (off for DPO, KTO, GRPO, LoRA's included); no checkpoint saved (``save_strategy no``).

Settings (each a row per objective and tool):
``fp32``: fp32 weights and matmuls, gradient checkpointing off (TRL: ``bf16=False``);
``bf16``: bf16 autocast, checkpointing off; ``checkpointing``: fp32 with gradient checkpointing;
``defaults``: each tool as its user gets it (TRL 1.16: bf16 autocast and checkpointing on, also on
CPU; fastalign: fp32, checkpointing off).

A row: ``step_ms`` = median wall time of the steps after the first (forwards, backwards, optimizer,
data, generation for GRPO), ``step_spread`` its interquartile range over the median; ``tokens_per_s`` =
the step's tokens (the batch's prompt and completion tokens, DPO's chosen and rejected both, counted by
the tokenizer from the rows: the same for both tools) over the median step; ``peak_rss_mib`` = the
process's peak resident set, everything up to the end of training; the phases of that peak:
``load_peak_rss_mib`` (the peak before the first step: imports, model, reference, optimizer),
``begin_rss_mib`` (resident at the first step) and ``step1_rss_mib`` (after it: AdamW's moments exist);
``first_loss`` and ``final_loss`` as the tool logs them. A timed run waits for a quiet machine and is
run again, up to ``--attempts`` times, when other processes took more than 5% of the CPU meanwhile
(``other_cpu_load``: the share they took). On a GPU (``--preset gpu``, ten steps) the peak is
``peak_cuda_mib`` (``torch.cuda.max_memory_allocated``); the phases stay the host's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KERNEL = "e2e_real_trl"
OBJECTIVES = ("sft", "dpo", "dpo-lora", "kto", "grpo")
#: Setting → (its label in the report's dtype column, bf16, gradient_checkpointing); None: the tool's default.
SETTINGS = {
    "fp32": ("float32", False, False),
    "bf16": ("bf16 autocast", True, False),
    "checkpointing": ("float32", False, True),
    "defaults": ("each tool's default", None, None),
}
PROVIDERS = ("trl", "trl-fastalign", "fastalign", "trl-fastalign-head")
#: What runs when no provider is named (``trl-fastalign-head`` only differs from ``trl-fastalign`` in GRPO)
DEFAULT_PROVIDERS = PROVIDERS[:3]
LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}

PRESETS = {
    "cpu": {
        "objectives": list(OBJECTIVES), "settings": list(SETTINGS), "batch": 4, "prompt_tokens": 64,
        "completion_tokens": 184, "max_length": 256, "steps": 6, "learning_rate": 1e-5,
    },
    "gpu": {
        "objectives": list(OBJECTIVES), "settings": list(SETTINGS), "batch": 4, "prompt_tokens": 64,
        "completion_tokens": 184, "max_length": 256, "steps": 10, "learning_rate": 1e-5,
    },
    "quick": {
        "objectives": ["sft", "dpo"], "settings": ["fp32"], "batch": 2, "prompt_tokens": 16,
        "completion_tokens": 16, "max_length": 40, "steps": 2, "learning_rate": 1e-5,
    },
    # The GPU check's rows (``fastalign bench gpu``): random weights of the Llama-3.2-1B shape, its
    # 128,256-token vocabulary (the built-in byte-level tokenizer, padded to it), bf16 autocast.
    "gpu-1b": {
        "model": "llama-3.2-1b", "objectives": ["dpo", "grpo"], "settings": ["bf16"], "batch": 4,
        "prompt_tokens": 128, "completion_tokens": 128, "max_length": 256, "steps": 3, "learning_rate": 1e-5,
    },
    # Issue 37's GRPO goal: G = 8 completions of each of 4 prompts a step (32 rows), 64 tokens each.
    "cpu-grpo-g8": {
        "objectives": ["grpo"], "settings": ["fp32"], "batch": 32, "num_generations": 8,
        "prompt_tokens": 64, "completion_tokens": 64, "max_length": 128, "steps": 4, "learning_rate": 1e-5,
    },
    # The same on a tiny random model: the check's smoke run, on any device.
    "smoke-random": {
        "model": "tiny-llama", "objectives": ["dpo", "grpo"], "settings": ["fp32"], "batch": 2,
        "prompt_tokens": 16, "completion_tokens": 8, "max_length": 40, "steps": 2, "learning_rate": 1e-5,
    },
}  # fmt: skip


def distinct_tokens(prompts, completions, completion_ids, **columns) -> list[float]:
    """GRPO's reward on both sides: the share of a completion's tokens that are distinct (repetition
    scores low). Cheap and deterministic, so the reward takes no time from either tool's step."""
    return [len(set(ids)) / max(1, len(ids)) for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------
# The rows, built once by the parent process


def _corpus_ids(tokenizer) -> list[int]:
    """Real English prose: the Python documentation's topics (in the standard library), in key order."""
    from pydoc_data.topics import topics

    text = " ".join(re.sub(r"\s+", " ", topics[key]).strip() for key in sorted(topics))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _text(tokenizer, ids: list[int], limit: int) -> str:
    """The text of ``ids``, cut so that it tokenizes again to at most ``limit`` tokens."""
    while True:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= limit:
            return text
        ids = ids[:-1]


def make_rows(tokenizer, objective: str, count: int, prompt_tokens: int, completion_tokens: int) -> list:
    """``count`` rows of ``objective``'s format cut from the corpus at consecutive places: a prompt of
    ``prompt_tokens`` and completions of ``completion_tokens`` (GRPO: prompts only)."""
    ids = _corpus_ids(tokenizer)
    span = prompt_tokens + 2 * completion_tokens
    rows = []
    for i in range(count):
        start = 1000 + i * span  # past the first topics' headings
        prompt = _text(tokenizer, ids[start : start + prompt_tokens], prompt_tokens)
        first = ids[start + prompt_tokens : start + prompt_tokens + completion_tokens]
        second = ids[start + prompt_tokens + completion_tokens : start + span]
        if objective == "grpo":
            rows.append({"prompt": prompt})
            continue
        completion = _text(tokenizer, first, completion_tokens)
        if objective == "sft":
            rows.append({"prompt": prompt, "completion": completion})
        elif objective == "kto":
            rows.append({"prompt": prompt, "completion": completion, "label": i % 2 == 0})
        else:  # dpo, dpo-lora: the passage's continuation chosen, the one after it rejected
            rows.append({"prompt": prompt, "chosen": completion,
                         "rejected": _text(tokenizer, second, completion_tokens)})  # fmt: skip
    return rows


def step_tokens(tokenizer, objective: str, rows: list[dict], completion_tokens: int) -> int:
    """The tokens of one step (every row once): prompt + completion + EOS of each trained sequence."""

    def length(prompt: str, completion: str) -> int:
        return len(tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]) + 1

    if objective == "grpo":
        return (
            sum(len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows)
            + len(rows) * completion_tokens
        )
    if objective in ("dpo", "dpo-lora"):
        return sum(length(r["prompt"], r["chosen"]) + length(r["prompt"], r["rejected"]) for r in rows)
    return sum(length(r["prompt"], r["completion"]) for r in rows)


# ---------------------------------------------------------------------------------------------------
# Inside a worker process: one tool, one objective, one setting


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return round(kib / 1024, 1)


class Phases:
    """The run's host memory at its phases and its step clock (``bench_sft_trl.StepClock``: one warm-up
    step; its peak is the process's resident set on CPU, ``max_memory_allocated`` on CUDA)."""

    def __init__(self, tokens_per_step: int):
        from benchmarks.e2e.bench_sft_trl import StepClock

        self.started = time.perf_counter()
        self.clock = StepClock(1, _device())
        self.tokens_per_step = tokens_per_step
        self.figures: dict = {}
        self.generation: list[float] = []  # GRPO: seconds of generation, per step

    def train_begin(self) -> None:
        self.figures |= {
            "setup_s": round(time.perf_counter() - self.started, 1),
            "load_peak_rss_mib": _status_mib("VmHWM"),
            "begin_rss_mib": _status_mib("VmRSS"),
        }

    def step_end(self, loss: float) -> None:
        if not self.clock.ends:  # before the clock's window resets the peak
            self.figures["step1_rss_mib"] = _status_mib("VmRSS")
        self.clock.step_end(self.tokens_per_step, loss)

    def result(self, losses: list[float]) -> dict:
        self.clock.train_end()
        self.clock.losses = losses or self.clock.losses
        figures = self.clock.figures()
        if self.generation:  # GRPO: generation and the rest of the step apart (steps after the first)
            generation_ms = statistics.median(self.generation[1:] or self.generation) * 1e3
            figures["generation_ms"] = round(generation_ms, 1)
            figures["training_ms"] = round(figures["step_ms"] - generation_ms, 1)
        keep = ("step_ms", "step_spread", "generation_ms", "training_ms", "tokens_per_s",
                "tokens_per_step", "peak_rss_mib", "peak_cuda_mib", "first_loss", "final_loss", "losses",
                "other_cpu_load")  # fmt: skip
        return {key: figures[key] for key in keep if key in figures} | self.figures


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shared_options(spec: dict) -> dict:
    """The options both tools take under the same (TRL's) names: the run's length, batch, learning rate,
    seed, logging every step, no checkpoint saved, the setting's bf16 and gradient checkpointing (none
    for each tool's defaults), and the objective's lengths."""
    _, bf16, checkpointing = SETTINGS[spec["setting"]]
    options = dict(
        max_steps=spec["steps"], per_device_train_batch_size=spec["batch"],
        learning_rate=spec["learning_rate"], seed=spec["seed"], logging_steps=1, save_strategy="no",
    )  # fmt: skip
    if bf16 is not None:
        options |= {"bf16": bf16, "gradient_checkpointing": checkpointing}
    if spec["objective"] == "grpo":  # every completion exactly completion_tokens long
        return options | dict(
            num_generations=spec.get("num_generations", spec["batch"]),
            max_completion_length=spec["completion_tokens"],
            generation_kwargs={"min_new_tokens": spec["completion_tokens"]},
        )  # fmt: skip
    return options | {"max_length": spec["max_length"]}


def run_fastalign(spec: dict, phases: Phases) -> dict:
    from fastalign.train.config import TrainConfig
    from fastalign.train.engine import Callback
    from fastalign.train.run import run_training

    losses = []

    class Record(Callback):
        def on_train_begin(self, engine) -> None:
            phases.train_begin()

        def on_step_end(self, engine, metrics: dict) -> None:
            losses.append(metrics["loss"])
            if "timing/generation_seconds" in metrics:
                phases.generation.append(metrics["timing/generation_seconds"])
            phases.step_end(metrics["loss"])

    objective, options = spec["objective"], shared_options(spec)
    if objective == "dpo-lora":
        options |= dict(
            use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
            lora_target_modules=[LORA["target_modules"]],
        )  # fmt: skip
    if objective == "grpo":
        options["reward_funcs"] = [f"benchmarks.e2e.bench_real_trl:{distinct_tokens.__name__}"]
    config = TrainConfig(
        model_name_or_path=spec["model_dir"], dataset_name=spec["data"], output_dir=spec["output_dir"],
        overwrite_output_dir=True, loss_curve_png=False, report_to=[], **options,
    )  # fmt: skip
    run_training(config, "dpo" if objective == "dpo-lora" else objective, callbacks=[Record()])
    return phases.result(losses)


def run_trl(spec: dict, phases: Phases) -> dict:
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            phases.train_begin()

        def on_step_end(self, args, state, control, **kwargs):
            phases.step_end(math.nan)  # TRL logs the step's loss after this

    objective = spec["objective"]
    name = {"sft": "SFT", "dpo": "DPO", "dpo-lora": "DPO", "kto": "KTO", "grpo": "GRPO"}[objective]
    extra = {"reward_funcs": [distinct_tokens]} if objective == "grpo" else {}
    if objective == "dpo-lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
            target_modules=LORA["target_modules"], task_type="CAUSAL_LM",
        )  # fmt: skip
    args = getattr(trl, f"{name}Config")(
        output_dir=spec["output_dir"], report_to="none", use_cpu=_device().type == "cpu", disable_tqdm=True,
        dataloader_num_workers=0, **shared_options(spec),
    )  # fmt: skip
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    model = spec["model_dir"]
    if spec["provider"].startswith("trl-fastalign"):
        model = _fastalign_in_trl(model, serve_sampling=spec["provider"] == "trl-fastalign")
    trainer = getattr(trl, f"{name}Trainer")(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]), callbacks=[Record()], **extra,
    )  # fmt: skip
    if objective == "grpo":
        _time_generation(trainer.model, phases.generation)
    trainer.train()
    return phases.result([row["loss"] for row in trainer.state.log_history if "loss" in row])


def _fastalign_in_trl(model_dir: str, serve_sampling: bool = True):
    """TRL's trainer with fastalign dropped in, as docs/trl.md tells its users: the model loaded as TRL
    loads it (fp32 here), ``fastalign.patch_model`` (on CPU the pieces that lose there stay the model's
    own), TRL's fused LM head served by ``fastalign.integrations.trl.enable()``, and, ``serve_sampling``,
    its ``generate`` (GRPO's sampling) by the rollout engine (``fastalign.integrations.generate``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastalign.integrations import trl as fastalign_trl
    from fastalign.integrations.generate import serve_generate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fastalign_trl.patch_model(model)
    if serve_sampling:
        serve_generate(model)
    if not fastalign_trl.enable():
        raise RuntimeError("fastalign does not serve this TRL's fused head")
    return model


def _time_generation(model, seconds: list[float]) -> None:
    """Time each ``generate`` call of ``model`` (TRL's GRPO generates through the model instance's own
    ``generate``; on CUDA each call is synchronized at both ends)."""
    import torch

    generate = model.generate

    def timed(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)

    model.generate = timed


def worker(spec: dict) -> None:
    phases = Phases(spec["tokens_per_step"])
    figures = (run_fastalign if spec["provider"] == "fastalign" else run_trl)(spec, phases)
    Path(spec["result"]).write_text(json.dumps(figures))


# ---------------------------------------------------------------------------------------------------
# The parent process


def measure(spec: dict, attempts: int, timeout: float) -> dict:
    """The least disturbed of up to ``attempts`` runs (each after waiting for a quiet machine)."""
    from benchmarks import common
    from benchmarks.e2e.bench_sft_trl import CONTENDED, wait_for_quiet_machine

    best, attempt = None, 0
    while attempt < attempts:
        attempt += 1
        if attempts > 1:
            wait_for_quiet_machine()
        run = common.run_worker(__file__, spec, timeout, cwd=ROOT)
        if best is None or (run["other_cpu_load"] or 0.0) < (best["other_cpu_load"] or 0.0):
            best = run
        if (best["other_cpu_load"] or 0.0) <= CONTENDED:
            break
    return best | {"timed_runs": attempt}


def _shape(preset: dict, setting: str) -> str:
    tokens = f"batch {preset['batch']}, {preset['prompt_tokens']}+{preset['completion_tokens']} tokens"
    if "num_generations" in preset:
        tokens += f", GRPO: {preset['num_generations']} completions of each prompt"
    if setting == "defaults":
        how = "each tool's defaults (TRL: bf16 autocast + checkpointing; fastalign: fp32, no checkpointing)"
    else:
        how = f"checkpointing {'on' if SETTINGS[setting][2] else 'off'}"
    model = f"{preset['model']} (random weights)" if "model" in preset else "SmolLM2-135M-Instruct"
    return f"{model}, {tokens}, {how}"


def measure_row(spec: dict, preset: dict, attempts: int, timeout: float) -> dict:
    """One report row: what was run and the least disturbed run's figures."""
    label, bf16, checkpointing = SETTINGS[spec["setting"]]
    row = {
        "provider": spec["provider"], "objective": spec["objective"],
        "shape": _shape(preset, spec["setting"]), "dtype": label, "setting": spec["setting"],
    }  # fmt: skip
    if bf16 is not None:
        row |= {"bf16": bf16, "gradient_checkpointing": checkpointing}
    return row | measure(spec, attempts, timeout)


def random_model_dir(shape: str, directory: Path) -> Path:
    """A model directory of random weights of a built-in shape (``fastalign.plan.shapes``), saved (bf16 on
    a GPU) with the built-in byte-level tokenizer padded to the shape's vocabulary (the same weights for
    every tool)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastalign.builtin.tokenizer import tiny_tokenizer
    from fastalign.plan.shapes import builtin_config

    config = builtin_config(shape)
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if device.type == "cuda":  # half the bytes each process reads: every tool loads them as fp32 alike
        model = model.to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer = tiny_tokenizer(config.vocab_size)
    tokenizer.save_pretrained(directory)
    return directory


def _shared(preset: dict, tokenizer, objective: str, model_dir: str, tmp: Path) -> dict:
    """An objective's run options every provider shares, its rows written to ``tmp``."""
    data = make_rows(
        tokenizer, objective, preset["batch"], preset["prompt_tokens"], preset["completion_tokens"]
    )
    path = tmp / f"{objective}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in data))
    # num_generations where the preset sets it; shared_options defaults it to the batch
    keys = ("batch", "steps", "learning_rate", "max_length", "num_generations")
    shared = {key: preset[key] for key in keys if key in preset}
    return shared | {
        "objective": objective, "model_dir": model_dir, "data": str(path), "seed": 0,
        "completion_tokens": preset["completion_tokens"],
        "tokens_per_step": step_tokens(tokenizer, objective, data, preset["completion_tokens"]),
    }  # fmt: skip


def _runs(objectives: list[str], settings: list[str], providers: list[str]) -> list[tuple[str, str, str]]:
    """(objective, setting, provider) in the order they run: every objective's TRL and ``fastalign train``
    pair first, then TRL with fastalign inside, so that a run stopped early (the GPU check's cap) has
    whole pairs."""
    runs = list(itertools.product(objectives, settings, providers))
    return sorted(runs, key=lambda run: run[2].startswith("trl-fastalign"))


def run(preset_name: str, args: argparse.Namespace) -> Path:
    from transformers import AutoTokenizer

    from benchmarks import common
    from tests.real.model import smollm2_dir

    preset = PRESETS[preset_name] | ({"steps": args.steps} if args.steps else {})
    providers = common.select_providers(KERNEL, PROVIDERS, args.providers, DEFAULT_PROVIDERS)
    device = _device()
    if preset_name.startswith("gpu") and device.type != "cuda":
        raise SystemExit("--preset gpu needs CUDA")
    # Waiting for a quiet machine and timing again is for the CPU table's rows only (``cpu``)
    attempts = args.attempts if preset_name == "cpu" and device.type == "cpu" else 1
    if "model" in preset:
        start = time.perf_counter()
        model_dir = str(random_model_dir(preset["model"], Path(tempfile.mkdtemp(prefix="bench_model_"))))
        print(f"saved random {preset['model']} in {time.perf_counter() - start:.1f} s", flush=True)
    else:
        model_dir = str(smollm2_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench_real_trl_") as tmp_dir,
        common.keep_rows_on_termination(skipped),
    ):
        tmp = Path(tmp_dir)
        objectives = args.objectives or preset["objectives"]
        shared_of = {
            objective: _shared(preset, tokenizer, objective, model_dir, tmp) for objective in objectives
        }
        for objective, setting, provider in _runs(objectives, args.settings or preset["settings"], providers):
            name = f"{provider}-{objective}-{setting}"
            spec = shared_of[objective] | {
                "provider": provider, "setting": setting,
                "output_dir": str(tmp / name), "result": str(tmp / f"{name}.json"),
            }  # fmt: skip
            print(f"{name}: running", flush=True)  # a capped run's last line says where it stopped
            try:
                rows.append(measure_row(spec, preset, attempts, args.timeout))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                skipped[name] = str(error)[:300]
                print(f"{name}: skipped ({skipped[name]})", flush=True)
                continue
            shown = {key: value for key, value in rows[-1].items() if key not in ("losses", "shape")}
            print(json.dumps(shown), flush=True)
    return common.record(
        suite="e2e", kernel=KERNEL, preset=preset_name,
        floor=(
            "none: a whole training step of a real model (SmolLM2-135M-Instruct), TRL 1.16's trainer and "
            "`fastalign train` on the same rows, batch, learning rate, seed and steps, each in a fresh "
            "process. step = the median wall time of the steps after the first; tokens/s = the step's "
            "prompt and completion tokens over it; peak RSS = the process's peak resident set up to the "
            "end of training (load peak: before the first step); first and final loss as each tool logs "
            f"them. LoRA: r {LORA['r']}, alpha {LORA['alpha']}, dropout {LORA['dropout']}, all linear "
            "layers. GRPO: completions of exactly the completion length, reward distinct_tokens, no reference"
        ),
        ceiling={}, device=device, rows=rows, skipped=skipped,
        out_dir=args.out or common.RESULTS_DIR, spread=common.SPREAD,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--providers", nargs="*", help=f"subset of {', '.join(PROVIDERS)}")
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, help="default: the preset's")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="default: the preset's")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the preset's)")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--attempts", type=int, default=3,
        help="runs of a tool that other processes slowed down before the least disturbed is kept",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    run(args.preset, args)


if __name__ == "__main__":
    main()
