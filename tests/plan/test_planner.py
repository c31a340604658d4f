"""``fastalign plan``: the planner's arithmetic by hand, its activation formula against the tensors autograd
saves, monotonicity, suggestions that fit, the CLI (table, --json, one-line errors), and one prediction
against the measured peak memory of real training steps on CPU."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import textwrap

import peft
import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from transformers import AutoConfig, AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_config, tiny_model
from fastalign.cli.main import main
from fastalign.plan import (
    BUILTIN_SHAPES,
    CUDA_CONTEXT_BYTES,
    PlanError,
    bits_per_param,
    builtin_config,
    format_bytes,
    longest_sequence,
    parse_memory,
    plan_memory,
    shape_from_config,
    shape_names,
)
from fastalign.plan.planner import AUTO_KEEP_SHARE
from fastalign.plan.shapes import PARAMS_TOLERANCE

GiB = 2**30


# --------------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("name", shape_names())
def test_shape_parameter_counts_match_the_hf_models(name):
    config = builtin_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config, name).params == sum(p.numel() for p in model.parameters())


def test_published_parameter_counts():
    counts = {name: shape_from_config(builtin_config(name)).params for name in BUILTIN_SHAPES}
    assert counts["llama-3-8b"] == 8_030_261_248
    assert counts["llama-3-70b"] == 70_553_706_496
    assert counts["llama-3.2-1b"] == 1_235_814_400  # tied embeddings
    assert counts["qwen2.5-7b"] == 7_615_616_512  # q/k/v biases
    assert {"llama-3-8b", "llama-3-70b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b"} <= set(BUILTIN_SHAPES)


def test_mixture_of_experts_shapes_count_experts_and_activate_top_k():
    """Mixtral-8x7B and Qwen3-30B-A3B at their published totals (46.7B, 30.5B) and activated sizes (12.9B,
    3.3B per token: top-2 of 8 and top-8 of 128 experts); FLOPs count the activated weights only; the
    experts are neither LoRA targets nor 4-bit (QLoRA keeps them in bf16, as the loader does); the
    trainer's MFU counts the same FLOPs."""
    from fastalign.train.metrics import training_flops_per_token

    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)):
        shape = shape_from_config(builtin_config(name))
        assert shape.params == pytest.approx(total, rel=0.01)
        activated = shape.num_layers * shape.layer_active_params + shape.root_params
        assert activated == pytest.approx(active, rel=0.02)
        with torch.device("meta"):  # the trainer's MFU count: the same activated weights
            trainer_count = training_flops_per_token(
                AutoModelForCausalLM.from_config(builtin_config(name)), 4096
            )
        assert shape.flops_per_token(4096) == pytest.approx(trainer_count, rel=1e-12)
    mixtral = shape_from_config(builtin_config("mixtral-8x7b"))
    assert [name for name, _, _ in mixtral.linears()] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert mixtral.layer_other_params == 8 * (3 * 4096 * 14336 + 4096) + 2 * 4096  # experts, router, norms
    assert mixtral.activation_shape.intermediate_size == 2 * 14336  # what a token goes through
    plan = plan_memory("mixtral-8x7b", method="qlora", bf16=True, seq_len=512, batch_size=1)
    quantized = 32 * mixtral.layer_linear_params
    assert plan.weights > 2 * (mixtral.params - quantized)  # the experts stay bf16
    # Qwen1.5-MoE's shared expert (gated) is a set of linear layers: LoRA targets, counted exactly
    config = AutoConfig.for_model(
        "qwen2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, moe_intermediate_size=16, shared_expert_intermediate_size=48, vocab_size=100,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config).params == sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Arithmetic by hand


def test_llama3_8b_full_fine_tuning_by_formula():
    h, i, q, kv, layers, vocab, heads = 4096, 14336, 4096, 1024, 32, 128256, 32
    params = layers * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h) + 2 * vocab * h + h
    assert params == 8_030_261_248
    plan = plan_memory("llama-3-8b", method="full", gpus=1, seq_len=4096, checkpointing=True)
    assert plan.weights == 4 * params and plan.gradients == 4 * params  # fp32 params are the master copy
    assert plan.optimizer == 8 * params and plan.lora_params == 0  # AdamW m and v in fp32
    # one linear's bf16 cast at a time (fastalign.ops.autocast_linear keeps none), the head's cast
    assert plan.weight_copies == 2 * h * i + 2 * vocab * h
    unpatched = plan_memory(
        "llama-3-8b", method="full", gpus=1, seq_len=4096, checkpointing=True, fused_loss_head=False
    )  # autocast's cache: a bf16 copy of every linear weight
    assert unpatched.weight_copies == 2 * layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + 2 * vocab * h
    assert plan.cuda_context == CUDA_CONTEXT_BYTES
    # Under autocast the residual stream is fp32 (x = 4). Patched: each fused norm keeps its fp32 input and
    # 1/rms, q/k/v (gate/up) share one bf16 cast of their input, the MLP keeps gate and up:
    # 2·(4h + 4) + 2·2h + 2·(2q + 2kv) + 4·heads + 4i.
    per_layer = 2 * (4 * h + 4) + 4 * h + 2 * (2 * q + 2 * kv) + 4 * heads + 4 * i
    assert plan.layer_activation_bytes_per_token == per_layer
    # The model's own code: each norm also keeps the normalized input for its weight's gradient, each of
    # q/k/v/gate/up casts its input, the MLP keeps four [tokens, i] tensors:
    # 2·(8h + 4) + 2·5h + 2·(2q + 2kv) + 4·heads + 8i.
    assert unpatched.layer_activation_bytes_per_token == (
        2 * (8 * h + 4) + 10 * h + 2 * (2 * q + 2 * kv) + 4 * heads + 8 * i
    )
    tokens = 4096
    extras = 2 * 128 * 4 + 4 * h + 4 + 4 * h  # RoPE cos/sin, final norm
    assert plan.activations == tokens * (layers * 4 * h + per_layer + extras)
    total = sum(term.gpu_bytes for term in plan.terms)
    assert plan.total_per_gpu == total and plan.fits == (total <= 80 * GiB)

    sharded = plan_memory("llama-3-8b", method="full", gpus=8, seq_len=4096)
    assert sharded.weights == math.ceil(4 * params / 8) and sharded.optimizer == 8 * params // 8
    # FSDP2 bf16, patched: bf16 residual stream, one shared input per norm:
    # 8h + 8 + 2·(2q + 2kv) + 4·heads + 4i.
    assert sharded.layer_activation_bytes_per_token == 8 * h + 8 + 2 * (2 * q + 2 * kv) + 4 * heads + 4 * i

    bf16 = plan_memory("llama-3-8b", method="full", base_dtype="bf16", seq_len=4096, checkpointing=True)
    assert bf16.weights == bf16.gradients == 2 * params and bf16.optimizer == 4 * params  # all in bf16
    assert bf16.weight_copies == 0  # nothing to cast


