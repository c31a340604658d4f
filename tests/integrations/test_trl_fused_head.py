"""``fastalign.integrations.trl.enable()``: TRL 1.16's own trainers, one step each on a tiny fp32 model,
give the same loss, gradients of every trainable parameter and logged metrics with fastalign serving
their fused LM head as without, and fastalign's kernel is what ran; another TRL protocol keeps TRL's
head, with one warning."""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch

import fastalign
from fastalign.builtin import (
    digit_ratio,
    tiny_model,
    tiny_preference_rows,
    tiny_prompt_rows,
    tiny_sft_rows,
    tiny_tokenizer,
)
from fastalign.integrations import trl as integration
from tests.helpers import require

# the module, not the op that fastalign.ops exports under the same name
lce = importlib.import_module("fastalign.ops.linear_cross_entropy")
require("trl")
import datasets  # noqa: E402  (after the skip when TRL is missing)
import trl  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl.kernels import chunked_logprob  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

SETUPS = {
    "plain": {},
    # LoRA on a patched model with gradient checkpointing: the head sees peft's base model and the
    # checkpointed backbone's hidden states
    "lora-patched-checkpointed": {"lora": True, "patch": True, "gradient_checkpointing": True},
    # docs/trl.md's drop-in: integrations.trl.patch_model (on CPU the RMSNorms and RoPE stay the model's)
    "patched-for-trl": {"patch": "trl"},
}


@pytest.fixture(autouse=True)
def trl_own_head_after():
    yield
    integration.disable()


@pytest.fixture
def calls(monkeypatch):
    """How often each side's kernel ran: fastalign's per-token head and TRL's chunked one."""
    counts = {"fastalign": 0, "trl": 0}
    fastalign_function, trl_forward = lce.TokenwiseFunction, chunked_logprob.ChunkedLogProbFunction.forward

    class CountingTokenwise:
        @staticmethod
        def apply(*args):
            counts["fastalign"] += 1
            return fastalign_function.apply(*args)

    @functools.wraps(trl_forward)  # keeps the signature enable() checks
    def counting_forward(*args, **kwargs):
        counts["trl"] += 1
        return trl_forward(*args, **kwargs)

    monkeypatch.setattr(lce, "TokenwiseFunction", CountingTokenwise)
    monkeypatch.setattr(chunked_logprob.ChunkedLogProbFunction, "forward", staticmethod(counting_forward))
    return counts


class GradientsBeforeStep(TrainerCallback):
    """The gradients of the trainable parameters, taken just before the optimizer uses them."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def one_step(kind: str, tmp_path, *, lora=False, patch=False, gradient_checkpointing=False):
    """The first logged row and the gradients of one step of TRL's ``kind`` trainer on a tiny llama."""
    config, trainer_class = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer),
    }[kind]
    rows = {"sft": tiny_sft_rows, "dpo": tiny_preference_rows, "grpo": tiny_prompt_rows}[kind](4, seed=1)
    # GRPO samples 2 completions of 8 tokens per prompt, at a temperature its fused head divides by
    lengths = (
        {"max_completion_length": 8, "num_generations": 2, "temperature": 0.7}
        if kind == "grpo"
        else {"max_length": 64}
    )
    model = tiny_model("llama", seed=0)
    if patch == "trl":
        integration.patch_model(model)
        assert {"rms_norm", "rope"}.isdisjoint(fastalign.patching.patched_pieces(model))
        assert set(fastalign.patching.skipped_pieces(model)) == {"rms_norm", "rope"}
    elif patch:
        fastalign.patch_model(model)
    extra = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
    elif kind == "dpo":
        extra["ref_model"] = tiny_model("llama", seed=1)
    if kind == "grpo":
        extra["reward_funcs"] = [digit_ratio]
    args = config(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        report_to=[],
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        gradient_checkpointing=gradient_checkpointing,
        **lengths,
    )
    grads = GradientsBeforeStep()
    trainer = trainer_class(
        model=model,
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list(rows),
        callbacks=[grads],
        **extra,
    )
    trainer.train()
    return trainer.state.log_history[0], grads.grads


