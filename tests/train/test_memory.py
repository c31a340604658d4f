"""Activation checkpointing and offloading change memory, never the loss or the gradients."""

from __future__ import annotations

import copy
import ctypes

import peft
import pytest
import torch
from torch import nn

import fastalign
from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.models.structure import decoder_layers, decoder_stack
from fastalign.patching import patched_pieces
from fastalign.train import memory
from fastalign.train.memory import (
    ActivationOffloader,
    HostMemoryError,
    _HostPool,
    _OffloadingCheckpoint,
    enable_activation_checkpointing,
    enable_activation_offloading,
)


def padded_batch() -> dict[str, torch.Tensor]:
    """Two rows of different lengths, right-padded; labels -100 on padding."""
    batch = tiny_tokenizer()(
        ["What is 3 plus 4? The answer is 7.", "the model learns"], padding=True, return_tensors="pt"
    )
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def train_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.train()
    torch.manual_seed(0)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


def assert_same_step(reference: nn.Module, model: nn.Module) -> None:
    """One forward/backward of each: equal losses, and equal gradients for every parameter."""
    batch = padded_batch()
    torch.testing.assert_close(train_step(model, batch), train_step(reference, batch), rtol=1e-5, atol=1e-6)
    with_grad = 0
    for (name, expected), (_, got) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        assert (got.grad is None) == (expected.grad is None), name
        if expected.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
            with_grad += 1
    assert with_grad > 0


def offload(model: nn.Module, min_bytes: int = 0) -> ActivationOffloader:
    """Offloading whose CPU path copies like the CUDA one, so its bookkeeping is exercised."""
    offloader = enable_activation_offloading(model, min_bytes=min_bytes)
    offloader._force_copy = True
    return offloader


def offloaded_storages(offloader: ActivationOffloader) -> list[int]:
    """Spy on ``offloader``: the storage addresses of the tensors it offloads, appended as it packs."""
    seen: list[int] = []
    pack = offloader._pack

    def spy(tensor):
        packed = pack(tensor)
        if packed is not tensor:
            seen.append(tensor.untyped_storage().data_ptr())
        return packed

    offloader._pack = spy
    return seen


def lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_decoder_layers(model_type):
    model = tiny_model(model_type)
    assert decoder_layers(model) == list(model.model.layers)
    assert decoder_layers(lora(model)) == list(model.model.layers)


def test_decoder_layers_of_a_module_without_any_name_it():
    with pytest.raises(ValueError, match="Sequential"):
        decoder_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_checkpointing_recomputes_with_the_same_gradients(model_type):
    reference = tiny_model(model_type)
    model = copy.deepcopy(reference)
    enable_activation_checkpointing(model)
    assert model.config.use_cache is False
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    mlp, mlp_calls = model.model.layers[0].mlp, []
    forward = mlp.forward

    def counted(*args, **kwargs):
        mlp_calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted  # (the recomputation runs no module hooks, so count the calls themselves)
    assert_same_step(reference, model)
    assert len(mlp_calls) == 2  # forward, then the recomputation in backward


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_offloading_gives_the_same_gradients(model_type):
    reference = tiny_model(model_type)
    model = copy.deepcopy(reference)
    offloader = offload(model)
    storages = offloaded_storages(offloader)
    assert_same_step(reference, model)
    assert offloader.offloaded_tensors > 0 and offloader.offloaded_bytes > 0
    assert offloader.restored_tensors == offloader.offloaded_tensors  # each came back exactly once
    assert offloader.prefetched_tensors > 0  # layer 0's, fetched when layer 1's backward began
    assert offloader.skipped_parameters > 0  # the weights were seen ...
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert parameter_storages.isdisjoint(storages)  # ... and none of them (nor a view) was offloaded
    assert not offloader._groups  # nothing left waiting to come back


def test_checkpointing_and_offloading_together():
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    enable_activation_checkpointing(model)
    offloader = offload(model)
    assert_same_step(reference, model)
    assert offloader.restored_tensors == offloader.offloaded_tensors
    unchecked = tiny_model("llama")
    without_checkpointing = offload(unchecked)
    train_step(unchecked, padded_batch())
    assert offloader.offloaded_bytes < without_checkpointing.offloaded_bytes