def test_qlora_llama3_70b_weights_and_adapters():
    h, i, q, kv, layers, r = 8192, 28672, 8192, 1024, 80, 16
    plan = plan_memory("llama-3-70b", method="qlora", gpus=1, seq_len=8192, lora_r=r)
    quantized = layers * (h * q + 2 * h * kv + q * h + 3 * h * i)
    absmax = quantized // 64 + 4 * math.ceil(quantized / 64 / 256)  # double quantization
    assert plan.weights == quantized // 2 + absmax + 2 * (plan.params - quantized)
    assert 35e9 < plan.weights < 40e9
    assert bits_per_param(True) == pytest.approx(4.127, abs=1e-3) and bits_per_param(False) == 4.5
    adapters = layers * r * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i))
    assert plan.trainable_params == adapters == 207_093_760
    assert plan.lora_params == plan.gradients == 4 * adapters and plan.optimizer == 8 * adapters
    single_quant = plan_memory("llama-3-70b", method="qlora", double_quant=False)
    assert single_quant.weights - plan.weights == pytest.approx(quantized * (0.5 - 0.127) / 8, rel=1e-3)


def test_loss_head_fused_vs_materialized():
    plan = plan_memory("llama-3-8b", method="lora", seq_len=8192)
    vocab, h = 128256, 4096
    rows = 256 * 2**20 // (vocab * 2) // 16 * 16  # one 256 MiB chunk of bf16 logits on CUDA: 1,040 rows
    assert rows == 1040
    assert plan.loss_head == rows * vocab * 2 + 8192 * h * 2 + 24 * 8192  # frozen head: no accumulator
    assert plan.loss_head_materialized == 8 * 8192 * vocab
    materialized = plan_memory("llama-3-8b", method="lora", seq_len=8192, fused_loss_head=False)
    assert materialized.loss_head == plan.loss_head_materialized > plan.loss_head


# --------------------------------------------------------------------------------------------------
# The activation formula against what autograd saves in a decoder layer

_DIMS = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)
_TOKENS, _RANK = 40, 8  # 40: no activation is shaped like a weight


def _saved_bytes_per_token(model: torch.nn.Module, autocast: bool) -> int:
    """Bytes layer 1 saves for backward per token: weight casts and what layer 0 saved too (RoPE's
    cos/sin) are left out; each storage counts once."""
    layers = next(module for name, module in model.named_modules() if name.endswith("layers"))
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    seen: list[dict[int, int]] = [{}, {}]
    current = {"index": None}

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        parameter = isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)
        if current["index"] is not None and not parameter and tuple(base.shape) not in weight_shapes:
            storage = tensor.untyped_storage()
            seen[current["index"]][storage.data_ptr()] = storage.nbytes()
        return tensor

    def enter(index):
        def hook(module, args):
            current["index"] = index

        return hook

    for index in (0, 1):
        layers[index].register_forward_pre_hook(enter(index))
        layers[index].register_forward_hook(lambda *_: current.update(index=None))
    ids = torch.randint(0, _DIMS["vocab_size"], (1, _TOKENS))
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with saved_tensors_hooks(pack, lambda tensor: tensor), precision:
        model(input_ids=ids, labels=ids)
    return sum(nbytes for ptr, nbytes in seen[1].items() if ptr not in seen[0]) // _TOKENS


# (method, gpus, bf16, lora_dropout, base_dtype): how the engine runs; the tiny model reproduces its dtypes
# on CPU.
_REGIMES = [
    ("full", 1, False, 0.0, "fp32"),  # fp32
    ("full", 1, True, 0.0, "fp32"),  # single process: autocast over fp32 weights
    ("full", 2, True, 0.0, "fp32"),  # FSDP2 mixed precision: bf16 weights and activations
    ("full", 1, True, 0.0, "bf16"),  # loaded in bf16 (dtype: bfloat16)
    ("lora", 1, False, 0.0, "fp32"),
    ("lora", 1, False, 0.05, "fp32"),
    ("lora", 1, True, 0.0, "fp32"),
    ("lora", 1, True, 0.05, "fp32"),
    ("lora", 1, True, 0.05, "bf16"),  # a bf16 base under autocast, fp32 adapters
    ("lora", 2, True, 0.0, "fp32"),
    ("lora", 2, True, 0.05, "fp32"),
    ("qlora", 1, True, 0.0, "fp32"),  # bf16 base (stands in for NF4: neither saves its input), fp32 adapters
    ("qlora", 1, True, 0.05, "fp32"),
]


