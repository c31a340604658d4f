"""The model and LoRA options users reach for, with TRL's / transformers' / peft's names and meaning:
``dtype``, ``attn_implementation`` and ``model_init_kwargs`` load the policy and its reference as
``from_pretrained`` would; ``tf32`` is never silently ignored; ``use_rslora``, ``use_dora`` and
``lora_modules_to_save`` build the LoraConfig TRL builds, train exactly what peft trains (through the
fused head too), and ``fastalign merge`` merges them into a model with the adapter model's logits."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.train.config import ConfigError, TrainConfig, check_config, load_config, model_option
from fastalign.train.distributed import DistributedContext
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.merge import merge_adapter
from fastalign.train.policy import load_frozen_model, model_dtype, prepare_policy, set_tf32
from fastalign.train.run import run_training
from tests.helpers import require

CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
IDS = torch.tensor([[1, 17, 42, 99, 7, 300, 12, 5]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A local tiny Llama checkpoint (fp32 safetensors + tokenizer): loaded as a skeleton and streamed."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def policy(name: str, needs_fused_head: bool = True, **options) -> torch.nn.Module:
    """The policy a run with ``options`` trains, loaded as ``run_training`` loads it, on the CPU."""
    config = TrainConfig(model_name_or_path=str(name), **options)
    check_config(config)
    torch.manual_seed(config.seed)  # as run_training seeds: peft draws LoRA's A of a filled model from it
    model, _ = load_model_and_tokenizer(name, None, CPU.device, materialize=False)
    return prepare_policy(model, config, CPU, needs_fused_head=needs_fused_head)


# --- config -------------------------------------------------------------------------------------------


def test_defaults_are_trls():
    """Unset, the weights load in fp32 (TRL's ModelConfig and create_model_from_path default, not
    transformers 5's checkpoint dtype) with transformers' default attention; the LoRA options are off."""
    require("trl")
    from trl import ModelConfig

    trl, ours = ModelConfig(), TrainConfig()
    assert model_dtype(ours, "tiny-llama") == getattr(torch, trl.dtype) == torch.float32
    assert ours.attn_implementation is trl.attn_implementation is None
    for key in ("use_rslora", "use_dora", "lora_modules_to_save"):
        assert getattr(ours, key) == getattr(trl, key)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dtype": "bf16"}, "config key 'dtype' must be one of auto, bfloat16, float16, float32"),
        ({"attn_implementation": "flash"}, "config key 'attn_implementation' must be one of eager"),
        (
            {"dtype": "float32", "model_init_kwargs": {"dtype": "bfloat16"}},
            "bfloat16', but dtype is 'float32'",
        ),
        ({"model_init_kwargs": {"torch_dtype": "half"}}, "torch_dtype: must be one of auto, bfloat16"),
        ({"model_init_kwargs": {"trust_remote_code": True}}, "never runs a checkpoint's own code"),
        ({"model_init_kwargs": {"device_map": "auto"}}, "places the model itself"),
        ({"model_init_kwargs": {"revision": "v2"}}, "set model_revision"),
        ({"model_init_kwargs": {"rope_theta": 1e6}}, "rope_theta: fastalign takes dtype, torch_dtype"),
        ({"use_rslora": True}, "config key 'use_rslora' (True) is a LoRA option: it needs use_peft: true"),
        ({"lora_modules_to_save": ["lm_head"]}, "'lora_modules_to_save' (['lm_head']) is a LoRA option"),
        ({"use_peft": True, "lora_modules_to_save": []}, "must be a non-empty list of module names or null"),
        (
            {"use_peft": True, "use_dora": True, "quantization": "nf4"},
            "'use_dora' cannot go with quantization",
        ),
        ({"attn_implementation": "flash_attention_2"}, "computes in bf16 or fp16 only"),
        ({"dtype": "float16", "fp16": True}, "gradient scaler cannot unscale fp16 gradients"),
    ],
)
def test_options_that_cannot_work_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=r"^config key") as error:
        check_config(TrainConfig(**options))
    assert message in str(error.value)


def test_model_init_kwargs_give_dtype_and_attention_once(tmp_path):
    """TRL's model_init_kwargs: dtype (or transformers' older torch_dtype) and attn_implementation are
    the keys' own values; the options fastalign handles itself are accepted with the value it uses."""
    (tmp_path / "run.yaml").write_text(
        "model_init_kwargs: {torch_dtype: bfloat16, attn_implementation: eager, device_map: null,\n"
        "  trust_remote_code: false, use_cache: false}\nattn_implementation: eager\n"
    )
    config = load_config(tmp_path / "run.yaml")
    assert (model_option(config, "dtype"), model_option(config, "attn_implementation")) == (
        "bfloat16",
        "eager",
    )
    flags = load_config(overrides=["--model_init_kwargs", '{"dtype": "float16"}'])
    assert model_option(flags, "dtype") == "float16" and model_dtype(flags, "tiny-llama") == torch.float16


