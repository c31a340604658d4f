"""QLoRA end to end on a tiny model: 4-bit base layers, LoRA training, adapter round trip, merged export,
FSDP2 sharding that keeps the weights 4-bit, layer-by-layer loading, and errors that name the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_config, tiny_model, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.quant import (
    FourBitLinear,
    QuantOptions,
    load_4bit_model,
    quantize_model,
    random_4bit_model,
)
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.engine import Callback
from fastalign.train.run import run_training
from tests.conftest import DEVICE
from tests.helpers import require
from tests.torchrun import run_two_processes

require("bitsandbytes")  # quantizes every model here

REPO_ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **overrides) -> TrainConfig:
    options = dict(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        logging_steps=1,
        seed=0,
        max_length=64,
        loss_curve_png=False,
        use_peft=True,
        lora_r=8,
        quantization="nf4",
        lora_dropout=0.0,
        packing=True,
    )
    return TrainConfig(**{**options, **overrides})


def logged(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def batch(device: torch.device | str = "cpu") -> dict:
    tokenizer = tiny_tokenizer()
    texts = ["What is 3 plus 4? The answer is 7.", "user assistant"]
    return {
        key: value.to(device) for key, value in tokenizer(texts, padding=True, return_tensors="pt").items()
    }


class _TrainedLogits(Callback):
    """Keeps the trained model's logits on ``batch()`` (eval mode, on the device it trained on: the GPU
    where there is one), to compare a reloaded adapter with."""

    def on_train_end(self, engine):
        engine.model.eval()
        with torch.no_grad():
            self.logits = engine.model(**batch(engine.ctx.device)).logits


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """One QLoRA SFT run shared by the tests that inspect its output, and its final logits."""
    out = tmp_path_factory.mktemp("qlora")
    trained = _TrainedLogits()
    run_training(config(out), "sft", callbacks=[trained])
    return out, trained.logits


def test_quantized_layers_are_4bit_and_close_to_the_dense_ones():
    dense = tiny_model("llama")
    quantized = quantize_model(tiny_model("llama"), QuantOptions())
    layers = [m for m in quantized.modules() if isinstance(m, FourBitLinear)]
    assert len(layers) == 2 * 7  # 2 decoder layers × (q, k, v, o, gate, up, down)
    assert all(layer.weight.dtype == torch.uint8 for layer in layers)
    assert (
        sum(layer.weight.numel() for layer in layers) * 8
        == sum(layer.in_features * layer.out_features for layer in layers) * 4
    )  # 4 bits a weight
    with torch.no_grad():
        a, b = dense(**batch()).logits, quantized(**batch()).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


@pytest.mark.slow
def test_qlora_training_learns_only_the_adapters_on_a_4bit_base(trained_run):
    trained_run, _ = trained_run
    losses = [row["loss"] for row in logged(trained_run)]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # a random base: LoRA alone gets ~5.2
    saved = load_file(trained_run / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # only the adapter is saved
    assert (trained_run / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_base_stays_4bit_and_frozen(tmp_path):
    """The 4-bit bytes are identical after training; only LoRA parameters had gradients."""
    from fastalign.train.loading import load_model_and_tokenizer

    before, _ = load_model_and_tokenizer("tiny-llama", QuantOptions(), DEVICE)  # where training runs
    packed_before = {n: m.weight.clone() for n, m in before.named_modules() if isinstance(m, FourBitLinear)}
    seen = {}

    class Inspect(Callback):
        def on_train_end(self, engine):
            for name, module in engine.model.named_modules():
                if isinstance(module, FourBitLinear):
                    seen[name.removeprefix("base_model.model.").replace(".base_layer", "")] = module.weight
            engine.trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
            seen["trainable"] = engine.trainable

    run_training(config(tmp_path, max_steps=2), "sft", callbacks=[Inspect()])
    assert all("lora_" in name for name in seen.pop("trainable"))
    assert set(seen) == set(packed_before)
    for name, packed in packed_before.items():
        assert seen[name].dtype == torch.uint8 and torch.equal(seen[name], packed), name


@pytest.mark.slow
def test_adapter_round_trip_and_merge_give_the_trained_outputs(trained_run, capsys):
    """The saved adapter on a freshly quantized base gives the trained model's outputs exactly (the
    quantization is deterministic); merged into bf16 weights, the same within bf16 rounding."""
    from fastalign.train.loading import load_model_and_tokenizer

    trained_run, trained_logits = trained_run
    base, _ = load_model_and_tokenizer("tiny-llama", QuantOptions(), DEVICE)  # where training ran
    model = peft.PeftModel.from_pretrained(fastalign.patch_model(base), trained_run).eval()
    fresh, _ = load_model_and_tokenizer("tiny-llama", QuantOptions(), DEVICE)
    with torch.no_grad():
        adapter_on = model(**batch(DEVICE)).logits
        without = fresh(**batch(DEVICE)).logits
    torch.testing.assert_close(adapter_on, trained_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapter_on, without, atol=1e-3)  # the adapter learned something

    # merged in fp32 and saved in the base's dtype (fp32 for a built-in model): the adapter's outputs
    assert main(["merge", str(trained_run)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(trained_run / "merged").to(DEVICE)
    assert merged.dtype == torch.float32
    assert not any(isinstance(m, FourBitLinear) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch(DEVICE)).logits, adapter_on, rtol=1e-4, atol=1e-4)

    assert (
        main(["merge", str(trained_run), "--dtype", "bfloat16", "--output_dir", str(trained_run / "bf16")])
        == 0
    )
    merged = AutoModelForCausalLM.from_pretrained(trained_run / "bf16")
    assert merged.dtype == torch.bfloat16
    with torch.no_grad():
        merged_logits = merged(**batch()).logits.float()
    relative = (merged_logits - adapter_on).norm() / adapter_on.norm()
    assert relative < 2e-2, relative  # bf16 weights and activations


#: torch 2.11's FSDP2 cannot shard integer (4-bit) weights; fastalign.train.distributed.shard_model refuses it
fsdp2_4bit = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="FSDP2 shards 4-bit weights from torch 2.13 (shard_model refuses it before)",
)


@pytest.mark.slow
@fsdp2_4bit
def test_two_process_fsdp2_keeps_the_weights_4bit(tmp_path):
    out = tmp_path / "memory.json"
    run_two_processes(Path(__file__).with_name("fsdp_qlora_worker.py"), out)
    record = json.loads(out.read_text())
    assert record["full_bytes"] * 8 == record["dense_bytes"]  # packed: 1/8 of fp32
    # sharded: each rank holds about half of the packed bytes (FSDP pads each shard by < 1 element)
    assert record["local_bytes"] <= record["full_bytes"] / 2 + 64
    assert record["full_bytes"] <= record["sum_local_bytes"] <= record["full_bytes"] + 2 * 64
    # unsharded inside the forward: still the packed uint8 bytes, never a dense or bf16-cast weight
    assert record["seen"] and all(dtype == "torch.uint8" and n == half for dtype, n, half in record["seen"])
    assert record["all_lora_grads"] and record["loss"] > 0


@pytest.fixture(scope="module")
def two_process_qlora_runs(tmp_path_factory) -> dict[str, TrainConfig]:
    """source → its run under torchrun × 2, both runs in one launch (starting the two processes costs
    more than the runs): from the built-in tiny model and from a saved checkpoint of the same weights."""
    root = tmp_path_factory.mktemp("two_process_qlora")
    checkpoint = root / "model"
    tiny_model("llama").save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    models = {"built-in": "tiny-llama", "checkpoint": str(checkpoint)}
    runs = {
        source: config(root / source, max_steps=3, per_device_train_batch_size=4, model_name_or_path=model)
        for source, model in models.items()
    }
    worker = REPO_ROOT / "tests" / "train" / "train_worker.py"
    run_two_processes(worker, json.dumps([["sft", asdict(run)] for run in runs.values()]))
    return runs


@pytest.mark.slow
@fsdp2_4bit
@pytest.mark.parametrize("source", ["built-in", "checkpoint"])
def test_two_process_qlora_matches_one_process(tmp_path, source, two_process_qlora_runs):
    """The same losses on 1 and 2 processes: from the built-in tiny model (quantized whole, then
    sharded) and from a saved checkpoint (a meta skeleton wrapped, sharded, then filled layer by
    layer: each rank quantizes every layer and keeps only its shard)."""
    two = two_process_qlora_runs[source]
    model = two.model_name_or_path
    assert (model == "tiny-llama") == (source == "built-in")
    single = config(tmp_path / "one", max_steps=3, model_name_or_path=model)
    run_training(single, "sft")
    for a, b in zip(logged(tmp_path / "one"), logged(two.output_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def _peak_rss_of(code: str) -> int:
    """Peak resident memory (bytes) that running ``code`` adds to a fresh interpreter, sampled every
    millisecond (ru_maxrss would hide it under the peak of the imports)."""
    script = (
        "import threading, time, psutil, torch, transformers, bitsandbytes, fastalign.quant\n"
        "from fastalign.bench.measure import release_freed_memory_promptly\n"
        "release_freed_memory_promptly()\n"  # freed temporaries go back to the system: RSS shows what is held
        "process = psutil.Process(); base = process.memory_info().rss; peak = [base]; done = []\n"
        "def sample():\n"
        "    while not done:\n"
        "        peak[0] = max(peak[0], process.memory_info().rss); time.sleep(0.001)\n"
        "thread = threading.Thread(target=sample); thread.start()\n"
        f"{code}\n"
        "done.append(1); thread.join(); print(max(peak[0], process.memory_info().rss) - base)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """A ~430 MB fp32 Llama-shaped checkpoint (32 layers of 13.6 MB) in 20 MB safetensors shards."""
    path = tmp_path_factory.mktemp("ckpt")
    config = tiny_config(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=32, vocab_size=512
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="20MB")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
def test_layer_by_layer_loading_keeps_host_memory_near_one_layer(sharded_checkpoint):
    """Holding the fp32 model (from_pretrained, then every weight touched: transformers maps the files
    lazily) costs ~350 MB; loading in 4 bits layer by layer holds the 4-bit model (~55 MB), one mapped
    shard (20 MB) and one layer's quantization temporaries (~110 MB measured): we require under 45% of
    the fp32 peak (a fixed overhead weighs more on a smaller model, hence this size)."""
    assert len(list(sharded_checkpoint.glob("*.safetensors"))) > 5
    path = str(sharded_checkpoint)
    touch = "s = sum(float(p.sum()) for p in m.parameters())"
    plain = _peak_rss_of(f"m = transformers.AutoModelForCausalLM.from_pretrained({path!r}); {touch}")
    low = _peak_rss_of(
        f"m = fastalign.quant.load_4bit_model({path!r}, fastalign.quant.QuantOptions()); {touch}"
    )
    assert plain > 250e6, plain
    assert low < 0.45 * plain, (low, plain)


@pytest.mark.slow
def test_loaded_4bit_model_equals_quantizing_the_loaded_model(sharded_checkpoint):
    loaded = load_4bit_model(sharded_checkpoint, QuantOptions())
    reference = quantize_model(AutoModelForCausalLM.from_pretrained(sharded_checkpoint), QuantOptions())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch()).logits, reference(**batch()).logits)


def test_random_4bit_model_of_a_published_shape_is_built_in_4bits():
    config = tiny_config("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3, vocab_size=512)
    model = random_4bit_model(config, QuantOptions())
    layers = [m for m in model.modules() if isinstance(m, FourBitLinear)]
    assert len(layers) == 3 * 7 and not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        logits = model(**batch()).logits
    assert torch.isfinite(logits).all()


def test_a_shard_missing_a_tensor_is_named(sharded_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in sharded_checkpoint.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(broken / shard)
    del tensors[name]
    save_file(tensors, broken / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"does not hold {name}"):
        load_4bit_model(broken, QuantOptions())


def test_a_corrupt_safetensors_file_is_named(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model.safetensors"):
        load_4bit_model(tmp_path, QuantOptions())


def test_quantization_without_lora_and_bad_lora_options_are_named():
    from fastalign.train.config import load_config

    with pytest.raises(ConfigError, match=r"'quantization'.*use_peft"):
        load_config(None, ["--quantization", "nf4"])
    with pytest.raises(ConfigError, match=r"'lora_r'.*positive"):
        load_config(None, ["--use_peft", "true", "--lora_r", "0"])
    with pytest.raises(ConfigError, match=r"'quantization'.*nf4, fp4"):
        load_config(None, ["--use_peft", "true", "--quantization", "int3"])


def test_unknown_target_modules_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"lora_target_modules.*no_such_proj"):
        run_training(config(tmp_path, max_steps=1, lora_target_modules=["no_such_proj"]), "sft")
