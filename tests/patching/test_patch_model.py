"""patch_model on every supported family: same losses, logits and gradients as the original model."""

from __future__ import annotations

import copy

import pytest
import torch

import fastalign
from fastalign.builtin import TINY_MODEL_TYPES, tiny_model, tiny_tokenizer
from fastalign.patching import SUPPORTED_MODEL_TYPES, patched_pieces, shift_labels, unpatch_model
from tests.helpers import relative_error, require

#: (loss, gradients) relative tolerances of patched vs original, by dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def padded_batch(seed: int = 0):
    """Two rows of different lengths, right-padded; labels -100 on padding."""
    tokenizer = tiny_tokenizer()
    texts = ["What is 3 plus 4? The answer is 7.", "the model learns to answer"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return {**batch, "labels": labels}


def pair(model_type: str, dtype=torch.float32, **patch_options):
    original = tiny_model(model_type, dtype=dtype)
    patched = fastalign.patch_model(copy.deepcopy(original), **patch_options)
    return original, patched


def assert_same_gradients(original, patched, tolerance):
    for (name, a), (_, b) in zip(original.named_parameters(), patched.named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert b.grad is not None, name
        assert relative_error(b.grad, a.grad) <= tolerance, f"{name}: {relative_error(b.grad, a.grad):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_loss_and_gradients_match_original(model_type, dtype):
    original, patched = pair(model_type, dtype)
    pieces = patched_pieces(patched)
    assert set(pieces) == {"rms_norm", "mlp", "rope", "loss", "linear"}, pieces
    batch = padded_batch()
    expected, got = original(**batch), patched(**batch)
    assert got.logits is None  # the fused head builds no logits
    assert relative_error(got.loss, expected.loss) <= TOLERANCE[dtype]
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, TOLERANCE[dtype])


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3"])
def test_triton_kernels_inside_the_model(model_type, device):
    """The Triton kernels (on CUDA, or interpreted on CPU) inside a patched model match the original."""
    original, patched = pair(model_type, backend="triton")
    original, patched = original.to(device), patched.to(device)
    batch = {key: value.to(device) for key, value in padded_batch().items()}
    expected, got = original(**batch), patched(**batch)
    assert relative_error(got.loss, expected.loss) <= 1e-5
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, 1e-5)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_without_labels_logits_match_original(model_type):
    original, patched = pair(model_type)
    batch = padded_batch()
    del batch["labels"]
    torch.testing.assert_close(patched(**batch).logits, original(**batch).logits, rtol=1e-5, atol=1e-5)


def test_return_logits_on_request_with_softcap():
    original, patched = pair("gemma2")
    batch = padded_batch()
    expected = original(**batch)
    got = patched(**batch, return_logits=True)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss)


@pytest.mark.parametrize(
    ("model_type", "keys"),
    [
        ("gemma", {"hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"}),  # GemmaMLP: hidden_act
        ("gemma2", {"hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"}),  # hidden_activation
        ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    ],
)
def test_the_fused_mlp_computes_the_activation_the_mlp_runs(model_type, keys):
    """Gemma's MLP reads ``hidden_act``, Gemma 2's ``hidden_activation``: with both set and differing,
    the patched MLP must compute the one the module runs (its ``act_fn``), not the other."""
    original = tiny_model(model_type, **keys)
    patched = fastalign.patch_model(copy.deepcopy(original))
    assert patched_pieces(patched)["mlp"] == original.config.num_hidden_layers
    batch = padded_batch()
    expected, got = original(**batch), patched(**batch)
    assert relative_error(got.loss, expected.loss) <= TOLERANCE[torch.float32]
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, TOLERANCE[torch.float32])


def test_an_mlp_activation_without_a_kernel_stays_the_models_own(caplog):
    original = tiny_model("llama", hidden_act="relu")
    with caplog.at_level("WARNING", logger="fastalign.patching.patch"):
        patched = fastalign.patch_model(copy.deepcopy(original))
    assert "mlp" not in patched_pieces(patched) and "rms_norm" in patched_pieces(patched)
    assert [r.getMessage() for r in caplog.records if "no fused kernel" in r.getMessage()] == [
        "fastalign: activation ReLU has no fused kernel; those MLPs stay as they are"
    ]
    batch = padded_batch()
    assert relative_error(patched(**batch).loss, original(**batch).loss) <= TOLERANCE[torch.float32]