# --- dtype, attention, tf32 ---------------------------------------------------------------------------


def test_dtype_loads_policy_and_reference_as_from_pretrained(checkpoint):
    """The streamed skeleton filled in bf16 holds what from_pretrained(dtype=bfloat16) holds: the same
    tensors in the same dtypes (RoPE's frequencies stay fp32); the frozen reference loads the same way.
    "auto" takes the checkpoint's declared dtype."""
    expected = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    config = TrainConfig(model_name_or_path=str(checkpoint), dtype="bfloat16")
    for model in (policy(checkpoint, dtype="bfloat16"), load_frozen_model(str(checkpoint), config, CPU)):
        state, reference = model.state_dict(), expected.state_dict()
        assert state.keys() == reference.keys()
        for name, tensor in reference.items():
            assert state[name].dtype == tensor.dtype, name
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    bf16_checkpoint = checkpoint.parent / "bf16"
    expected.save_pretrained(bf16_checkpoint)
    tiny_tokenizer().save_pretrained(bf16_checkpoint)
    assert model_dtype(TrainConfig(dtype="auto"), str(bf16_checkpoint)) == torch.bfloat16
    assert next(policy(bf16_checkpoint, dtype="auto").parameters()).dtype == torch.bfloat16


def test_attn_implementation_is_the_one_that_runs(checkpoint):
    """The kernel asked for is the model's (config._attn_implementation, which every attention layer
    dispatches on), for the policy and its reference, and its outputs are from_pretrained's with it."""
    eager = policy(checkpoint, needs_fused_head=False, attn_implementation="eager")
    config = TrainConfig(
        model_name_or_path=str(checkpoint), model_init_kwargs={"attn_implementation": "eager"}
    )
    reference = load_frozen_model(str(checkpoint), config, CPU)
    expected = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    for model in (eager, reference):
        assert model.config._attn_implementation == "eager"
        attention = model.model.layers[0].self_attn
        assert attention.config._attn_implementation == "eager"
    torch.testing.assert_close(eager(input_ids=IDS).logits, expected(input_ids=IDS).logits)
    assert policy(checkpoint).config._attn_implementation == "sdpa"  # unset: transformers' default


@pytest.mark.parametrize(
    "attention, message",
    [
        ("flash_attention_2", "needs the flash-attn package and a CUDA GPU"),
        ("flash_attention_3", "needs the flash-attn-3 package and a CUDA GPU"),
        ("flex_attention", "flex attention has no CPU backward"),
    ],
)
def test_an_attention_kernel_that_cannot_run_here_is_a_config_error(attention, message):
    if attention.startswith("flash") and torch.cuda.is_available():
        pytest.skip("a CUDA machine may have the package")
    with pytest.raises(ConfigError, match=f"^config key 'attn_implementation' \\('{attention}'\\)") as error:
        policy("tiny-llama", attn_implementation=attention, bf16=True)
    assert message in str(error.value)


def test_tf32_is_never_silently_ignored(monkeypatch):
    """tf32: true needs an Ampere+ CUDA GPU (an error on this machine); false sets IEEE fp32 matmuls, as
    transformers' enable_tf32(False); null leaves torch's setting."""
    monkeypatch.setattr(torch.backends, "fp32_precision", torch.backends.fp32_precision)  # restored after
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        set_tf32(True)
        assert torch.backends.fp32_precision == "tf32"
    else:
        with pytest.raises(ConfigError, match=r"^config key 'tf32' needs a CUDA GPU of the Ampere"):
            policy("tiny-llama", tf32=True)
    set_tf32(None)
    before = torch.backends.fp32_precision
    assert torch.backends.fp32_precision == before
    set_tf32(False)
    assert torch.backends.fp32_precision == "ieee"


# --- LoRA: rslora, DoRA, modules_to_save ---------------------------------------------------------------

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


