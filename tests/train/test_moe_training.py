"""The trainer's loader and export on mixture-of-experts checkpoints (``tests/patching/test_moe.py``'s
random Mixtral and Qwen3-MoE, from their published configs). On disk, as on the Hub and as
``save_pretrained`` writes them, the experts are one tensor each (Mixtral: ``block_sparse_moe.experts.N.
w1/w2/w3``; Qwen: ``mlp.experts.N.gate_proj/up_proj/down_proj``), where transformers 5 holds each layer's
as two 3-D parameters: the streaming loader converts them with transformers' own conversion mapping, as
``from_pretrained`` does, one layer's experts at a time; a short ``fastalign train sft`` run then trains
with the router's aux loss and exports a checkpoint ``from_pretrained`` reads back."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import fastalign
import fastalign.models.streaming as streaming
from fastalign.builtin import tiny_prompt_rows, tiny_sft_rows, tiny_tokenizer
from fastalign.quant import QuantOptions, load_4bit_model, quantize_model
from fastalign.train.distributed import DistributedContext
from fastalign.train.export import export_model
from fastalign.train.loading import load_model_and_tokenizer, materialize_model
from tests.patching.test_moe import BY_ID
from tests.patching.test_published_configs import build, read_config
from tests.train.runs import short_config, train

#: What each family's checkpoint holds for expert 10 of layer 0 (the natural order matters: "10" < "2").
EXPERT_KEYS = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.10.w1.weight",
    "qwen3-moe": "model.layers.0.mlp.experts.10.gate_proj.weight",
}
#: 16 experts (Mixtral publishes 8), so that expert 10 sorts before expert 2 as text.
CHANGES = {"mixtral": {"num_local_experts": 16}, "qwen3-moe": {}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Family id → (the random model, the directory it was saved in with the tiny tokenizer)."""
    saved: dict[str, tuple] = {}

    def get(family_id: str):
        if family_id not in saved:
            family = BY_ID[family_id]
            root = tmp_path_factory.mktemp(family_id)
            model = build(family, read_config(family, root / "hub", **CHANGES[family_id]))
            model.save_pretrained(root / "model")
            tiny_tokenizer().save_pretrained(root / "model")
            saved[family_id] = model, root / "model"
        return saved[family_id]

    return get


def assert_same_state(model, expected) -> None:
    state, want = model.state_dict(), expected.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name


@torch.no_grad()
@pytest.mark.parametrize("family_id", list(EXPERT_KEYS))
def test_a_skeleton_filled_from_a_per_expert_checkpoint_equals_from_pretrained(
    checkpoint, family_id, monkeypatch
):
    built, directory = checkpoint(family_id)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        assert EXPERT_KEYS[family_id] in handle.keys()  # one tensor per expert on disk
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)

    # Each layer's experts are fused as soon as their last tensor is read, not at the end of the stream.
    read, fused_at = [0], []
    stream, assign = streaming.checkpoint_tensors, streaming._assign

    def counting(path):
        tensors = stream(path)
        original = type(tensors).__iter__

        class Counted(type(tensors)):
            def __iter__(self):
                for item in original(self):
                    read[0] += 1
                    yield item

        tensors.__class__ = Counted
        return tensors

    def recording(param, full):
        if full.dim() == 3:
            fused_at.append(read[0])
        assign(param, full)

    monkeypatch.setattr("fastalign.train.loading.checkpoint_tensors", counting)
    monkeypatch.setattr(streaming, "_assign", recording)
    skeleton, _ = load_model_and_tokenizer(str(directory), materialize=False)
    model = materialize_model(skeleton, str(directory), None, torch.device("cpu"), seed=0)
    assert_same_state(model, reference)
    assert_same_state(model, built)
    assert len(fused_at) == 2 * model.config.num_hidden_layers and min(fused_at) < read[0] / 2