def test_num_items_in_batch_and_shift_labels():
    original, patched = pair("llama")
    batch = padded_batch()
    expected = original(**batch, num_items_in_batch=torch.tensor(40))
    got = patched(**batch, num_items_in_batch=torch.tensor(40))
    torch.testing.assert_close(got.loss, expected.loss)
    labels = batch.pop("labels")
    via_shift = patched(**batch, shift_labels=shift_labels(labels))
    torch.testing.assert_close(via_shift.loss, original(**batch, labels=labels).loss)


def test_num_items_in_batch_as_transformers_trainer_may_pass_it():
    """A fraction (transformers' Trainer divides the count by its tensor-, context- and sequence-parallel
    sizes) divides the loss as transformers does; a window without a target token counts 0, and its loss
    is 0 with zero gradients (transformers': 0/0, NaN)."""
    original, patched = pair("llama")
    batch = padded_batch()
    for count in (25.5, torch.tensor(25.5)):
        torch.testing.assert_close(
            patched(**batch, num_items_in_batch=count).loss, original(**batch, num_items_in_batch=count).loss
        )
    batch["labels"] = torch.full_like(batch["labels"], -100)
    loss = patched(**batch, num_items_in_batch=torch.tensor(0)).loss
    loss.backward()
    assert loss.item() == 0 and all(not p.grad.any() for p in patched.parameters() if p.grad is not None)
    assert original(**batch, num_items_in_batch=torch.tensor(0)).loss.isnan()  # the difference docs/ names


def test_packed_sequences_with_position_ids():
    """Two sequences packed in one row: positions restart, as padding-free collators produce."""
    original, patched = pair("qwen3")
    input_ids = torch.randint(5, 500, (1, 12))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    labels = input_ids.clone()
    labels[0, 4] = -100  # no target across the boundary
    expected = original(input_ids=input_ids, position_ids=position_ids, labels=labels)
    got = patched(input_ids=input_ids, position_ids=position_ids, labels=labels)
    torch.testing.assert_close(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, 1e-5)


def test_token_logprobs_from_the_patched_forward():
    original, patched = pair("llama")
    batch = padded_batch()
    targets = shift_labels(batch.pop("labels"))
    logits = original(**batch).logits.float() / 0.7
    expected = logits.log_softmax(-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1) * (
        targets != -100
    )
    out = patched(**batch, logprob_targets=targets, temperature=0.7, return_entropy=True)
    torch.testing.assert_close(out.token_logprobs, expected, rtol=1e-5, atol=1e-5)
    assert out.entropy.shape == targets.shape and out.logits is None and out.loss is None
    out.token_logprobs.sum().backward()
    assert patched.lm_head.weight.grad is not None


def test_mini_training_curves_match():
    """20 AdamW steps of the original and the patched model give the same loss curve."""
    original, patched = pair("llama")
    batch = padded_batch()
    curves = []
    for model in (original, patched):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(20):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0] - 0.5  # it learns
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-4, atol=1e-4)


def test_peft_lora_model():
    peft = require("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    original = peft.get_peft_model(tiny_model("qwen2"), config)
    for name, param in original.named_parameters():
        if "lora_B" in name:  # make the adapters matter
            torch.nn.init.normal_(param, std=0.02)
    patched = fastalign.patch_model(copy.deepcopy(original))
    assert patched_pieces(patched)["loss"] == 1
    batch = padded_batch()
    expected, got = original(**batch), patched(**batch)
    torch.testing.assert_close(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, 1e-5)


def test_generate_and_gradient_checkpointing_still_work():
    original, patched = pair("llama")
    prompt = tiny_tokenizer()(["What is 3 plus 4?"], return_tensors="pt")
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**prompt, **generate), original.generate(**prompt, **generate))

    batch = padded_batch()
    for model in (original, patched):
        model.gradient_checkpointing_enable()
        model.train()
        model(**batch).loss.backward()
    assert_same_gradients(original, patched, 1e-5)