def test_lora_config_is_trls():
    """The adapter fastalign adds is the LoraConfig TRL's get_peft_config builds from the same options."""
    require("trl")
    from trl import ModelConfig, get_peft_config

    model = policy("tiny-llama", **LORA, use_rslora=True, use_dora=True, lora_modules_to_save=["lm_head"])
    ours = model.peft_config["default"]
    trl = get_peft_config(
        ModelConfig(
            use_peft=True,
            lora_r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            use_rslora=True,
            use_dora=True,
            lora_modules_to_save=["lm_head"],
        )
    )
    for key in ("r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "modules_to_save", "task_type"):
        assert getattr(ours, key) == getattr(trl, key), key
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / 4**0.5)  # rank-stabilized: alpha/√r
    plain = policy("tiny-llama", **LORA).base_model.model.model.layers[0].self_attn.q_proj
    assert plain.scaling["default"] == pytest.approx(8 / 4)


def test_dora_magnitude_of_a_streamed_checkpoint_is_peft_s(checkpoint):
    """DoRA's magnitude starts as the norm of each base weight row: on a streamed checkpoint the adapter is
    added once the weights are in, so it is what peft computes on the from_pretrained model."""
    model = policy(checkpoint, **LORA, use_dora=True)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = peft.get_peft_model(base, model.peft_config["default"])
    magnitudes = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(magnitudes) == 14  # 7 linear layers × 2 decoder layers
    for name, param in expected.named_parameters():
        if name in magnitudes:
            torch.testing.assert_close(magnitudes[name], param)


def _trained(model) -> dict[str, torch.Tensor]:
    """Gradient of each parameter after one fused-head loss backward (None where it got none)."""
    model(input_ids=IDS, labels=IDS).loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize(
    "options, trains",
    [
        ({"use_rslora": True}, ("lora_A", "lora_B")),
        ({"use_dora": True}, ("lora_A", "lora_B", "lora_magnitude_vector")),
        ({"lora_modules_to_save": ["lm_head"]}, ("lora_A", "lora_B", "lm_head.modules_to_save.default")),
        ({"lora_modules_to_save": ["embed_tokens"]}, ("lora_A", "lora_B", "embed_tokens.modules_to_save")),
    ],
)
def test_one_step_reaches_exactly_what_the_option_trains(checkpoint, options, trains):
    """Through the fused loss head, the gradient reaches the parameters peft trains with the option (the
    trained copy of a modules_to_save module, never its original), and equals the gradient of the
    unpatched peft model's own loss; every other parameter is frozen."""
    fused = _trained(policy(checkpoint, **LORA, **options))
    reference = _trained(
        policy(checkpoint, needs_fused_head=False, use_liger_kernel=False, **LORA, **options)
    )
    assert fused.keys() == reference.keys()
    for name, grad in fused.items():
        assert (grad is not None) == any(part in name for part in trains), name
        if grad is not None:
            assert grad.abs().sum() > 0 or "lora_A" in name, name  # A's is 0 while B starts at 0
            torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)


