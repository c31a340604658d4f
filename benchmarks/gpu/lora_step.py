"""One process of the GPU check's LoRA phases: LoRA (bf16 base) or QLoRA (NF4 base) training steps of a
published shape with random weights, one provider, several settings in turn on the same loaded model.

    python benchmarks/gpu/lora_step.py '{"shape": "llama-3-8b", "provider": "fastalign", ...}'

Providers, each the way its user writes it: ``peft`` (transformers + peft, sdpa), ``liger`` (the same
after Liger-Kernel's ``apply_liger_kernel_to_llama``), ``fastalign`` (the same after
``fastalign.patch_model``), and TRL's ``SFTTrainer`` alone (``trl``), with ``use_liger_kernel``
(``trl-liger``) and on a model patched by fastalign (``trl-fastalign``). Every provider builds the same
weights (one seed, built on the device) and trains on the same random tokens, so first losses agree.

A setting is (tokens, checkpointing, offloading, keep_on_device: the last layers whose saved tensors stay
on the GPU); ``"tiled_mlp": true`` in the spec runs fastalign's MLPs in token tiles. The rows of one
process share the loaded model, each starting from fresh peak statistics (and from the adapters the rows
before it trained: a later row's first loss is compared with the same row of another provider, not with
the first row). A row: the median step time of the steps after the first, tokens/s, model TFLOP/s and MFU
against the device's matmul ceiling measured by the check (model FLOPs: 4·P·T for the frozen base's
matmuls, forward and input gradients, plus 6·P_lora·T and causal attention 6·L·S²·width, recomputation
not counted), peak GPU memory of the whole process so far and of the step, the host's peak resident set,
the first loss, and the planner's prediction of the same run.

A host-memory watchdog ends the process with a note when its resident set passes
``host_limit_fraction`` of the machine's memory, so a run that pins too much host memory loses its own
row, not the machine.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the process's imports, CUDA's start and the model's build are timed apart

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}
#: spec "tiled_mlp": patch_model's tiled MLP at TrainConfig's default tile (tiled_mlp_budget_mib)
TILE_MIB = 256
GiB = 2**30


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def start_host_watchdog(fraction: float, out: Path) -> None:
    """End the process (after writing a note to ``out``) when its resident set passes ``fraction`` of the
    machine's memory: the kernel's OOM killer would otherwise take it, or a neighbour, with no word."""
    limit = fraction * _mem_total()

    def watch() -> None:
        while True:
            rss = _status_bytes("VmRSS")
            if rss > limit:
                note = {"killed": f"host resident set {rss / GiB:.1f} GiB passed {limit / GiB:.1f} GiB"}
                with open(out, "a") as f:
                    f.write(json.dumps(note) + "\n")
                print(note["killed"], file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def build_config(shape: str, seq: int):
    from fastalign.plan.shapes import builtin_config

    config = builtin_config(shape)
    config.max_position_embeddings = max(seq, getattr(config, "max_position_embeddings", 0) or 0)
    config.use_cache = False
    return config


def build_model(spec: dict, device: torch.device, timings: dict):
    """The provider's model: random weights of ``spec['shape']`` (one seed for every provider), bf16 or
    NF4 base, LoRA on every linear layer, the provider's kernels. ``timings`` gets the seconds of the
    libraries' imports and CUDA's start (``start_s``), the base's build (``build_s``) and the adapters and
    patches (``adapt_s``): each provider's process pays them, so the check's phases are sized by them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = build_config(spec["shape"], max(spec["settings"], key=lambda s: s["tokens"])["tokens"])
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.init()
    clock = time.perf_counter()
    timings["start_s"] = round(clock - STARTED, 1)
    if spec.get("quant"):
        from fastalign.quant import QuantOptions, random_4bit_model

        options = QuantOptions(quant_type=spec["quant"], double_quant=True, dtype=torch.bfloat16)
        model = random_4bit_model(config, options, device=device, seed=0)
    else:
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    _synchronize(device)
    timings["build_s"] = round(time.perf_counter() - clock, 1)
    clock = time.perf_counter()
    provider = spec["provider"]
    if provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    if not provider.startswith("trl"):  # TRL adds the adapters (and Liger's patch) itself
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    if provider == "fastalign":
        import fastalign

        tiled = bool(spec.get("tiled_mlp"))
        fastalign.patch_model(model, tiled_mlp=tiled, tiled_mlp_budget_mib=TILE_MIB if tiled else None)
    timings["adapt_s"] = round(time.perf_counter() - clock, 1)
    return model, config


def model_flops(model, config, tokens: int) -> float:
    """Forward and backward FLOPs a step needs (no recomputation): the frozen matmuls' forward and input
    gradients (4·P·T), the adapters' forward, input and weight gradients (6·P_lora·T), and causal
    attention (6·L·S²·width: QKᵀ and PV, forward and backward, half of the square)."""
    frozen = trainable = 0
    for module in model.modules():  # the leaf linear layers: frozen base (dense or 4-bit), adapters, head
        if isinstance(module, torch.nn.Linear) and not list(module.children()):
            count = module.in_features * module.out_features
            if module.weight is not None and module.weight.requires_grad:
                trainable += count
            else:
                frozen += count
    width = config.num_attention_heads * getattr(
        config, "head_dim", config.hidden_size // config.num_attention_heads
    )
    attention = 6 * config.num_hidden_layers * tokens * tokens * width
    return 4 * frozen * tokens + 6 * trainable * tokens + attention