def test_patch_twice_options_and_unpatch():
    model = tiny_model("mistral")
    batch = padded_batch()
    before = model(**batch).loss
    fastalign.patch_model(model)
    fastalign.patch_model(model)  # harmless
    assert patched_pieces(model) == {"rms_norm": 5, "mlp": 2, "rope": 2, "loss": 1, "linear": 14}
    fastalign.patch_model(model, rms_norm=False, loss=False, linear=False)
    assert patched_pieces(model) == {"mlp": 2, "rope": 2}
    assert model(**batch).logits is not None
    unpatch_model(model)
    assert patched_pieces(model) == {}
    assert all("forward" not in module.__dict__ for module in model.modules())
    torch.testing.assert_close(model(**batch).loss, before)


def test_skip_slower_on_cpu_leaves_the_measured_losers_the_models_own(caplog):
    """On a CPU model with backend 'auto', ``skip_slower_on_cpu`` leaves out the pieces of ``CPU_SLOWER``
    (logged, and returned by ``skipped_pieces`` with the reason); the rest is patched and the loss is the
    unpatched model's. An explicit backend, or the default, patches everything."""
    from fastalign.patching import skipped_pieces
    from fastalign.patching.patch import CPU_SLOWER

    original = tiny_model("llama", seed=0)
    model = copy.deepcopy(original)
    with caplog.at_level("INFO", logger="fastalign.patching.patch"):
        fastalign.patch_model(model, skip_slower_on_cpu=True)
    everything = {"rms_norm": 5, "mlp": 2, "rope": 2, "loss": 1, "linear": 14}
    assert skipped_pieces(model) == CPU_SLOWER and set(CPU_SLOWER) == {"rms_norm", "rope"}
    assert patched_pieces(model) == {k: v for k, v in everything.items() if k not in CPU_SLOWER}
    for piece, why in CPU_SLOWER.items():
        assert f"on CPU the model keeps its own {piece}: {why}" in caplog.text
    ids = torch.randint(3, original.config.vocab_size, (2, 12))
    torch.testing.assert_close(model(ids, labels=ids).loss, original(ids, labels=ids).loss)

    fastalign.patch_model(model, skip_slower_on_cpu=True, backend="torch")  # asked for: patched
    assert patched_pieces(model) == everything and skipped_pieces(model) == {}
    fastalign.patch_model(model)
    assert patched_pieces(model) == everything and skipped_pieces(model) == {}
    fastalign.patch_model(model, skip_slower_on_cpu=True, rms_norm=False, rope=False)  # nothing to skip
    assert skipped_pieces(model) == {}
    fastalign.patch_model(model, skip_slower_on_cpu=True)
    unpatch_model(model)
    assert patched_pieces(model) == {} and skipped_pieces(model) == {}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("linear", [True, False], ids=["linears-patched", "linears-own"])
def test_gated_mlp_down_projection_is_glu_linear(linear, autocast, monkeypatch):
    """The patched MLP's down projection is ``glu_linear`` (its [tokens, intermediate] input recomputed
    in backward, not saved: tests/kernels/test_swiglu.py) whether or not ``patch_model`` also patched
    the ``nn.Linear`` modules, under autocast too."""
    import fastalign.patching.modules as modules

    calls = []
    original_glu_linear = modules.glu_linear

    def spy(*args, **kwargs):
        calls.append(1)
        return original_glu_linear(*args, **kwargs)

    monkeypatch.setattr(modules, "glu_linear", spy)
    model = fastalign.patch_model(tiny_model("llama"), linear=linear)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**padded_batch()).loss
    loss.backward()
    assert len(calls) == model.config.num_hidden_layers


def test_patching_one_model_leaves_others_alone():
    patched, other = tiny_model("llama"), tiny_model("llama")
    fastalign.patch_model(patched)
    assert patched_pieces(other) == {}
    assert other(**padded_batch()).logits is not None


def test_unsupported_model_type_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="supported: " + ", ".join(SUPPORTED_MODEL_TYPES)):
        fastalign.patch_model(model)
    with pytest.raises(ValueError, match="causal LM"):
        fastalign.patch_model(torch.nn.Linear(2, 2))


