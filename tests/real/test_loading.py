"""Every way fastalign loads a checkpoint gives the model ``from_pretrained`` gives, on the real
SmolLM2-135M-Instruct (tied embeddings) and on untied checkpoints: the weights, the tie itself (one
Parameter, not two equal ones) and the logits on real text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.quant import FourBitLinear, QuantOptions, load_4bit_model, quantize_model
from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.policy import load_frozen_model, prepare_policy
from tests.torchrun import run_two_processes

pytestmark = pytest.mark.real

CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TEXT = "The capital of France is Paris. The capital of Japan is Tokyo."


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_tied(model: torch.nn.Module) -> bool:
    base = base_of(model)
    return base.get_output_embeddings().weight is base.get_input_embeddings().weight


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Base weights by checkpoint name (no peft prefixes, no adapters)."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): param.detach()
        for name, param in model.named_parameters(remove_duplicate=False)
        if "lora_" not in name
    }


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = checkpoint_weights(model), checkpoint_weights(reference)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return base_of(model)(ids).logits


@pytest.fixture(scope="module")
def reference(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32), AutoTokenizer.from_pretrained(
        smollm2
    )


@pytest.fixture(scope="module")
def quantized_reference(smollm2):
    """The ``from_pretrained`` model quantized whole (NF4), which every 4-bit load must equal: quantized
    once for the module (read only by the tests)."""
    return quantize_model(AutoModelForCausalLM.from_pretrained(smollm2), QuantOptions())


def test_the_fixture_is_the_real_instruct_model(reference):
    model, tokenizer = reference
    assert model.config.tie_word_embeddings and is_tied(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris"), answer


def test_meta_skeleton_filled_from_the_checkpoint_equals_from_pretrained(smollm2, reference):
    """The training loader: a meta skeleton, filled tensor by tensor (a tied head once was left zero)."""
    model, tokenizer = load_model_and_tokenizer(str(smollm2), materialize=False)
    model = prepare_policy(model, TrainConfig(model_name_or_path=str(smollm2)), CPU, needs_fused_head=False)
    assert is_tied(model)
    assert_same_weights(model, reference[0])
    torch.testing.assert_close(logits(model, tokenizer), logits(*reference), rtol=0, atol=0)


@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_lora_and_qlora_policies_start_from_the_checkpoint(smollm2, reference, quantization, request):
    config = TrainConfig(model_name_or_path=str(smollm2), use_peft=True, lora_r=4, quantization=quantization)
    model, tokenizer = load_model_and_tokenizer(
        str(smollm2), QuantOptions() if quantization else None, materialize=False
    )
    model = prepare_policy(model, config, CPU, needs_fused_head=True)
    assert is_tied(model)
    if quantization is None:
        assert_same_weights(model, reference[0])
        torch.testing.assert_close(logits(model, tokenizer), logits(*reference), rtol=0, atol=0)
    else:  # the same bytes as quantizing the from_pretrained model
        quantized = request.getfixturevalue("quantized_reference")
        assert_same_weights(model, quantized)
        packed = [m for m in model.modules() if isinstance(m, FourBitLinear)]
        assert len(packed) == 30 * 7


def test_4bit_layer_by_layer_load_equals_quantizing_from_pretrained(smollm2, quantized_reference):
    loaded = load_4bit_model(smollm2, QuantOptions())
    quantized = quantized_reference
    assert is_tied(loaded) and is_tied(quantized)
    assert_same_weights(loaded, quantized)


def test_a_separate_reference_model_equals_from_pretrained(smollm2, reference):
    frozen = load_frozen_model(str(smollm2), TrainConfig(model_name_or_path=str(smollm2)), CPU)
    assert is_tied(frozen) and not any(p.requires_grad for p in frozen.parameters())
    assert_same_weights(frozen, reference[0])


def test_an_untied_checkpoint_keeps_its_own_head(tmp_path):
    saved = tiny_model("llama", tie_word_embeddings=False)
    saved.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = load_model_and_tokenizer(str(tmp_path), materialize=False)
    model = prepare_policy(model, TrainConfig(model_name_or_path=str(tmp_path)), CPU, needs_fused_head=False)
    assert not is_tied(model)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert_same_weights(model, AutoModelForCausalLM.from_pretrained(tmp_path))


def test_two_process_fsdp2_load_and_export_keep_the_checkpoint_and_the_tie(smollm2, tmp_path, reference):
    """Under FSDP2 each rank fills only its shard of the skeleton; gathered, the weights are the
    checkpoint's, the head is the embedding (one sharded Parameter), and the export holds it once."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    run_two_processes(Path(__file__).with_name("fsdp_load_worker.py"), smollm2, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {
        "tied": True,
        "sharded": True,
        "local_rows": 49152 // 2,
        "keys_match": True,
        "mismatched": [],
    }

    export = tmp_path / "export"
    with safe_open(str(export / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" not in saved.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    assert is_tied(reloaded)
    torch.testing.assert_close(logits(reloaded, reference[1]), logits(*reference), rtol=0, atol=0)
