"""``fastalign.integrations.trl.enable()``: TRL 1.16's own trainers, one step each on a tiny fp32 model,
give the same loss, gradients of every trainable parameter and logged metrics with fastalign serving
their fused LM head as without, and fastalign's kernel is what ran; another TRL protocol keeps TRL's
head, with one warning."""

from __future__ import annotations

import functools
import importlib
import math
from pathlib import Path

import pytest
import torch

import fastalign
from fastalign.builtin import (
    digit_ratio,
    tiny_kto_rows,
    tiny_model,
    tiny_preference_rows,
    tiny_prompt_rows,
    tiny_sft_rows,
    tiny_tokenizer,
)
from fastalign.integrations import trl as integration
from fastalign.integrations.generate import serve_generate
from fastalign.ops import head_workspace
from tests import torchrun
from tests.helpers import require

# the module, not the op that fastalign.ops exports under the same name
lce = importlib.import_module("fastalign.ops.linear_cross_entropy")
require("trl")
import datasets  # noqa: E402  (after the skip when TRL is missing)
import trl  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import kernels as trl_kernels  # noqa: E402
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


def one_step(kind: str, tmp_path, *, lora=False, patch=False, gradient_checkpointing=False, **options):
    """The first logged row and the gradients of one step of TRL's ``kind`` trainer on a tiny llama;
    ``options``: more of its config's (``generation_kwargs``, ...), and ``serve_generate`` (True: the
    model's ``generate`` served by ``fastalign.integrations.generate``)."""
    serve = options.pop("serve_generate", False)
    config, trainer_class = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "kto": (trl.KTOConfig, trl.KTOTrainer),
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer),
        "rloo": (trl.RLOOConfig, trl.RLOOTrainer),
    }[kind]
    rows = {
        "sft": tiny_sft_rows,
        "dpo": tiny_preference_rows,
        "kto": tiny_kto_rows,
        "grpo": tiny_prompt_rows,
        "rloo": tiny_prompt_rows,
    }[kind](4, seed=1)
    # GRPO and RLOO sample 2 completions of 8 tokens per prompt, at a temperature their fused head divides
    # by; RLOO without its KL term (beta 0: no reference model)
    lengths = (
        {"max_completion_length": 8, "num_generations": 2, "temperature": 0.7}
        if kind in ("grpo", "rloo")
        else {"max_length": 64}
    )
    if kind == "rloo":
        lengths["beta"] = 0.0
    lengths |= {key: options.pop(key) for key in list(lengths) if key in options}
    model = tiny_model("llama", seed=0)
    if patch == "trl":
        integration.patch_model(model)
        assert {"rms_norm", "rope"}.isdisjoint(fastalign.patching.patched_pieces(model))
        assert set(fastalign.patching.skipped_pieces(model)) == {"rms_norm", "rope"}
    elif patch:
        fastalign.patch_model(model)
    if serve:
        serve_generate(model)
    extra = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
    elif kind in ("dpo", "kto"):
        extra["ref_model"] = tiny_model("llama", seed=1)
    if kind in ("grpo", "rloo"):
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
        **options,
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
@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "grpo", "rloo"])
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
        "kto": ("logits/chosen", "logits/rejected", "kl", "entropy"),
        "grpo": ("entropy", "reward"),
        "rloo": ("entropy", "reward"),
    }
    assert set(expected[kind]) <= ours[0].keys()


@pytest.mark.slow
def test_under_fsdp2_the_served_head_gives_trls_outputs_and_gradients():
    """Sharded as accelerate's FSDP2 plugin shards a model for TRL (each layer, then the root), in 2
    processes: the same outputs and gradients of every sharded parameter with fastalign's head as with
    TRL's (``trl_fsdp_worker.py``)."""
    torchrun.run_two_processes(Path(__file__).with_name("trl_fsdp_worker.py"), timeout=300)