@pytest.mark.parametrize("patched", [False, True], ids=["model's own code", "patched"])
@pytest.mark.parametrize(("method", "gpus", "bf16", "dropout", "base_dtype"), _REGIMES)
def test_layer_activation_formula_matches_saved_tensors(method, gpus, bf16, dropout, base_dtype, patched):
    """Unpatched (``fused_loss_head=False``: SFT without ``use_liger_kernel``) and patched as the engine
    patches (``fastalign.train.policy``: the model, then its new adapters). The patch leaves RoPE out
    here: on CUDA its kernel keeps nothing per layer and returns q and k in their layout, while its CPU
    reference returns them contiguous, which makes the attention output a copy, not a view, for o_proj."""
    bf16_weights = (gpus > 1 and bf16) or method == "qlora" or base_dtype == "bf16"
    model = tiny_model("llama", dtype=torch.bfloat16 if bf16_weights else torch.float32, **_DIMS)
    if patched:
        fastalign.patch_model(model, rope=False)
    if method != "full":
        lora = peft.LoraConfig(
            r=_RANK, target_modules="all-linear", lora_dropout=dropout, task_type="CAUSAL_LM"
        )
        model = peft.get_peft_model(model, lora)  # adapters in fp32, as the engine's
        if gpus > 1:
            model = model.to(torch.bfloat16)  # FSDP2 computes the adapters in bf16 too
        if patched:
            fastalign.patching.patch_lora_layers(model)
    model.train()
    plan = plan_memory(
        tiny_config("llama", **_DIMS),
        method=method,
        gpus=gpus,
        bf16=bf16,
        base_dtype=base_dtype,
        device="cpu",
        lora_r=_RANK,
        lora_dropout=dropout,
        seq_len=_TOKENS,
        fused_loss_head=patched,
    )
    assert plan.layer_activation_bytes_per_token == _saved_bytes_per_token(model, autocast=bf16 and gpus == 1)


# --------------------------------------------------------------------------------------------------
# Monotonicity


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_checkpointing_offloading_and_gpus_move_memory_the_right_way(method):
    base = dict(method=method, seq_len=8192, gpu_memory_bytes=80 * GiB)
    plain = plan_memory("llama-3-8b", **base)
    checkpointed = plan_memory("llama-3-8b", **base, checkpointing=True)
    offloaded = plan_memory("llama-3-8b", **base, offload_activations=True, keep_on_device=0)
    both = plan_memory("llama-3-8b", **base, checkpointing=True, offload_activations=True, keep_on_device=0)
    assert checkpointed.activations < plain.activations / 4
    assert offloaded.activations < plain.activations / 4 and plain.activations_host == 0
    assert offloaded.activations_host == 32 * 8192 * plain.layer_activation_bytes_per_token
    assert both.activations < checkpointed.activations and both.activations_host < offloaded.activations_host
    assert both.host_per_process >= both.activations_host
    for plan in (checkpointed, offloaded, both):  # the other terms do not move
        assert (plan.weights, plan.gradients, plan.optimizer, plan.loss_head) == (
            plain.weights,
            plain.gradients,
            plain.optimizer,
            plain.loss_head,
        )

    previous = plan_memory("llama-3-8b", **base, gpus=2)
    for gpus in (4, 8, 16):
        sharded = plan_memory("llama-3-8b", **base, gpus=gpus)
        for term in ("weights", "lora_params", "gradients", "optimizer"):
            assert getattr(sharded, term) <= getattr(previous, term)
        assert sharded.weights < previous.weights and sharded.optimizer < previous.optimizer
        assert sharded.activations == previous.activations and sharded.loss_head == previous.loss_head
        assert sharded.total_per_gpu < previous.total_per_gpu
        assert {t.name for t in sharded.terms if t.sharded} == {
            "weights",
            "lora_params",
            "gradients",
            "optimizer",
        }
        previous = sharded
    assert plan_memory("llama-3-8b", **base, batch_size=2).activations > plain.activations


def test_keep_on_device_moves_layer_inputs_from_host_to_gpu_and_auto_takes_the_most_that_fit():
    """Offloading with checkpointing: the host holds the inputs of the layers not kept, the GPU those kept
    and two offloaded ones in flight; "auto" keeps the most layers that fit, none where nothing fits."""
    base = dict(method="lora", base_dtype="bf16", seq_len=16384, checkpointing=True, offload_activations=True)
    layers, tokens = 32, 16384
    none = plan_memory("llama-3-8b", **base, keep_on_device=0, suggest=False)
    layer = tokens * none.layer_input_bytes_per_token  # one layer's input: 2 B × h per token
    assert none.activations_host == layers * layer and none.offload_keep_on_device == 0
    for keep in (1, 10, 30, 31):
        kept = plan_memory("llama-3-8b", **base, keep_on_device=keep, suggest=False)
        assert kept.offload_keep_on_device == keep
        assert kept.activations_host == (layers - keep) * layer
        in_flight = min(layers - keep, 2)  # of the offloaded layers
        assert kept.activations - none.activations == (keep + in_flight - 2) * layer
    everything = plan_memory("llama-3-8b", **base, keep_on_device=layers, suggest=False)
    assert everything.activations_host == 0
    assert (
        everything.total_per_gpu
        == plan_memory("llama-3-8b", **{**base, "offload_activations": False}).total_per_gpu
    )

    # room for five more layers in the share auto fills (the rest a margin for the planner's under-estimates)
    budget = int((none.total_per_gpu + 5 * layer + layer // 2) / AUTO_KEEP_SHARE)
    auto = plan_memory("llama-3-8b", **base, gpu_memory_bytes=budget, suggest=False)
    assert auto.offload_keep_on_device == 5 and auto.fits and auto.activations_host == 27 * layer
    tight = plan_memory("llama-3-8b", **base, gpu_memory_bytes=none.total_per_gpu - 1, suggest=False)
    assert tight.offload_keep_on_device == 0 and not tight.fits
    assert plan_memory("llama-3-8b", **base).offload_keep_on_device == layers  # 80 GB: nothing to offload
    assert plan_memory("llama-3-8b", **{**base, "offload_activations": False}).offload_keep_on_device == 0
    with pytest.raises(PlanError, match="must be 'auto' or 0 to 32 layers, got 33"):
        plan_memory("llama-3-8b", **base, keep_on_device=33)


def test_offloading_is_a_no_op_on_cpu():
    plan = plan_memory("tiny-llama", device="cpu", seq_len=128, offload_activations=True)
    assert plan.activations_host == 0 and plan.cuda_context == 0
    assert plan.activations == plan_memory("tiny-llama", device="cpu", seq_len=128).activations
    assert any("no effect on CPU" in note for note in plan.notes)


# --------------------------------------------------------------------------------------------------
# Suggestions


def _cli_json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "llama-3-8b", "--gpu-memory", "24GB"],  # full → checkpointing + QLoRA
        ["--model", "llama-3-8b", "--method", "ppo", "--gpu-memory", "24GB"],  # → the one-base-model mode
        ["--model", "llama-3-8b", "--method", "ppo-lora", "--gpu-memory", "12GB"],  # → ppo-qlora
        ["--model", "llama-3-70b", "--method", "qlora", "--gpu-memory", "48GB", "--seq-len", "8192"],
        ["--model", "llama-3-70b", "--method", "qlora", "--gpu-memory", "24GB", "--seq-len", "32768"],  # GPUs
        [
            "--model",
            "llama-3.2-1b",
            "--method",
            "lora",
            "--gpu-memory",
            "24GB",
            "--seq-len",
            "8192",
            "--batch-size",
            "64",
        ],  # smaller micro-batches
        [
            "--model",
            "mistral-7b",
            "--method",
            "lora",
            "--gpus",
            "2",
            "--gpu-memory",
            "40GB",
            "--seq-len",
            "32768",
        ],
    ],
)
def test_suggestions_lead_to_a_plan_that_fits(capsys, argv):
    plan = _cli_json(capsys, argv)
    assert not plan["fits"] and plan["suggestions"]
    suggested = _cli_json(capsys, argv + [part for flag in plan["suggestions"] for part in flag.split()])
    assert suggested["fits"] and suggested["suggestions"] == []
    assert suggested["total_per_gpu"] == plan["suggested_total_per_gpu"] <= suggested["gpu_memory_bytes"]