def test_modules_to_save_under_the_adapter_disabled_reference():
    """With the adapters off (the LoRA reference) the fused head reads the original head, not the copy."""
    model = policy("tiny-llama", **LORA, lora_modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(2)
        targets = torch.roll(IDS, -1, 1)
        trained = model(input_ids=IDS, logprob_targets=targets).token_logprobs
        with model.disable_adapter():
            disabled = model(input_ids=IDS, logprob_targets=targets).token_logprobs
    base = tiny_model("llama")
    expected = torch.log_softmax(base(input_ids=IDS).logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(disabled, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(trained, disabled)


def test_modules_to_save_checks_names_and_keeps_tied_embeddings_tied():
    with pytest.raises(ConfigError, match=r"^config key 'lora_modules_to_save': 'lm_hed' names no module"):
        policy("tiny-llama", **LORA, lora_modules_to_save=["lm_hed"])
    inner = policy("tiny-qwen2", **LORA, lora_modules_to_save=["lm_head"]).base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # peft's ensure_weight_tying
    assert inner.lm_head.weight.requires_grad


# --- end to end ---------------------------------------------------------------------------------------


def run_config(output_dir: Path, **options) -> TrainConfig:
    return TrainConfig(
        output_dir=str(output_dir),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        max_length=64,
        loss_curve_png=False,
        **options,
    )


def test_run_with_model_options(checkpoint, tmp_path):
    """A DPO run (policy and frozen reference) from a local checkpoint in bf16 with eager attention,
    given as TRL's model_init_kwargs: it trains and exports bf16 weights."""
    kwargs = {"dtype": "bfloat16", "attn_implementation": "eager", "device_map": None, "use_cache": False}
    out = run_training(
        run_config(tmp_path, model_name_or_path=str(checkpoint), model_init_kwargs=kwargs, bf16=True), "dpo"
    )
    saved = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(saved.parameters()).dtype == torch.bfloat16
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert not torch.equal(saved.lm_head.weight, original.lm_head.weight)  # it trained


def test_run_with_tf32_on_a_machine_without_it_fails_before_training(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    with pytest.raises(ConfigError, match=r"^config key 'tf32'"):
        run_training(run_config(tmp_path, tf32=True), "sft")


@pytest.mark.parametrize(
    "options",
    [{"use_rslora": True}, {"use_dora": True}, {"lora_modules_to_save": ["lm_head", "embed_tokens"]}],
    ids=["rslora", "dora", "modules_to_save"],
)
def test_run_and_merge_with_lora_options(checkpoint, tmp_path, options):
    """An SFT run with each LoRA option saves an adapter peft reloads with it, and ``fastalign merge``
    gives a plain model whose logits are the adapter model's."""
    out = run_training(
        run_config(tmp_path / "run", model_name_or_path=str(checkpoint), **LORA, **options), "sft"
    )
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    adapter = peft.PeftModel.from_pretrained(base, out).eval()
    saved = adapter.peft_config["default"]
    assert (saved.use_rslora, saved.use_dora) == (
        options.get("use_rslora", False),
        options.get("use_dora", False),
    )
    assert set(saved.modules_to_save or ()) == set(options.get("lora_modules_to_save", ()))
    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(out), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = adapter(input_ids=IDS).logits
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected, rtol=1e-4, atol=1e-5)
        with adapter.disable_adapter():
            assert not torch.allclose(expected, adapter(input_ids=IDS).logits, atol=1e-4)  # it trained


def test_merge_keeps_the_runs_tokenizer_and_the_checkpoints_dtype(tmp_path):
    """A bf16 checkpoint merges into bf16 by default (the weights were loaded in fp32, which once made
    the merge read fp32 as "the checkpoint's dtype"), and the merged model carries the EOS, PAD and chat
    template the run trained with, not the base's."""
    checkpoint = tmp_path / "bf16-llama"
    tiny_model("llama", seed=3, dtype=torch.bfloat16).save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    options = dict(eos_token="<|im_end|>", pad_token="<|bos|>", chat_template_path=str(template))
    out = run_training(
        run_config(tmp_path / "run", model_name_or_path=str(checkpoint), **LORA, **options), "sft"
    )
    merged = merge_adapter(out)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|bos|>")
    assert tokenizer.chat_template == template.read_text()
    assert (model.config.eos_token_id, model.config.pad_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert model.generation_config.eos_token_id[0] == tokenizer.eos_token_id


def test_a_reward_models_adapter_merges_into_a_sequence_classifier(tmp_path):
    """peft's SEQ_CLS adapter (a reward run) goes on a sequence-classification base: the merged model
    scores as the adapter model does (it was refused as "an adapter from another model")."""
    from transformers import AutoModelForSequenceClassification

    from fastalign.train.loading import load_model_and_tokenizer

    out = run_training(run_config(tmp_path / "run", **LORA), "reward")
    merged = AutoModelForSequenceClassification.from_pretrained(
        merge_adapter(out), dtype=torch.float32
    ).eval()
    base, _ = load_model_and_tokenizer("tiny-llama", task="sequence_classification")
    adapter = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        expected = adapter(input_ids=IDS).logits
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected, rtol=1e-4, atol=1e-5)


def test_lora_on_a_tied_embedding_of_a_streamed_checkpoint_is_one_line(tmp_path):
    """peft wraps a tied model's head with its embedding (weight tying): the streamed loader ties the base
    layers' weights (it set a wrapper's ``weight`` and raised a KeyError), then refuses the embedding
    adapter it cannot initialize layer by layer, naming the key."""
    checkpoint = tmp_path / "tied-qwen2"
    model = tiny_model("qwen2", seed=3)
    assert model.config.tie_word_embeddings
    model.save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    options = dict(LORA, lora_target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"lora_embedding_A.*check lora_target_modules") as caught:
        run_training(run_config(tmp_path / "run", model_name_or_path=str(checkpoint), **options), "sft")
    assert "\n" not in str(caught.value)