#: TRL options that change how its trainers call the fused head or use its outputs: (trainer, options,
#: setup). ``gpu_rows``: TRL's GPU path, which passes only the labelled rows to the head function.
OPTION_CASES = {
    "grpo kl + entropy bonus, lora": ("grpo", {"beta": 0.04, "entropy_coef": 0.05}, {"lora": True}),
    "grpo fp32 head, entropy mask": ("grpo", {"cast_lm_head_to_fp32": True, "top_entropy_quantile": 0.5}, {}),
    "rloo kl, lora + checkpointing": (
        "rloo", {"beta": 0.04}, {"lora": True, "patch": "trl", "gradient_checkpointing": True},
    ),
    "sft dft": ("sft", {"loss_type": "dft"}, {}),
    "sft dft, gpu rows": ("sft", {"loss_type": "dft", "gpu_rows": True}, {}),
    "sft packing": ("sft", {"packing": True}, {}),
    "dpo ipo + ld_alpha": ("dpo", {"loss_type": ["ipo"], "ld_alpha": 0.5}, {}),
    "dpo precomputed reference": ("dpo", {"precompute_ref_log_probs": True}, {}),
    "kto precomputed reference, gpu rows": ("kto", {"precompute_ref_log_probs": True, "gpu_rows": True}, {}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_trl_options_that_reach_the_head_give_the_same_step(case, tmp_path, calls, monkeypatch):
    kind, options, setup = OPTION_CASES[case]
    if setup.get("lora"):
        require("peft")
    options = dict(options)
    if options.pop("gpu_rows", False):  # TRL's Triton path's calling convention, on the CPU
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    theirs = one_step(kind, tmp_path / "trl", **setup, **options)
    assert calls["fastalign"] == 0 and calls["trl"] > 0
    assert integration.enable()
    ours = one_step(kind, tmp_path / "fastalign", **setup, **options)
    assert calls["fastalign"] > 0
    assert_same_step(ours, theirs)


#: Vocabulary columns whose logits tie for the largest (``trl_head_call(..., ties=True)``), one in each of
#: TRL's 128-wide vocabulary chunks
TIED = (5, 150, 290)


def trl_head_call(
    function,
    outputs,
    weight_dtype=torch.float32,
    tokens=24,
    hidden_dtype=torch.float32,
    bias_dtype=torch.float32,
    ties=False,
    **options,
):
    """``function`` called as TRL's fused head calls it, on random inputs; outputs and input gradients.
    With ``ties`` the columns ``TIED`` hold the largest logit of every row, equal (zero weight rows, one
    bias), and the targets cycle through them: only the first is the argmax."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 16, generator=generator)
    weight = torch.randn(300, 16, generator=generator)
    bias = torch.randn(300, generator=generator)
    if ties:
        weight, bias = weight * 0.05, bias * 0.1
        weight[list(TIED)], bias[list(TIED)] = 0.0, 4.0
    hidden, weight = hidden.to(hidden_dtype).requires_grad_(), weight.to(weight_dtype).requires_grad_()
    bias = bias.to(bias_dtype).requires_grad_()
    targets = torch.randint(0, 300, (tokens,), generator=generator)
    targets[::2] = (hidden.float() @ weight.float().T + bias.float()).argmax(-1)[::2]  # some top-1 hits
    if ties:
        targets = torch.tensor(TIED).repeat(tokens)[:tokens]
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


def assert_same_head_call(ours, theirs, low_precision=False):
    """Outputs and input gradients of two ``trl_head_call``s: equal, to bf16's rounding of the logits
    (an ulp: TRL adds the bias after rounding the product) with ``low_precision``."""
    (ours, our_grads), (theirs, their_grads) = ours, theirs
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if low_precision else {"rtol": 1e-5, "atol": 2e-5}
    for name, mine, expected in zip(
        ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), ours, theirs, strict=True
    ):
        assert (mine is None) == (expected is None), name
        if expected is not None:
            assert mine.dtype == expected.dtype and mine.shape == expected.shape, name
            torch.testing.assert_close(mine, expected, **tolerance, msg=name)
    for mine, expected in zip(our_grads, their_grads, strict=True):
        assert mine.dtype == expected.dtype
        if low_precision:  # a few elements differ by a bf16 ulp of a logit: the whole is within 1%
            assert (mine.float() - expected.float()).norm() <= 1e-2 * expected.float().norm()
        else:
            torch.testing.assert_close(mine, expected, rtol=1e-4, atol=2e-5)


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
    theirs = trl_head_call(chunked_logprob.ChunkedLogProbFunction, **case)
    assert integration.enable()
    ours = trl_head_call(integration.FusedLogProbs, **case)
    assert_same_head_call(ours, theirs)
    if "is_top1" in case["outputs"]:
        assert ours[0][4].any() and not ours[0][4].all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_is_top1_is_trls_argmax_when_bf16_logits_tie(temperature):
    """A target tied with an earlier token for the largest logit is not top-1 (TRL's ``argmax ==
    target``): bf16 logits tying across TRL's vocabulary chunks, the targets cycling through the tied
    columns."""
    case = {"outputs": ("log_probs", "mean_logits", "is_top1"), "ties": True, "temperature": temperature}
    case |= {"hidden_dtype": torch.bfloat16, "weight_dtype": torch.bfloat16, "bias_dtype": torch.bfloat16}
    theirs = trl_head_call(chunked_logprob.ChunkedLogProbFunction, **case)
    assert integration.enable()
    ours = trl_head_call(integration.FusedLogProbs, **case)
    first_tied = torch.arange(24) % len(TIED) == 0
    assert torch.equal(theirs[0][4], first_tied)
    assert torch.equal(ours[0][4], theirs[0][4])
    assert_same_head_call(ours, theirs, low_precision=True)


def test_a_bias_of_another_dtype_is_cast_as_trl_does():
    """bf16 hidden states and head with an fp32 bias: TRL casts the bias to the compute dtype (its
    gradient comes back in fp32); so does fastalign, which used to refuse the call."""
    case = {"outputs": ("log_probs", "entropy"), "hidden_dtype": torch.bfloat16}
    case["weight_dtype"] = torch.bfloat16  # the bias stays fp32
    theirs = trl_head_call(chunked_logprob.ChunkedLogProbFunction, **case)
    assert integration.enable()
    ours = trl_head_call(integration.FusedLogProbs, **case)
    assert ours[1][2].dtype == torch.float32
    assert_same_head_call(ours, theirs, low_precision=True)


@pytest.mark.parametrize("how", ["setter", "environment"])
def test_a_head_workspace_the_user_set_is_honoured(how, monkeypatch):
    """TRL's tile size (4,096 tokens × its vocabulary chunk) is the head's workspace only when the user set
    none: a smaller ``set_head_workspace`` / ``FASTALIGN_HEAD_WORKSPACE_MIB`` budget is kept, not raised to
    it."""
    budgets = []

    def recording(*args, workspace_bytes=None, **kwargs):
        budgets.append(workspace_bytes)
        return fastalign.ops.token_logprobs(*args, workspace_bytes=workspace_bytes, **kwargs)

    monkeypatch.setattr(integration, "token_logprobs", recording)
    monkeypatch.delenv(head_workspace.ENV_VAR, raising=False)
    monkeypatch.setattr(head_workspace, "_budget_override", None)
    case = {"outputs": ("log_probs", "entropy")}
    theirs = trl_head_call(chunked_logprob.ChunkedLogProbFunction, **case)
    assert integration.enable()
    trl_head_call(integration.FusedLogProbs, **case)  # none set: 24 tokens × 128 columns of TRL's, or more
    assert budgets.pop() == max(head_workspace.DEFAULT_HEAD_WORKSPACE_BYTES["cpu"], 24 * 128 * 4)

    small = 0.002  # MiB: 2,097 bytes, under TRL's 12,288-byte tile of this call
    if how == "setter":
        head_workspace.set_head_workspace(small)
    else:
        monkeypatch.setenv(head_workspace.ENV_VAR, str(small))
    ours = trl_head_call(integration.FusedLogProbs, **case)
    assert budgets.pop() == int(small * 2**20) < 24 * 128 * 4
    assert_same_head_call(ours, theirs)  # smaller chunks, the same numbers


@pytest.mark.parametrize("mismatch", ["version", "next pre-release", "signature"])
def test_another_trl_protocol_keeps_trl_head_with_one_warning(mismatch, monkeypatch, calls, tmp_path):
    monkeypatch.setattr(integration, "_warned", False)
    if mismatch != "signature":  # a 1.17 pre-release sorts below 1.17 but is 1.17's protocol, not 1.16's
        monkeypatch.setattr(trl, "__version__", "1.17.0" if mismatch == "version" else "1.17.0rc1")
    else:

        class Changed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, logit_scale, outputs):
                raise AssertionError("never called here")

        monkeypatch.setattr(trl_kernels, "ChunkedLogProbFunction", Changed)  # TRL's own, changed
        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Changed)
        monkeypatch.setattr(integration, "_trl_function", None)  # as in a fresh process with that TRL
    untouched = trl_utils._ChunkedLogProbFunction
    with pytest.warns(UserWarning, match="keeps its own kernels"):
        assert not integration.enable()
    assert not integration.enable()  # no second warning: pytest's filterwarnings=error would fail it
    assert trl_utils._ChunkedLogProbFunction is untouched
    if mismatch == "version":
        one_step("sft", tmp_path)
        assert calls["fastalign"] == 0 and calls["trl"] > 0


@pytest.mark.parametrize("version", ["1.16.0", "1.16.2", "1.16.1.dev0", "1.16.0rc1", "1.16.1+local"])
def test_every_release_of_the_supported_minor_is_served(version, monkeypatch):
    monkeypatch.setattr(trl, "__version__", version)
    assert integration._protocol_mismatch(trl_utils) is None


@pytest.mark.parametrize("kind", ["subclass", "no forward"])
def test_enable_leaves_a_function_another_library_installed_first_with_one_warning(kind, monkeypatch):
    """A function another library put in TRL's slot before fastalign's first ``enable()`` is not replaced
    (it used to be, silently, and then kept as "TRL's" fallback), also one without TRL's ``forward`` (that
    one used to raise)."""
    monkeypatch.setattr(integration, "_warned_foreign", False, raising=False)
    monkeypatch.setattr(integration, "_trl_function", None)  # as in a fresh process

    class ThirdParty(chunked_logprob.ChunkedLogProbFunction):
        pass

    class ApplyOnly:
        @staticmethod
        def apply(*args):
            raise AssertionError("never called here")

    foreign = ThirdParty if kind == "subclass" else ApplyOnly
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", foreign)
    with pytest.warns(UserWarning, match="another library: left in place"):
        assert not integration.enable()
    assert trl_utils._ChunkedLogProbFunction is foreign and not integration._serving
    assert integration._trl_function is None  # nothing taken: TRL's own stays the fallback
    assert not integration.enable()  # no second warning


def test_patching_after_trl_added_its_fused_head_is_refused():
    """TRL's trainers give the model its fused head (an instance ``forward``) when they are built; patching
    after that would replace it silently (``model(..., fused_lm_head=True)`` then gives no log-probs):
    one clear error instead, and TRL's forward stays."""
    model = tiny_model("llama", seed=0)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs",))
    trl_forward = model.__dict__["forward"]
    with pytest.raises(ValueError, match="patch the model before the trainer is built"):
        integration.patch_model(model)
    assert model.__dict__["forward"] is trl_forward and not fastalign.patching.patched_pieces(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.shape == (1, 3)

    patched_first = integration.patch_model(tiny_model("llama", seed=0))  # the order the docs give
    trl_utils.add_fused_lm_head(patched_first, outputs=("log_probs",))
    assert patched_first(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.shape == (1, 3)
    assert fastalign.patch_model(tiny_model("llama", seed=0), loss=False)  # no head patched: nothing refused


def test_a_kept_reference_passes_every_call_to_trl_after_disable(calls):
    """``disable()`` gives TRL its function back; a reference to fastalign's taken while it was enabled then
    passes every call to TRL's (it used to drop TRL's function and fail on the calls it leaves to it)."""
    assert integration.enable()
    kept = trl_utils._ChunkedLogProbFunction
    assert kept is integration.FusedLogProbs
    integration.disable()
    assert trl_utils._ChunkedLogProbFunction is chunked_logprob.ChunkedLogProbFunction
    for outputs in [("log_probs", "log_sum_sq_probs"), ("log_probs", "entropy", "is_top1")]:
        theirs = trl_head_call(chunked_logprob.ChunkedLogProbFunction, outputs)
        assert_same_head_call(trl_head_call(kept, outputs), theirs)
    assert calls["fastalign"] == 0


def test_disable_leaves_a_third_party_function_in_trls_slot_with_one_warning(monkeypatch):
    """Another library that replaced fastalign's function in TRL's slot keeps it: ``disable()`` restores
    TRL's only over fastalign's own, and says once that it did not."""
    monkeypatch.setattr(integration, "_warned_foreign", False, raising=False)
    assert integration.enable()

    class ThirdParty(chunked_logprob.ChunkedLogProbFunction):
        pass

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ThirdParty)
    with pytest.warns(UserWarning, match="another library: left in place"):
        integration.disable()
    assert trl_utils._ChunkedLogProbFunction is ThirdParty
    integration.disable()  # no second warning: pytest.warns above took the only one
    assert not integration._serving


def test_enable_after_disable_leaves_a_third_party_function_with_one_warning(monkeypatch):
    """After ``disable()``, another library's function in TRL's slot is not replaced by ``enable()``
    (it used to be, for good: the fallback and ``disable()`` know TRL's function only)."""
    monkeypatch.setattr(integration, "_warned_foreign", False, raising=False)
    assert integration.enable()
    integration.disable()

    class ThirdParty(chunked_logprob.ChunkedLogProbFunction):
        pass

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ThirdParty)
    with pytest.warns(UserWarning, match="another library: left in place"):
        assert not integration.enable()
    assert trl_utils._ChunkedLogProbFunction is ThirdParty and not integration._serving
    assert not integration.enable()  # no second warning: pytest.warns above took the only one


def test_enable_installs_again_when_trls_slot_lost_fastalign(monkeypatch, calls):
    """``enable()`` checks TRL's slot, not its own record: after the slot got TRL's function back behind
    its back (a monkeypatch undone, another library), ``enable()`` installs fastalign's again, and TRL's
    function kept as the fallback is still TRL's own."""
    assert integration.enable()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", chunked_logprob.ChunkedLogProbFunction)
    assert integration.enable()
    assert trl_utils._ChunkedLogProbFunction is integration.FusedLogProbs
    assert integration._trl_original() is chunked_logprob.ChunkedLogProbFunction
    trl_head_call(trl_utils._ChunkedLogProbFunction, ("log_probs", "entropy"))
    assert calls == {"fastalign": 1, "trl": 0}


def test_two_threads_enabling_at_once_swap_trls_function_once(monkeypatch):
    """``enable()`` holds a lock: a second thread's ``enable()`` meeting the first inside its protocol check
    must neither check fastalign's function as if it were TRL's (it used to fail there) nor record it as
    TRL's (``disable()`` would then put fastalign's back)."""
    import threading

    check, callers, second = integration._protocol_mismatch, [], threading.Event()

    def meeting_check(utils):
        callers.append(threading.get_ident())
        if len(callers) == 1:
            second.wait(timeout=1.0)  # the second thread comes in here too, unless a lock holds it back
        else:
            second.set()
        return check(utils)

    monkeypatch.setattr(integration, "_protocol_mismatch", meeting_check)
    monkeypatch.setattr(integration, "_trl_function", None)  # as in a fresh process
    results = []

    def enable():
        try:
            results.append(integration.enable())
        except Exception as error:
            results.append(error)

    threads = [threading.Thread(target=enable) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True, True]
    assert trl_utils._ChunkedLogProbFunction is integration.FusedLogProbs
    integration.disable()
    assert trl_utils._ChunkedLogProbFunction is chunked_logprob.ChunkedLogProbFunction