def test_fused_loss_equals_transformers_loss_function():
    """Direct check of the head against transformers' own causal-LM loss on the same hidden states."""
    model = tiny_model("llama")
    batch = padded_batch()
    hidden = model.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    logits = model.lm_head(hidden)
    expected = model.loss_function(logits=logits, labels=batch["labels"], vocab_size=model.config.vocab_size)
    got = fastalign.linear_cross_entropy(hidden, model.lm_head.weight, shift_labels(batch["labels"]))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_torch_compile_of_the_patched_model(model_type):
    """Dynamo traces the patched model (the 'aot_eager' backend: code generation is a GPU-side check)."""
    torch._dynamo.reset()
    original, patched = pair(model_type)
    batch = padded_batch()
    expected = original(**batch)
    got = torch.compile(patched, backend="aot_eager")(**batch)
    torch.testing.assert_close(got.loss, expected.loss)
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(original, patched, 1e-5)


def test_save_pretrained_and_dtype_moves(tmp_path):
    """Patching changes no weights or config: save/load round-trips; a later .to(dtype) keeps working."""
    from transformers import AutoModelForCausalLM

    original, patched = pair("qwen2")
    patched.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = padded_batch()
    torch.testing.assert_close(reloaded(**batch).loss, original(**batch).loss)
    patched.to(torch.bfloat16)
    original.to(torch.bfloat16)
    assert relative_error(patched(**batch).loss, original(**batch).loss) <= TOLERANCE[torch.bfloat16]


def test_return_dict_false_returns_the_tuple_with_the_loss_first():
    """``return_dict=False`` with labels: a tuple (loss, ...) as transformers returns, not a crash."""
    original, patched = pair("llama")
    batch = padded_batch()
    for use_cache in (True, False):  # the same places as transformers': (loss, logits[, cache])
        expected = original(**batch, return_dict=False, use_cache=use_cache)
        got = patched(**batch, return_dict=False, use_cache=use_cache)
        assert isinstance(got, tuple) and isinstance(expected, tuple) and len(got) == len(expected)
        assert relative_error(got[0], expected[0]) <= 1e-5
        assert relative_error(got[1], expected[1]) <= 1e-5
    got = patched(**batch, return_dict=False, use_cache=False, return_logits=False)  # asked: no logits
    assert len(got) == 1
    got = patched(input_ids=batch["input_ids"], return_dict=False)  # no labels: the original forward
    assert isinstance(got, tuple) and got[0].shape == (*batch["input_ids"].shape, original.config.vocab_size)


def test_ignore_index_reaches_the_loss():
    """``ignore_index`` of the forward skips those targets, as transformers' ForCausalMLoss does."""
    original, patched = pair("llama")
    batch = padded_batch()
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    expected, got = original(**batch, ignore_index=0).loss, patched(**batch, ignore_index=0).loss
    assert relative_error(got, expected) <= 1e-5
    unpadded = patched(**{**batch, "labels": padded_batch()["labels"]}).loss
    assert relative_error(got, unpadded) <= 1e-5  # padding with 0 and ignoring 0 = padding with -100