def planner_row(spec: dict, setting: dict) -> dict:
    from fastalign.plan import plan_memory

    plan = plan_memory(
        spec["shape"], method="qlora" if spec.get("quant") else "lora", base_dtype="bf16",
        seq_len=setting["tokens"],
        checkpointing=setting["checkpointing"], offload_activations=setting.get("offloading", False),
        lora_r=LORA["r"], lora_dropout=LORA["lora_dropout"], gpu_memory_bytes=80 * GiB, suggest=False,
        keep_on_device=setting.get("keep_on_device", 0),  # as train_steps offloads
        tiled_mlp_mib=TILE_MIB if spec.get("tiled_mlp") else 0,
    )  # fmt: skip
    return {  # the peak measured is max_memory_allocated: without the CUDA context the plan counts
        "planned_gib": round((plan.total_per_gpu - plan.cuda_context) / GiB, 2),
        "planned_host_gib": round(plan.host_total / GiB, 2),
    }


def _set_checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    """Reset the device's peak statistics; the bytes allocated now (0 on CPU, where only the host's
    resident set is measured)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gib(device: torch.device, before: int = 0) -> float | None:
    return (
        round((torch.cuda.max_memory_allocated(device) - before) / GiB, 2) if device.type == "cuda" else None
    )


def train_steps(model, setting: dict, steps: int, device: torch.device, vocab: int) -> dict:
    """``steps`` AdamW steps on one random batch; the figures of the steps after the first."""
    from fastalign.train import memory

    _set_checkpointing(model, setting["checkpointing"])
    offloader = None
    if setting.get("offloading"):
        offloader = memory.enable_activation_offloading(
            model, keep_on_device=setting.get("keep_on_device", 0)
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, vocab, (1, setting["tokens"]), device=device, generator=generator)
    before = _reset_peak(device)
    times, losses = [], []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # synchronizes
            times.append(time.perf_counter() - start)
    finally:
        if offloader is not None:
            offloader.remove()
    step_s = statistics.median(times[1:] or times)
    row = {
        "step_s": round(step_s, 3), "first_step_s": round(times[0], 3), "steps": steps,
        "tokens_per_s": round(setting["tokens"] / step_s, 1), "first_loss": round(losses[0], 4),
        "peak_gib": _peak_gib(device), "step_extra_gib": _peak_gib(device, before),
        "host_peak_gib": round(_status_bytes("VmHWM") / GiB, 2),
    }  # fmt: skip
    if offloader is not None:
        row["offloaded_gib"] = round(offloader.offloaded_bytes / GiB / steps, 2)
    del optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def trl_steps(model, config, spec: dict, setting: dict, device: torch.device) -> dict:
    """The same steps through TRL's ``SFTTrainer`` (pre-tokenized rows, LoRA by ``peft_config``)."""
    import datasets
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback

    if spec["provider"] == "trl-fastalign":  # the kernels in the model, and TRL's fused head served
        import fastalign
        from fastalign.integrations import trl as fastalign_trl

        fastalign.patch_model(model)
        if not fastalign_trl.enable():
            raise RuntimeError(f"fastalign does not serve TRL {trl.__version__}'s fused head")
    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _synchronize(device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _synchronize(device)
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (setting["tokens"],), generator=generator).tolist()
    rows = datasets.Dataset.from_list([{"input_ids": ids}] * spec["steps"])
    args = trl.SFTConfig(
        output_dir=str(Path(spec["scratch"]) / spec["provider"]), max_steps=spec["steps"], learning_rate=1e-5,
        per_device_train_batch_size=1, bf16=True, use_cpu=device.type == "cpu",
        gradient_checkpointing=setting["checkpointing"],
        max_length=setting["tokens"], use_liger_kernel=spec["provider"] == "trl-liger", report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, packing=False,
    )  # fmt: skip
    _reset_peak(device)
    from fastalign.builtin.tokenizer import tiny_tokenizer

    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=rows, peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
        processing_class=tiny_tokenizer(), callbacks=[Clock()],  # the rows come tokenized: only its pad id
    )  # fmt: skip
    trainer.train()
    step_s = statistics.median(times[1:] or times)
    return {
        "step_s": round(step_s, 3), "first_step_s": round(times[0], 3), "steps": spec["steps"],
        "tokens_per_s": round(setting["tokens"] / step_s, 1),
        "first_loss": round(losses[0], 4) if losses else None,
        "peak_gib": _peak_gib(device), "host_peak_gib": round(_status_bytes("VmHWM") / GiB, 2),
    }  # fmt: skip


def main(spec: dict) -> None:
    out = Path(spec["out"])
    start_host_watchdog(spec.get("host_limit_fraction", 0.8), out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = time.perf_counter()
    load: dict = {}
    model, config = build_model(spec, device, load)
    load["load_s"] = round(time.perf_counter() - loaded, 1)
    if device.type == "cuda":
        load["loaded_gib"] = round(torch.cuda.memory_allocated(device) / GiB, 2)
    print(json.dumps(load), flush=True)
    for setting in spec["settings"]:
        row = {
            "shape": spec["shape"],
            "provider": spec["provider"],
            "quant": spec.get("quant"),
            **setting,
            **load,
        }
        row |= planner_row(spec, setting)
        try:
            if spec["provider"].startswith("trl"):
                row |= trl_steps(model, config, spec, setting, device)
            else:
                row |= train_steps(model, setting, spec["steps"], device, config.vocab_size)
            flops = model_flops(model, config, setting["tokens"])
            row["model_tflops"] = round(flops / row["step_s"] / 1e12, 1)
            if spec.get("ceiling_tflops"):
                row["mfu"] = round(row["model_tflops"] / spec["ceiling_tflops"], 3)
        except torch.OutOfMemoryError as error:
            row["error"] = f"out of memory: {str(error).splitlines()[0][:160]}"
            torch.cuda.empty_cache()
        except Exception as error:  # a provider's own failure is its row lost, not the phase
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        if spec["provider"].startswith("trl"):
            break  # the trainer wrapped the model: one setting per process


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