def test_ppo_separate_models_add_a_trained_critic_and_a_frozen_reference():
    """``--method ppo``: the full fine-tuning plan of the policy, plus a critic of the policy's shape with
    a value head for the LM head (16 B per parameter: weights, gradients, AdamW; sharded) with the
    policy's working copies and activations, plus a frozen fp32 reference (4 B per parameter)."""
    flags = dict(gpus=8, checkpointing=True, seq_len=8192)
    policy = plan_memory("llama-3-8b", method="full", **flags)
    ppo = plan_memory("llama-3-8b", method="ppo", **flags)
    shape = shape_from_config(builtin_config("llama-3-8b"))
    critic_params = shape.params - shape.vocab_size * shape.hidden_size + shape.hidden_size
    assert ppo.critic == -(-16 * critic_params // 8) + policy.weight_copies + policy.activations
    assert ppo.reference == -(-4 * shape.params // 8)
    assert ppo.total_per_gpu == policy.total_per_gpu + ppo.critic + ppo.reference
    assert ppo.total_per_gpu == sum(term.gpu_bytes for term in ppo.terms)
    assert [term.name for term in ppo.terms][-2:] == ["critic", "reference"]
    assert ppo.trainable_params == shape.params + critic_params
    assert any("--method ppo-lora" in note for note in ppo.notes)


def test_ppo_one_base_model_adds_an_adapter_and_a_value_head():
    """``--method ppo-lora`` / ``ppo-qlora``: the LoRA plan of the policy, plus the critic's adapter (as
    large as the policy's) and value head at 16 B per parameter, and its forward's working copies and
    activations; the reference is the base (0 B). It needs far less than the separate models."""
    for method, base in (("ppo-lora", "lora"), ("ppo-qlora", "qlora")):
        policy = plan_memory("llama-3-8b", method=base)  # no checkpointing: training refuses it there
        ppo = plan_memory("llama-3-8b", method=method)
        hidden = shape_from_config(builtin_config("llama-3-8b")).hidden_size
        trained = policy.trainable_params + hidden
        assert ppo.critic == 16 * trained + policy.weight_copies + policy.activations
        assert ppo.reference == 0 and ppo.weights == policy.weights  # one base model
        assert ppo.total_per_gpu == policy.total_per_gpu + ppo.critic
    separate = plan_memory("llama-3-8b", method="ppo")
    one_base = plan_memory("llama-3-8b", method="ppo-lora")
    assert one_base.total_per_gpu < separate.total_per_gpu / 2
    with pytest.raises(PlanError, match="runs on 1 GPU"):
        plan_memory("llama-3-8b", method="ppo-qlora", gpus=2)
    with pytest.raises(PlanError, match="refuses gradient checkpointing") as error:
        plan_memory("llama-3-8b", method="ppo-lora", checkpointing=True)
    assert error.value.option == "checkpointing"
    tight = plan_memory("llama-3-8b", method="ppo-lora", seq_len=16384, gpu_memory_bytes=40 * GiB)
    assert tight.suggestions and "--checkpointing" not in tight.suggestions


def test_the_ladder_order_and_a_plan_that_fits_already():
    tight = plan_memory("llama-3-70b", method="qlora", gpu_memory_bytes=48 * GiB, seq_len=8192)
    assert tight.suggestions == ["--checkpointing", "--offload-activations"]
    full = plan_memory("llama-3-8b", method="full", gpu_memory_bytes=24 * GiB)
    assert full.suggestions == ["--checkpointing", "--method qlora"]  # the fp32 LoRA base (32 GB) is too big
    roomy = plan_memory("llama-3.2-1b", method="lora", checkpointing=True, gpu_memory_bytes=80 * GiB)
    assert roomy.fits and roomy.suggestions == [] and roomy.suggested_total_per_gpu is None
    hopeless = plan_memory("llama-3-70b", method="qlora", gpu_memory_bytes=16 * GiB, seq_len=2**20)
    assert hopeless.suggestions == [] and any("shorten --seq-len" in note for note in hopeless.notes)


# --------------------------------------------------------------------------------------------------
# CLI


def test_table_and_json_show_the_same_numbers(capsys):
    argv = [
        "plan",
        "--model",
        "llama-3-70b",
        "--method",
        "qlora",
        "--gpus",
        "1",
        "--gpu-memory",
        "48GB",
        "--seq-len",
        "8192",
        "--checkpointing",
        "--offload-activations",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    lines = table.splitlines()
    for term in plan["terms"]:
        row = next(line for line in lines if f" {term['label']} " in line)
        assert format_bytes(term["gpu_bytes"]) in row and format_bytes(term["host_bytes"]) in row, row
    total = next(line for line in lines if " total " in line)
    assert format_bytes(plan["total_per_gpu"]) in total and format_bytes(plan["host_per_process"]) in total
    assert plan["total_per_gpu"] == sum(term["gpu_bytes"] for term in plan["terms"])
    assert plan["fits"] and "fits" in table and plan["gpu_memory_bytes"] == 48 * GiB
    python = plan_memory(
        "llama-3-70b",
        method="qlora",
        gpu_memory_bytes=48 * GiB,
        seq_len=8192,
        checkpointing=True,
        offload_activations=True,
    )
    assert plan == json.loads(json.dumps(python.to_dict()))


def test_a_config_json_path_is_read_offline(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path / "model")
    from_file = _cli_json(capsys, ["--model", str(tmp_path / "model" / "config.json"), "--seq-len", "64"])
    from_dir = _cli_json(capsys, ["--model", str(tmp_path / "model"), "--seq-len", "64"])
    builtin = _cli_json(capsys, ["--model", "tiny-llama", "--seq-len", "64"])
    assert from_file["params"] == from_dir["params"] == builtin["params"] == 139_584
    assert from_file["total_per_gpu"] == builtin["total_per_gpu"]


def _not_causal(tmp_path):
    AutoConfig.for_model(
        "bert",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def _moe(tmp_path):
    """A mixture-of-experts model the planner does not model (latent attention, dense first layers)."""
    AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        n_routed_experts=4,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--model", "llama-3-8"], "--model", "did you mean 'llama-3-8b'"),
        (["--model", "qwen-2.5-7b"], "--model", "did you mean 'qwen2.5-7b'"),
        (["--model", "./missing/config.json"], "--model", "no such file"),
        ([], "--model", "required"),
        (["--model", "llama-3-8b", "--gpus", "0"], "--gpus", "positive"),
        (["--model", "llama-3-8b", "--gpus", "two"], "--gpus", "positive integer"),
        (["--model", "llama-3-8b", "--seq-len", "-1"], "--seq-len", "positive"),
        (["--model", "llama-3-8b", "--batch-size", "0"], "--batch-size", "positive"),
        (["--model", "llama-3-8b", "--gpu-memory", "24XB"], "--gpu-memory", "cannot parse '24XB'"),
        (["--model", "llama-3-8b", "--gpu-memory", "0GB"], "--gpu-memory", "positive"),
        (["--model", "llama-3-8b", "--method", "dora"], "--method", "full, lora, qlora"),
        (["--model", "llama-3-8b", "--method", "lora", "--lora-r", "0"], "--lora-r", "positive"),
        (["--model", "llama-3-8b", "--lora-r", "64"], "--lora-r", "not 'full': remove it"),  # was ignored
        (["--model", "llama-3-8b", "--lora-dropout", "0"], "--lora-dropout", "not 'full': remove it"),
        (
            ["--model", "llama-3-8b", "--method", "distill-offline", "--tail-samples", "-1"],
            "--tail-samples",
            "an integer of 0 or more",
        ),
        (["--model", "llama-3-8b", "--top-k", "64"], "--top-k", "distill-offline-qlora only"),
        (
            ["--model", "llama-3-8b", "--method", "lora", "--tail-samples", "8"],
            "--tail-samples",
            "distill-offline-qlora only (the stored teacher log-probs' disk), not 'lora'",
        ),
        (["--model", "llama-3-8b", "--method", "qlora", "--lora-dropout", "1"], "--lora-dropout", "[0, 1)"),
        (["--model", "llama-3-8b", "--method", "ppo-lora", "--gpus", "2"], "--gpus", "use --method ppo"),
        (["--model", "{not_causal}"], "--model", "BertForMaskedLM, not a causal LM"),
        (["--model", "{moe}"], "--model", "mixture-of-experts"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, flag, words):
    paths = {"{not_causal}": lambda: _not_causal(tmp_path), "{moe}": lambda: _moe(tmp_path)}
    argv = [paths[arg]() if arg in paths else arg for arg in argv]
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}: ") and words in lines[0], lines


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"model_type": "llama", "hidden_size": "big"}, "Field 'hidden_size' expected int, got str"),
        ({"model_type": "llama", "vocab_size": -5}, "vocab_size must be a size >= 0, got -5"),
    ],
)
def test_a_mistyped_or_negative_config_is_one_line(tmp_path, capsys, config, words):
    """A field of the wrong type (huggingface_hub's StrictDataclassError, not a ValueError) and a negative
    size are each one error line, not a traceback or a plan."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--model", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: --model: ") and words in lines[0], captured.err


def test_parse_memory():
    assert (
        parse_memory("24GB")
        == parse_memory("24 GiB")
        == parse_memory("24g")
        == parse_memory("24")
        == 24 * GiB
    )
    assert parse_memory("81559MiB") == 81559 * 2**20 and parse_memory("1.5TB") == int(1.5 * 2**40)
    assert parse_memory("512B") == 512
    for bad in ("24XB", "", "GB", "-4GB", "24 G B", "iB"):
        with pytest.raises(PlanError):
            parse_memory(bad)


# --------------------------------------------------------------------------------------------------
# Prediction against a measured peak

#: A ~24M-parameter Llama: fp32 weights, gradients and AdamW state (16 B/param, ~380 MB) dominate.
_MEASURED_SHAPE = dict(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
)
_MEASURED_TOKENS = 128

_TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from fastalign.bench import measure
    from fastalign.builtin import tiny_model

    measure.release_freed_memory_promptly()  # freed blocks go back to the system: RSS follows live tensors
    torch.set_num_threads(2)
    shape, tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    model = tiny_model("llama", **shape).train()  # fp32, SDPA, HF's own loss: the engine on CPU, no bf16
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False)  # as the engine on CPU
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))

    def train():
        for _ in range(2):  # the first step creates AdamW's state, the second runs with it
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    peak = measure.peak_extra_bytes(train, torch.device("cpu"))  # VmHWM rise over the RSS right before
    print(json.dumps({"peak": peak, "params": sum(p.numel() for p in model.parameters())}))
    """
)