@pytest.mark.parametrize(
    "head",
    ["lora", "lora_dropout", "dora", "modules_to_save"],
)
def test_peft_adapters_on_the_lm_head_are_in_the_loss(head):
    """LoRA on lm_head is in the fused loss exactly (its features and weight join the head's, dropout
    included), and A and B get their gradients; DoRA runs the head's own forward; modules_to_save
    trains the copy."""
    peft = require("peft")
    options = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "lm_head"])
    if head == "lora_dropout":
        options["lora_dropout"] = 0.3
    if head == "dora":
        options["use_dora"] = True
    if head == "modules_to_save":
        options.update(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    original = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(**options))
    with torch.no_grad():
        for name, param in original.named_parameters():
            if "modules_to_save" in name:  # the trainable copy differs from the frozen original
                param.add_(0.05)
    patched = fastalign.patch_model(copy.deepcopy(original))
    batch = padded_batch()
    original.train(), patched.train()
    torch.manual_seed(0)
    expected = original(**batch).loss
    torch.manual_seed(0)
    got = patched(**batch).loss
    assert relative_error(got, expected) <= 1e-5
    expected.backward()
    got.backward()
    assert_same_gradients(original, patched, 1e-4)
    if head != "modules_to_save":
        assert patched.base_model.model.lm_head.lora_A["default"].weight.grad is not None


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_hooks_on_the_head_and_the_down_projection_still_run(hook):
    """A hooked LM head or MLP down projection is called, not fused past: its hooks see (and may change)
    what they would unpatched, so the loss equals the unpatched model's with the same hooks."""
    model = tiny_model("llama")
    batch = padded_batch()
    patched = fastalign.patch_model(copy.deepcopy(model))
    calls = []

    def on_forward(module, args, output):
        calls.append(type(module).__name__)
        return output * 0.5

    def on_pre(module, args):
        calls.append(type(module).__name__)
        return (args[0] * 0.5,)

    for each in (model, patched):
        for module in (each.lm_head, each.model.layers[0].mlp.down_proj):
            if hook == "forward":
                module.register_forward_hook(on_forward)
            else:
                module.register_forward_pre_hook(on_pre)
    expected = model(**batch).loss
    calls.clear()
    loss = patched(**batch).loss
    assert calls == ["Linear", "Linear"]  # the down projection, then the head
    assert relative_error(loss, expected) <= 1e-5


def test_accelerate_device_map_with_offloaded_modules(tmp_path):
    """A model dispatched by accelerate (modules offloaded to the CPU and to disk, weights on the meta
    device between calls): the patch replaces the hooked modules' ``_old_forward``, so the hooks still
    load the weights around each call; unpatching restores the hooked forward."""
    require("accelerate")
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "disk",
        "lm_head": "cpu",
    }
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert model.model.norm.weight.is_meta and hasattr(model.model.norm, "_hf_hook")
    batch = padded_batch()
    expected = model(**batch).loss
    hooked = {name: module.forward for name, module in model.named_modules() if hasattr(module, "_hf_hook")}
    fastalign.patch_model(model)
    assert patched_pieces(model)["rms_norm"] == 5
    assert all(model.get_submodule(name).forward == forward for name, forward in hooked.items())
    assert relative_error(model(**batch).loss, expected) <= 1e-5
    unpatch_model(model)
    assert patched_pieces(model) == {}
    norm = model.model.norm
    assert norm._old_forward.__func__ is type(norm).forward
    assert relative_error(model(**batch).loss, expected) <= 1e-5


class _WrappedHead(torch.nn.Module):
    """A head that is not a plain linear (as a DoRA or quantized one): the patched forward builds its
    logits and divides their cross-entropy itself."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return self.linear(hidden)


def test_a_head_that_builds_logits_divides_as_the_fused_one():
    """Before: num_items_in_batch 0 gave NaN and a negative count a negative loss there."""
    original, patched = pair("llama")
    patched.lm_head = _WrappedHead(patched.lm_head)
    batch = padded_batch()
    torch.testing.assert_close(
        patched(**batch, num_items_in_batch=25.5).loss, original(**batch, num_items_in_batch=25.5).loss
    )
    with pytest.raises(ValueError, match="num_items_in_batch must be a finite count >= 0"):
        patched(**batch, num_items_in_batch=torch.tensor(0))  # targets to count, none counted
    with pytest.raises(ValueError, match="num_items_in_batch must be a count"):
        patched(**batch, num_items_in_batch=-3)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    assert patched(**batch, num_items_in_batch=torch.tensor(0)).loss.item() == 0
    assert patched(**batch).loss.item() == 0


def test_return_dict_false_places_a_mixture_of_experts_outputs_as_transformers():
    """MoeCausalLMOutputWithPast's tuple has the router's loss second: (loss, aux_loss, logits, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
        output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config)
    patched = fastalign.patch_model(copy.deepcopy(original))
    ids = torch.randint(0, 64, (2, 8))
    expected = original(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
    got = patched(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
    assert len(got) == len(expected) == 4
    for ours, theirs in zip(got[:3], expected[:3], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