def layer_input_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Layers × tokens × hidden × dtype bytes: the checkpointed inputs of one forward."""
    config = model.config
    return len(decoder_layers(model)) * batch["input_ids"].numel() * config.hidden_size * model.dtype.itemsize


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_offloads_exactly_the_layer_inputs(reentrant):
    """Whichever of the layer's methods transformers checkpoints (``__call__`` up to 5.17, ``forward``
    since), the host gets each layer's input and nothing else, every step; the recomputation adds
    nothing. The non-reentrant case freezes the embedding as LoRA and QLoRA do (transformers then makes
    the first layer's input a leaf that requires grad); the re-entrant checkpoint needs a trained one."""
    reference = tiny_model("llama")
    batch = padded_batch()
    if not reentrant:
        reference.get_input_embeddings().requires_grad_(False)
    model = copy.deepcopy(reference)
    if reentrant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        enable_activation_checkpointing(model)
    offloader = offload(model)
    for step in (1, 2):
        assert_same_step(reference, model)
        assert offloader.offloaded_tensors == step * len(decoder_layers(model))
        assert offloader.offloaded_bytes == step * layer_input_bytes(model, batch)
        assert offloader.restored_tensors == offloader.offloaded_tensors
        reference.zero_grad(), model.zero_grad()


def test_checkpointing_enabled_after_offloading():
    """The checkpoint wrapper is installed at each forward, so the order of the two calls is free."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    offloader = offload(model)
    enable_activation_checkpointing(model)
    assert_same_step(reference, model)
    assert offloader.offloaded_bytes == layer_input_bytes(model, padded_batch())
    offloader.remove()
    assert not any(
        isinstance(layer._gradient_checkpointing_func, _OffloadingCheckpoint) for layer in model.model.layers
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["offload", "checkpoint+offload"])
def test_patched_models(checkpointing):
    """The fused loss head runs after the layers: it is never offloaded, and the gradients agree."""
    reference = fastalign.patch_model(tiny_model("qwen2"))
    model = copy.deepcopy(reference)
    assert patched_pieces(model)["loss"] == 1
    if checkpointing:
        enable_activation_checkpointing(model)
    offloader = offload(model)
    assert_same_step(reference, model)
    assert offloader.offloaded_tensors > 0
    assert offloader.restored_tensors == offloader.offloaded_tensors


@pytest.mark.parametrize("checkpointing", [False, True], ids=["offload", "checkpoint+offload"])
def test_lora_model(checkpointing):
    reference = lora(tiny_model("llama"))
    model = copy.deepcopy(reference)
    if checkpointing:
        enable_activation_checkpointing(model)
    offloader = offload(model)
    storages = offloaded_storages(offloader)
    assert_same_step(reference, model)
    assert offloader.offloaded_tensors > 0
    assert offloader.skipped_parameters > 0 or checkpointing  # (checkpointed layers save no weights of ours)
    assert {p.untyped_storage().data_ptr() for p in model.parameters()}.isdisjoint(storages)
    assert any(p.grad is not None for name, p in model.named_parameters() if "lora_" in name)


def test_remove_restores_the_model():
    model = tiny_model("llama")
    modules = [decoder_stack(model), *decoder_layers(model)]
    offloader = offload(model)
    assert decoder_stack(model)._forward_pre_hooks and all(module._forward_hooks for module in modules)
    offloader.remove()
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in modules)
    train_step(model, padded_batch())
    assert offloader.offloaded_tensors == offloader.skipped_parameters == 0


def test_tensors_under_min_bytes_stay():
    model = tiny_model("llama")
    offloader = offload(model, min_bytes=1 << 30)
    train_step(model, padded_batch())
    assert offloader.skipped_small > 0
    assert offloader.offloaded_tensors == 0


def test_cpu_tensors_are_kept_where_they_are():
    model = tiny_model("llama")
    offloader = enable_activation_offloading(model, min_bytes=0)
    train_step(model, padded_batch())
    assert offloader.kept_on_device > 0
    assert offloader.offloaded_tensors == 0


def test_a_raising_layer_leaves_no_hooks_active():
    model = tiny_model("llama")
    offloader = offload(model)

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    model.model.layers[1].mlp.forward = fail
    with pytest.raises(RuntimeError, match="boom"):
        model(**padded_batch())
    assert offloader._context is None
    packed = offloader.offloaded_tensors
    x = torch.randn(8, requires_grad=True) * 2
    (x * x).sum().backward()  # saves x, which the offloader would take if its hooks were still active
    assert offloader.offloaded_tensors == packed > 0


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_bit_identical_steps(reference: nn.Module, model: nn.Module, steps: int, after_step=None) -> None:
    """``steps`` forward/backwards of each, with equal losses and bit-identical gradients at every one."""
    batch = padded_batch()
    for step in range(1, steps + 1):
        reference.zero_grad(), model.zero_grad()
        assert torch.equal(train_step(model, batch), train_step(reference, batch))
        expected, got = gradients(reference), gradients(model)
        assert expected.keys() == got.keys() and expected
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        if after_step is not None:
            after_step(step)


def test_the_pool_holds_the_layer_inputs_and_allocates_in_the_first_step_only():
    """With checkpointing, one buffer per layer, of the layer input's size (the planner's host term),
    allocated in the first step and reused after; the gradients are bit-identical to checkpointing alone."""
    reference = tiny_model("llama")
    enable_activation_checkpointing(reference)
    model = copy.deepcopy(reference)
    offloader = offload(model)
    expected = layer_input_bytes(model, padded_batch())

    def check(step):
        assert offloader.pool.allocations == len(decoder_layers(model))
        assert offloader.pool.capacity == expected
        assert offloader.offloaded_bytes == step * expected

    assert_bit_identical_steps(reference, model, 3, check)


def test_the_pool_without_checkpointing_settles_after_the_first_step():
    """Without checkpointing a layer saves many tensors: the first step gives each its own buffer and
    frees them once they are back; the second allocates one buffer per layer of their total (in its
    forward, where a failure reaches the caller, not in the finalizer that gives a tensor back); no step
    after allocates, and the pool holds one step's tensors."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    offloader = offload(model)
    layers = len(decoder_layers(model))
    seen = {}

    def check(step):
        per_step = offloader.offloaded_tensors // step
        if step == 1:
            assert offloader.pool.allocations == per_step and offloader.pool.capacity == 0
            return
        if step == 2:
            seen["capacity"] = offloader.pool.capacity
        assert offloader.pool.allocations == per_step + layers
        assert offloader.pool.capacity == seen["capacity"]
        assert (
            offloader.offloaded_bytes // step
            <= offloader.pool.capacity
            < offloader.offloaded_bytes // step + 64 * per_step
        )

    assert_bit_identical_steps(reference, model, 3, check)