@pytest.mark.slow
def test_prediction_matches_the_measured_peak_of_training_on_cpu():
    """The planner's training-state memory (gradients + AdamW state + activations + loss head: all but
    the weights, which exist before the measurement starts) against the rise of the peak resident set
    over two training steps of a ~24M-parameter Llama on CPU in fp32, within 25 %.

    CPU peak RSS is noisier than CUDA's ``max_memory_allocated``, which counts exactly the bytes of live
    tensors: RSS counts touched pages, including glibc's arenas and caching (reduced, not removed, by a
    low mmap threshold), page rounding, oneDNN/BLAS scratch buffers, Python objects and autograd
    temporaries, and the allocator's timing of returns to the OS. The model is sized so that
    the 12 B/param of gradients and optimizer state (~290 MB) dwarf those tens of MB.
    """
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN_SCRIPT, json.dumps(_MEASURED_SHAPE), str(_MEASURED_TOKENS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    if measured["peak"] is None:
        pytest.skip("this platform cannot reset the peak resident set (/proc/self/clear_refs)")
    config = tiny_config("llama", **_MEASURED_SHAPE)
    plan = plan_memory(
        config,
        method="full",
        gpus=1,
        seq_len=_MEASURED_TOKENS,
        bf16=False,
        device="cpu",
        fused_loss_head=False,
    )
    assert plan.params == measured["params"]
    predicted = plan.training_state_bytes
    assert predicted == plan.gradients + plan.optimizer + plan.activations + plan.loss_head
    assert abs(measured["peak"] - predicted) <= 0.25 * predicted, (measured["peak"], predicted)


def test_a_family_the_count_does_not_describe_is_refused():
    """The Llama-style count is checked against the model transformers builds (meta device): Arcee's
    non-gated relu² MLP (two matrices, not three) is refused with both counts; OLMo-2's extra q/k norm
    weights are within the tolerance."""
    sizes = dict(
        hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=2816, vocab_size=32000,
    )  # fmt: skip
    with pytest.raises(PlanError, match=r"arcee \(arcee\) has 82,318,336 parameters, but .* 88,085,504"):
        shape_from_config(AutoConfig.for_model("arcee", **sizes), "arcee")
    olmo2 = AutoConfig.for_model("olmo2", **sizes)
    with torch.device("meta"):
        actual = sum(p.numel() for p in AutoModelForCausalLM.from_config(olmo2).parameters())
    assert shape_from_config(olmo2).params != actual
    assert shape_from_config(olmo2).params == pytest.approx(actual, rel=PARAMS_TOLERANCE)


# (shape, method, base_dtype, tokens, checkpointing, offloading, measured peak GiB): H100 measurements of
# 2026-11-26 at commit 20b375b (``fastalign bench gpu``, benchmarks/gpu/lora_step.py: random weights, bf16
# autocast, LoRA r16 all-linear, dropout 0.05, fastalign.patch_model, transformers 5.17): peak of
# ``torch.cuda.max_memory_allocated`` over two or three AdamW steps, which leaves out the CUDA context.
_H100_PEAKS = [
    ("llama-3-70b", "qlora", "fp32", 8192, True, False, 54.94),
    ("llama-3-70b", "qlora", "fp32", 8192, True, True, 46.08),
    ("llama-3-70b", "qlora", "fp32", 12106, True, True, 49.02),
    ("llama-3-8b", "lora", "bf16", 4096, False, False, 42.38),
    ("llama-3-8b", "lora", "bf16", 16384, True, False, 24.97),
    ("llama-3-8b", "lora", "bf16", 16384, True, True, 21.49),
]


@pytest.mark.parametrize(("shape", "method", "base_dtype", "tokens", "ckpt", "offload", "peak"), _H100_PEAKS)
def test_predictions_match_the_h100_measurements(shape, method, base_dtype, tokens, ckpt, offload, peak):
    plan = plan_memory(
        shape,
        method=method,
        base_dtype=base_dtype,
        seq_len=tokens,
        checkpointing=ckpt,
        offload_activations=offload,
        keep_on_device=0,
        lora_r=16,
        lora_dropout=0.05,
        suggest=False,
    )  # fmt: skip  (the measurements offloaded every layer)
    predicted = (plan.total_per_gpu - plan.cuda_context) / GiB
    assert predicted == pytest.approx(peak, rel=0.10)


def test_longest_sequence_is_the_last_length_that_fits():
    flags = dict(method="qlora", checkpointing=True, gpu_memory_bytes=48 * GiB)
    for offload in (False, True):
        longest = longest_sequence("llama-3-70b", **flags, offload_activations=offload)
        exact = longest_sequence("llama-3-70b", **flags, offload_activations=offload, multiple=1)
        assert longest % 256 == 0 and longest <= exact < longest + 256
        assert plan_memory("llama-3-70b", **flags, offload_activations=offload, seq_len=exact).fits
        assert not plan_memory("llama-3-70b", **flags, offload_activations=offload, seq_len=exact + 1).fits
    assert longest_sequence("llama-3-70b", method="qlora", gpu_memory_bytes=24 * GiB) == 0  # weights alone
    with pytest.raises(PlanError, match="longest_sequence chooses seq_len"):
        longest_sequence("tiny-llama", seq_len=128)


def test_cli_longest_prints_both_lengths(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--method", "qlora", "--checkpointing", "--gpu-memory", "48GB"]
    assert main([*argv, "--longest", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    flags = dict(method="qlora", checkpointing=True, gpu_memory_bytes=48 * GiB)
    assert result["longest_seq_len"] == longest_sequence("llama-3-70b", **flags)
    offloaded = longest_sequence("llama-3-70b", **flags, offload_activations=True)
    assert result["longest_seq_len_offloaded"] == offloaded > result["longest_seq_len"]
    assert main([*argv, "--longest"]) == 0
    line = capsys.readouterr().out
    assert f"{result['longest_seq_len']:,} tokens; with --offload-activations: {offloaded:,} tokens" in line


def test_host_memory_bounds_what_offloading_may_take():
    """With ``host_memory_bytes`` a plan fits only where its offloaded activations stay within the share
    training's own check gives them (all but a tenth, at least 2 GiB): the 70B QLoRA longest on an
    80 GB GPU in a 125.9 GiB machine is shorter than the GPU alone allows, and is host-bound."""
    from fastalign.plan.planner import usable_host_bytes

    host = int(125.9 * GiB)
    flags = dict(method="qlora", checkpointing=True, offload_activations=True, tiled_mlp_mib=256)
    free = longest_sequence("llama-3-70b", **flags)
    bound = longest_sequence("llama-3-70b", **flags, host_memory_bytes=host)
    assert 0 < bound < free
    fitting = plan_memory("llama-3-70b", **flags, seq_len=bound, host_memory_bytes=host, suggest=False)
    assert fitting.fits and fitting.host_fits and fitting.host_total <= usable_host_bytes(host)
    longer = plan_memory("llama-3-70b", **flags, seq_len=bound + 256, host_memory_bytes=host, suggest=False)
    assert not longer.fits and not longer.host_fits and longer.total_per_gpu <= longer.gpu_memory_bytes
    assert plan_memory("llama-3-70b", **flags, seq_len=bound + 256, suggest=False).fits  # not checked: fits
    assert usable_host_bytes(host) == host - host // 10 and usable_host_bytes(8 * GiB) == 6 * GiB
    with pytest.raises(PlanError, match="must be a positive integer or None, got 0") as error:
        plan_memory("tiny-llama", host_memory_bytes=0)
    assert error.value.option == "host_memory_bytes"
    with pytest.raises(PlanError, match="every term is host memory") as error:
        plan_memory("tiny-llama", device="cpu", host_memory_bytes=host)
    assert error.value.option == "host_memory_bytes"


def test_ppo_offloads_the_critics_activations_too():
    """The critic's activations are offloaded as the policy's (ppo-lora: its forward runs through the
    policy's hooked layers; ppo: the critic is prepared as the policy): the host holds both, and the host
    check counts them."""
    flags = dict(seq_len=16384, offload_activations=True, keep_on_device=0, suggest=False)
    policy = plan_memory("llama-3-8b", method="lora", **flags)
    one_base = plan_memory("llama-3-8b", method="ppo-lora", **flags)
    separate = plan_memory("llama-3-8b", method="ppo", **flags, checkpointing=True)
    assert one_base.activations_host == 2 * policy.activations_host == one_base.host_total
    full = plan_memory("llama-3-8b", method="full", **flags, checkpointing=True)
    assert separate.activations_host == 2 * full.activations_host
    between = (policy.host_total + one_base.host_total) // 2
    room = between + max(between // 9, 2 * GiB)  # usable_host_bytes(room) ≈ between
    assert plan_memory("llama-3-8b", method="lora", **flags, host_memory_bytes=room).host_fits
    assert not plan_memory("llama-3-8b", method="ppo-lora", **flags, host_memory_bytes=room).fits


def test_cli_host_memory_bounds_the_longest_and_the_verdict(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--method", "qlora", "--checkpointing", "--tiled-mlp"]
    host = ["--host-memory", "125.9GB"]
    assert main([*argv, *host, "--longest", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    flags = dict(method="qlora", checkpointing=True, tiled_mlp_mib=256, host_memory_bytes=int(125.9 * GiB))
    assert result["longest_seq_len_offloaded"] == longest_sequence(
        "llama-3-70b", **flags, offload_activations=True
    )
    too_long = str(result["longest_seq_len_offloaded"] + 256)
    assert main([*argv, *host, "--offload-activations", "--seq-len", too_long]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "per GPU: fits; host " in out and "offloading may take of 125.90 GiB: does not fit" in out
    assert main([*argv, "--host-memory", "lots"]) == 2
    assert capsys.readouterr().err.startswith("error: --host-memory")


@pytest.mark.parametrize(("method", "gpus", "bf16", "dropout", "base_dtype"), _REGIMES)
def test_tiled_layer_activation_formula_matches_saved_tensors(method, gpus, bf16, dropout, base_dtype):
    """``tiled_mlp_mib``: the patched model with its MLPs tiled (``patch_model(tiled_mlp=)``) saves what
    the planner says, per token: the layer less the MLP's share, plus the tile's input."""
    bf16_weights = (gpus > 1 and bf16) or method == "qlora" or base_dtype == "bf16"
    model = tiny_model("llama", dtype=torch.bfloat16 if bf16_weights else torch.float32, **_DIMS)
    tiles = dict(tiled_mlp=True, tiled_mlp_budget_mib=0.001)  # tiles of a few tokens: tiling engages
    fastalign.patch_model(model, rope=False, **tiles)
    if method != "full":
        lora = peft.LoraConfig(
            r=_RANK, target_modules="all-linear", lora_dropout=dropout, task_type="CAUSAL_LM"
        )
        model = peft.get_peft_model(model, lora)
        if gpus > 1:
            model = model.to(torch.bfloat16)
        fastalign.patching.patch_lora_layers(model)
    model.train()
    plan = plan_memory(
        tiny_config("llama", **_DIMS), method=method, gpus=gpus, bf16=bf16, base_dtype=base_dtype,
        device="cpu", lora_r=_RANK, lora_dropout=dropout, seq_len=_TOKENS, tiled_mlp_mib=0.001,
    )  # fmt: skip
    assert plan.layer_activation_bytes_per_token == _saved_bytes_per_token(model, autocast=bf16 and gpus == 1)


def test_a_tiled_mlp_holds_one_tile_and_goes_longer():
    """The tile's working set is held once; the longest sequence grows; without the fused kernels, or with
    a negative budget, it is refused."""
    flags = dict(method="qlora", checkpointing=True, suggest=False)
    plain = plan_memory("llama-3-70b", seq_len=65536, **flags)
    tiled = plan_memory("llama-3-70b", seq_len=65536, tiled_mlp_mib=256, **flags)
    saved = plain.layer_activation_bytes_per_token - tiled.layer_activation_bytes_per_token
    assert saved > 2 * 28672  # at least gate and up, in bf16, per token
    assert tiled.activations - plain.activations == 256 * 2**20 - 65536 * saved
    longest = dict(method="qlora", checkpointing=True, gpu_memory_bytes=80 * 2**30)
    assert longest_sequence("llama-3-70b", tiled_mlp_mib=256, **longest) > longest_sequence(
        "llama-3-70b", **longest
    )
    for bad in (dict(tiled_mlp_mib=256, fused_loss_head=False), dict(tiled_mlp_mib=-1)):
        with pytest.raises(PlanError) as error:
            plan_memory("llama-3-70b", suggest=False, **bad)
        assert error.value.option == "tiled_mlp_mib"


def test_distill_offline_is_the_students_full_plan_with_no_teacher():
    """``--method distill-offline``: the student's full fine-tuning memory, a teacher term of 0 bytes, and
    the disk per token of the stored top-k and tail draws (as ``fastalign.data.teacher_logprobs`` writes
    them); another method given either one is refused."""
    from fastalign.data.teacher_logprobs import disk_bytes_per_token
    from fastalign.plan import plan_memory as plan

    full = plan("llama-3-8b", method="full", gpus=8, seq_len=2048)
    offline = plan("llama-3-8b", method="distill-offline", gpus=8, seq_len=2048, top_k=32)
    assert offline.total_per_gpu == full.total_per_gpu and offline.method == "distill-offline"
    assert next(t for t in offline.terms if t.name == "teacher").gpu_bytes == 0
    assert offline.teacher_logprobs_bytes_per_token == disk_bytes_per_token(32) == 264
    assert any("264 B per completion token" in note for note in offline.notes)
    draws = plan("llama-3-8b", method="distill-offline", gpus=8, seq_len=2048, top_k=32, tail_samples=8)
    assert draws.teacher_logprobs_bytes_per_token == disk_bytes_per_token(32, tail_samples=8) == 296
    assert any("296 B per completion token at top_k 32 and 8 tail draws" in note for note in draws.notes)
    for method in ("full", "qlora", "ppo"):  # no other method reads them: set, they are refused
        for stored in (dict(top_k=32), dict(tail_samples=0)):
            with pytest.raises(PlanError, match="applies to the methods distill-offline, ") as error:
                plan("llama-3-8b", method=method, gpus=1, seq_len=2048, **stored)
            assert error.value.option == next(iter(stored))


@pytest.mark.parametrize("student", ["lora", "qlora"])
def test_distill_offline_with_an_adapter_student_is_its_plan_with_no_teacher(student):
    """``--method distill-offline-lora`` / ``-qlora``: the LoRA / QLoRA student's memory (as ``train
    distill --use_peft [--quantization nf4]`` trains it), a teacher term of 0 bytes and the disk note."""
    from fastalign.plan import plan_memory as plan

    adapters = plan("llama-3-8b", method=student, gpus=1, seq_len=2048)
    offline = plan("llama-3-8b", method=f"distill-offline-{student}", gpus=1, seq_len=2048, tail_samples=4)
    assert offline.total_per_gpu == adapters.total_per_gpu and offline.method == f"distill-offline-{student}"
    assert [t.name for t in offline.terms] == [*(t.name for t in adapters.terms), "teacher"]
    assert next(t for t in offline.terms if t.name == "teacher").gpu_bytes == 0
    assert any("280 B per completion token at top_k 32 and 4 tail draws" in note for note in offline.notes)


def test_distill_offline_suggestions_keep_offline_distillation():
    """A student that does not fit gets the flags that fit it as offline distillation (checkpointing, a
    LoRA or QLoRA student, more GPUs), never ``--method lora``, which would plan LoRA SFT; the disk note
    stays."""
    from fastalign.plan import plan_memory as plan

    offline = plan("llama-3-8b", method="distill-offline", gpus=1, seq_len=2048, top_k=32)
    assert offline.suggestions == ["--method distill-offline-lora"]
    fitted = plan("llama-3-8b", method="distill-offline-lora", gpus=1, seq_len=2048)
    assert offline.suggested_total_per_gpu == fitted.total_per_gpu and fitted.fits
    big = plan("llama-3-70b", method="distill-offline", gpus=1, seq_len=4096)
    assert big.suggestions == ["--checkpointing", "--method distill-offline-qlora"], big.suggestions
    assert any("264 B per completion token" in note for note in offline.notes)


def test_cli_longest_says_when_the_models_context_is_the_bound(capsys):
    """tiny-llama fits 12M tokens on 80 GB but reads 512 positions: the line says so (it did not)."""
    assert main(["plan", "--model", "tiny-llama", "--method", "lora", "--longest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 512
    assert main(["plan", "--model", "tiny-llama", "--method", "lora", "--longest"]) == 0
    assert "max_position_embeddings, is 512" in capsys.readouterr().out
    assert (
        main(["plan", "--model", "llama-3-70b", "--method", "qlora", "--gpu-memory", "48GB", "--longest"])
        == 0
    )
    assert "max_position_embeddings" not in capsys.readouterr().out  # 8,192 positions, fewer tokens fit