def assert_same_step(ours, theirs):
    (our_log, our_grads), (their_log, their_grads) = ours, theirs
    assert our_log.keys() == their_log.keys()
    for key, value in their_log.items():
        if key == "step_time":  # GRPO logs the wall time of its step
            continue
        assert math.isclose(our_log[key], value, rel_tol=1e-5, abs_tol=1e-6), (key, our_log[key], value)
    assert our_grads.keys() == their_grads.keys() and their_grads
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_a_trl_step_is_the_same_with_fastalign_serving_the_fused_head(kind, setup, tmp_path, calls):
    require("peft")
    theirs = one_step(kind, tmp_path / "trl", **SETUPS[setup])
    assert calls == {"fastalign": 0, "trl": calls["trl"]} and calls["trl"] > 0
    calls["trl"] = 0

    assert integration.enable()
    ours = one_step(kind, tmp_path / "fastalign", **SETUPS[setup])
    assert calls["fastalign"] > 0 and calls["trl"] == 0
    assert_same_step(ours, theirs)
    expected = {
        "sft": ("mean_token_accuracy", "entropy"),
        "dpo": ("logits/chosen", "mean_token_accuracy", "entropy"),
        "grpo": ("entropy", "reward"),
    }
    assert set(expected[kind]) <= ours[0].keys()


def trl_head_call(function, outputs, weight_dtype=torch.float32, tokens=24, **options):
    """``function`` called as TRL's fused head calls it, on random inputs; outputs and input gradients."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 16, generator=generator).requires_grad_()
    weight = torch.randn(300, 16, generator=generator).to(weight_dtype).requires_grad_()
    bias = torch.randn(300, generator=generator).requires_grad_()
    targets = torch.randint(0, 300, (tokens,), generator=generator)
    targets[::2] = (hidden @ weight.float().T + bias).argmax(-1)[::2]  # some top-1 hits
    args = {
        "temperature": 0.7,
        "chunk_size": 128,
        "final_logit_softcapping": 30.0,
        "logit_scale": 0.5,
        **options,
    }
    result = function.apply(hidden, weight, bias, targets, *args.values(), outputs)
    if tokens == 0:
        return result, ()
    loss = result[0].sum() + (0.3 * result[1].sum() if result[1] is not None else 0)
    return result, torch.autograd.grad(loss, (hidden, weight, bias))


@pytest.mark.parametrize(
    "case",
    [
        {"outputs": ("log_probs", "entropy", "mean_logits", "is_top1")},
        {"outputs": ("log_probs",), "final_logit_softcapping": None, "logit_scale": 1.0, "temperature": 1.0},
        # cast_lm_head_to_fp32: fp32 hidden states with a bf16 head, outside autocast
        {"outputs": ("log_probs", "entropy"), "weight_dtype": torch.bfloat16},
        # what fastalign leaves to TRL: WPO's log Σp² and an all-masked batch
        {"outputs": ("log_probs", "log_sum_sq_probs")},
        {"outputs": ("log_probs", "entropy"), "tokens": 0},
    ],
)
def test_the_head_function_answers_trl_protocol_as_trl_does(case):
    theirs, their_grads = trl_head_call(chunked_logprob.ChunkedLogProbFunction, **case)
    assert integration.enable()
    ours, our_grads = trl_head_call(integration.FusedLogProbs, **case)
    for name, mine, expected in zip(
        ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), ours, theirs, strict=True
    ):
        assert (mine is None) == (expected is None), name
        if expected is not None:
            assert mine.dtype == expected.dtype and mine.shape == expected.shape, name
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=2e-5, msg=name)
    if "is_top1" in case["outputs"]:
        assert ours[4].any() and not ours[4].all()
    for mine, expected in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("mismatch", ["version", "signature"])
def test_another_trl_protocol_keeps_trl_head_with_one_warning(mismatch, monkeypatch, calls, tmp_path):
    monkeypatch.setattr(integration, "_warned", False)
    if mismatch == "version":
        monkeypatch.setattr(trl, "__version__", "1.17.0")
    else:

        class Changed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, logit_scale, outputs):
                raise AssertionError("never called here")

        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Changed)
    untouched = trl_utils._ChunkedLogProbFunction
    with pytest.warns(UserWarning, match="keeps its own kernels"):
        assert not integration.enable()
    assert not integration.enable()  # no second warning: pytest's filterwarnings=error would fail it
    assert trl_utils._ChunkedLogProbFunction is untouched
    if mismatch == "version":
        one_step("sft", tmp_path)
        assert calls["fastalign"] == 0 and calls["trl"] > 0