def test_the_last_layers_can_stay_on_the_device():
    reference = tiny_model("llama", num_hidden_layers=3)
    enable_activation_checkpointing(reference)
    model = copy.deepcopy(reference)
    offloader = enable_activation_offloading(model, min_bytes=0, keep_on_device=1)
    offloader._force_copy = True
    one_layer = layer_input_bytes(model, padded_batch()) // 3

    def check(step):
        assert offloader.offloaded_tensors == 2 * step and offloader.kept_in_last_layers == step
        assert offloader.pool.capacity == 2 * one_layer and offloader.pool.allocations == 2

    assert_bit_identical_steps(reference, model, 2, check)
    with pytest.raises(ValueError, match="keep_on_device"):
        enable_activation_offloading(model, keep_on_device=4)


class FakeCudart:
    """``torch.cuda.cudart()`` for CPU tests: records (un)registrations, fails with ``error`` if set."""

    def __init__(self, error: int = 0) -> None:
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, pointer, size, flags):
        if not self.error:
            self.registered.append((pointer, size))
        return self.error

    def cudaHostUnregister(self, pointer):
        self.unregistered.append(pointer)
        return 0


def test_the_pool_pins_each_buffer_once_and_unpins_what_it_replaces(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = _HostPool(pin=True, synchronize=lambda: None)
    first, give_back = pool.take(0, 1000)
    assert first.numel() == 1000 and cudart.registered == [(first.data_ptr(), 1024)]  # 64-byte aligned
    give_back()
    for _ in range(3):  # the same round again: the buffer is reused
        again, give_back = pool.take(0, 1000)
        assert again.data_ptr() == first.data_ptr()
        give_back()
    assert pool.allocations == 1
    backs = [pool.take(0, 1000)[1] for _ in range(2)]  # a larger round: one more, then one of the total
    assert pool.allocations == 2
    for give_back in backs:
        give_back()
    assert pool.allocations == 2 and pool.capacity == 0  # freed; the larger one comes with the next take
    pool.take(0, 1000)[1]()
    assert pool.allocations == 3 and pool.capacity == 2048
    (first_pointer, _), (extra_pointer, _), _ = cudart.registered
    assert cudart.unregistered == [extra_pointer, first_pointer]
    assert len(cudart.registered) == 3


def test_the_pool_goes_on_in_pageable_memory_where_pinning_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))
    pool = _HostPool(pin=True, synchronize=lambda: None)
    with pytest.warns(UserWarning, match="pinning host memory failed") as warned:
        backs = [pool.take(layer, 4096)[1] for layer in range(3)]
    assert len(warned) == 1 and not pool.pin and pool.allocations == 3
    for give_back in backs:
        give_back()