@torch.no_grad()
def test_a_skeleton_whose_classes_fsdp2_replaced_still_converts(checkpoint, tmp_path):
    """FSDP2's ``fully_shard`` swaps each module's class for a subclass defined outside transformers
    (``FSDPMixtralForCausalLM``), which transformers' conversion lookup takes for custom code and skips:
    the skeleton keeps the conversions it had when it was built, and the model the ones it used."""
    _, directory = checkpoint("mixtral")
    skeleton, _ = load_model_and_tokenizer(str(directory), materialize=False)
    for module in skeleton.modules():  # as torch's _fsdp_init does: type() called outside transformers
        module.__class__ = type(f"FSDP{type(module).__name__}", (type(module),), {})
    assert type(skeleton).is_custom_code()
    model = materialize_model(skeleton, str(directory), None, torch.device("cpu"), seed=0)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert_same_state(model, reference)
    # and saves as it was loaded, one tensor per expert (the export under FSDP2 passes a gathered state)
    model.save_pretrained(tmp_path, state_dict=model.state_dict())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert EXPERT_KEYS["mixtral"] in handle.keys()
    assert_same_state(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), reference)


@torch.no_grad()
def test_the_4bit_load_of_a_per_expert_checkpoint_equals_quantizing_from_pretrained(checkpoint):
    """QLoRA's layer-by-layer load: attention linears in 4 bits; the 3-D experts and the router (no
    ``nn.Linear``) stay in the unquantized rest's dtype, as ``quantize_model`` leaves them."""
    _, directory = checkpoint("qwen3-moe")
    loaded = load_4bit_model(directory, QuantOptions())
    expected = quantize_model(
        AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), QuantOptions()
    )
    assert_same_state(loaded, expected)
    layer = loaded.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "FourBitLinear"
    assert layer.mlp.experts.gate_up_proj.dtype == QuantOptions().dtype


def test_export_writes_what_from_pretrained_reads_back_equal(checkpoint, tmp_path):
    """The export (patched model, unpatched on the way out) is per expert again, as the Hub's."""
    _, directory = checkpoint("mixtral")
    model, tokenizer = load_model_and_tokenizer(str(directory))
    model = fastalign.patch_model(model)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    export_model(model, tokenizer, tmp_path / "export", DistributedContext(0, 1, 0, torch.device("cpu")))
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as handle:
        assert EXPERT_KEYS["mixtral"] in handle.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert reloaded.state_dict().keys() == expected.keys()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_sft_trains_a_moe_checkpoint_with_the_aux_loss_and_exports_it(checkpoint, tmp_path):
    _, directory = checkpoint("mixtral")
    config = short_config(tmp_path, tiny_sft_rows(8), model_name_or_path=str(directory))
    logged = [row for row in train(config, "sft") if "loss" in row]
    assert len(logged) == 2 and all(row["aux_loss"] > 0 for row in logged)
    trained = AutoModelForCausalLM.from_pretrained(config.output_dir, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(trained.state_dict()[gate_up], start.state_dict()[gate_up])  # experts trained
    skeleton, _ = load_model_and_tokenizer(config.output_dir, materialize=False)
    assert_same_state(
        materialize_model(skeleton, config.output_dir, None, torch.device("cpu"), seed=0), trained
    )


def test_grpo_adds_the_aux_loss_with_its_weight(checkpoint, tmp_path):
    """GRPO (as TRL's GRPOTrainer) adds ``router_aux_loss_coef · aux_loss`` to the step's loss and logs
    ``aux_loss``: the same sampled completions (seeded by data position) with the weight 0.5 and 0 differ
    by exactly half the logged aux loss, and PPO's options have no such key (TRL's former trainer)."""
    _, directory = checkpoint("mixtral")
    losses = {}
    for coef in (0.5, 0.0):
        (tmp_path / str(coef)).mkdir()
        config = short_config(
            tmp_path / str(coef),
            tiny_prompt_rows(4),
            model_name_or_path=str(directory),
            reward_funcs=["fastalign.builtin:digit_ratio"],
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=4,
            max_steps=1,
            router_aux_loss_coef=coef,
        )
        (row,) = [row for row in train(config, "grpo") if "loss" in row]
        losses[coef] = row
    assert "aux_loss" not in losses[0.0] and losses[0.5]["aux_loss"] > 0
    added = losses[0.5]["loss"] - losses[0.0]["loss"]
    assert added == pytest.approx(0.5 * losses[0.5]["aux_loss"], rel=1e-4, abs=1e-7)