def test_offloading_that_outgrows_the_host_is_refused_before_training(monkeypatch):
    model = tiny_model("llama")
    enable_activation_checkpointing(model)
    monkeypatch.setattr(memory, "_available_host_bytes", lambda: 3 << 30)  # 3 GiB, less a 2 GiB margin
    fits = (1 << 30) // (2 * model.config.hidden_size * 4)  # tokens whose 2 layer inputs fill 1 GiB
    enable_activation_offloading(model, tokens=fits).remove()
    with pytest.raises(HostMemoryError, match=r"needs 1\.0 GiB of host memory \(2 layer inputs") as error:
        enable_activation_offloading(model, tokens=fits + 1)
    assert "\n" not in str(error.value)
    enable_activation_offloading(model, tokens=fits + 1, keep_on_device=1).remove()  # half of it: fits
    monkeypatch.setattr(memory, "_available_host_bytes", lambda: 1 << 20)
    offloader = offload(model)
    with pytest.raises(HostMemoryError):  # the pool checks each allocation as well
        model(**padded_batch())
    offloader.remove()


def test_offloading_twice_on_one_model_is_refused_until_the_first_is_removed():
    """A second offloader's hooks would sit inside the first's and never see a layer begin, so the
    checkpointed layers' inputs would silently stay on the device."""
    model = tiny_model("llama")
    enable_activation_checkpointing(model)
    first = offload(model)
    with pytest.raises(RuntimeError, match="already on for this model: remove"):
        enable_activation_offloading(model)
    first.remove()
    second = offload(model)
    model(**padded_batch()).loss.backward()
    assert second.offloaded_tensors == len(decoder_layers(model))  # one layer input each
    second.remove()


def test_the_host_check_counts_the_residual_stream_as_the_planner_does(monkeypatch):
    """Under FSDP2 with bf16 the layer inputs of an fp32 model are bf16: the host check counts what the
    planner counts (``residual_stream_bytes``), so a run the planner fits is not refused."""
    from fastalign.plan import plan_memory
    from fastalign.plan.planner import residual_stream_bytes
    from fastalign.train.policy import _residual_bytes

    model = tiny_model("llama")  # fp32 weights, as FSDP2's mixed precision leaves them until sharded
    enable_activation_checkpointing(model)
    checked = []
    monkeypatch.setattr(memory, "_check_host_memory", lambda nbytes, what: checked.append(nbytes))
    tokens = 4096
    residual = residual_stream_bytes("full", 2, True, "fp32")
    enable_activation_offloading(model, tokens=tokens, residual_bytes=residual).remove()
    plan = plan_memory(
        model.config, method="full", gpus=2, seq_len=tokens, batch_size=1, checkpointing=True,
        offload_activations=True, keep_on_device=0, bf16=True, base_dtype="fp32", suggest=False,
    )  # fmt: skip
    assert residual == 2 and checked == [plan.activations_host]

    class Config:  # what prepare_policy reads of a TrainConfig
        quantization, use_peft, bf16 = None, False, True
        model_name_or_path, torch_dtype, dtype = "tiny", "float32", "float32"

    class Ctx:
        world_size = 2

    monkeypatch.setattr("fastalign.train.policy.model_dtype", lambda config, name: torch.float32)
    assert _residual_bytes(model, Config(), Ctx()) == 2
    Ctx.world_size = 1  # one process, fp32 weights under autocast: the stream stays fp32
    assert _residual_bytes(model, Config(), Ctx()) == 4
    monkeypatch.setattr("fastalign.train.policy.model_dtype", lambda config, name: torch.float16)
    assert _residual_bytes(model, Config(), Ctx()) == 2  # fp16 weights: 2 bytes, as bf16 ones


def _page_locked(buffer: torch.Tensor) -> bool:
    """Whether CUDA holds ``buffer``'s memory page-locked. ``Tensor.is_pinned`` asks about its storage's
    first byte, which a pool buffer (a page-aligned view into a longer allocation) skips: ask about a
    tensor whose storage starts at the buffer."""
    memory = (ctypes.c_uint8 * buffer.numel()).from_address(buffer.data_ptr())
    return torch.frombuffer(memory, dtype=torch.uint8).is_pinned()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned pool and the side-stream copies need CUDA"
)
def test_cuda_checkpointing_and_offloading_step():
    """The real path: layer inputs copied to pinned pool buffers on the side stream and back, the bytes
    and the allocations as on CPU, and gradients bit-identical to checkpointing alone (eager attention:
    the same kernels in the same order on both sides)."""
    reference = tiny_model("llama", attn_implementation="eager").cuda()
    enable_activation_checkpointing(reference)
    model = copy.deepcopy(reference)
    offloader = enable_activation_offloading(model, min_bytes=0)
    batch = {name: tensor.cuda() for name, tensor in padded_batch().items()}
    expected = layer_input_bytes(model, batch)
    for step in (1, 2, 3):
        reference.zero_grad(), model.zero_grad()
        assert torch.equal(train_step(model, batch), train_step(reference, batch))
        torch.cuda.synchronize()
        assert offloader.offloaded_bytes == step * expected
        assert offloader.restored_tensors == offloader.offloaded_tensors == step * len(decoder_layers(model))
        assert offloader.pool.pin and offloader.pool.allocations == len(decoder_layers(model))
        assert offloader.pool.capacity == expected
        assert all(_page_locked(slot.buffer) for slot in offloader.pool._layers.values())
        expected_grads, grads = gradients(reference), gradients(model)
        assert expected_grads.keys() == grads.keys()
        assert all(torch.equal(grads[name], expected_grads[name]) for name in grads)
    offloader.remove()
    del model, offloader  # the pool unpins its buffers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real cudaHostRegister failure needs CUDA")
def test_cuda_work_goes_on_after_pinning_fails(monkeypatch):
    """A failed registration (here: of memory registered already) leaves CUDA's last error set; the pool
    clears it, so the next kernel does not fail with it."""
    cudart = torch.cuda.cudart()

    class Twice:
        def cudaHostRegister(self, pointer, size, flags):
            cudart.cudaHostRegister(pointer, size, flags)
            return cudart.cudaHostRegister(pointer, size, flags)  # cudaErrorHostMemoryAlreadyRegistered

        def cudaHostUnregister(self, pointer):
            return cudart.cudaHostUnregister(pointer)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Twice())
    pool = _HostPool(pin=True, synchronize=torch.cuda.synchronize)
    with pytest.warns(UserWarning, match="pinning host memory failed"):
        memory_, give_back = pool.take(0, 1 << 20)
    cudart.cudaHostUnregister(memory_.data_ptr())
    assert torch.ones(4, device="cuda").sum().item() == 4
    give_back()


def test_a_removed_offloaders_pool_is_freed_without_the_cycle_collector():
    """The pool and its offloader refer to each other: ``remove()`` lets the pool go, so its memory
    returns as soon as no offloaded tensor uses it, not at the next cycle collection."""
    import gc
    import weakref

    model = tiny_model("llama")
    enable_activation_checkpointing(model)
    offloader = offload(model)
    train_step(model, padded_batch())  # the graph is freed: every tensor came back
    pool = weakref.ref(offloader.pool)
    offloader.remove()
    gc.disable()
    try:
        assert pool() is None
    finally:
        gc.enable()
