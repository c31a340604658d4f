"""TRL 1.16 as the oracle for GRPO's loss: for every ``loss_type`` and ``importance_sampling_level``, TRL's
own ``GRPOTrainer._compute_loss`` and fastalign's ``GRPOLoss`` (inside the patched model's forward) on the
same model and the same batch of prompts, sampled completions, advantages, old and reference log-probs
give the same loss and the same gradients.

Sampling is not compared here (each tool draws its own completions); the batch is given. Prompts have one
length: TRL scores left-padded prompts at positions that count the padding, fastalign at the positions
``generate`` sampled them with (a documented difference). TRL's ``use_bias_correction_kl`` (on by default:
the KL term times the importance ratio, the completion's at sequence level) is compared on and off, and so
is ``top_entropy_quantile`` (the policy term of the low-entropy tokens masked)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastalign
from fastalign.builtin import tiny_prompt_rows, tiny_tokenizer
from fastalign.losses import GRPOLoss
from fastalign.losses.grpo import LOSS_TYPES
from tests.helpers import require

pytestmark = pytest.mark.slow

GROUP, PROMPT, COMPLETION = 4, 6, 7


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two prompts × a group of 4 completions of different lengths, with advantages and log-probs of an
    older policy and of a reference that differ from the current one."""
    gen = torch.Generator().manual_seed(11)
    rows = 2 * GROUP
    prompt_ids = torch.randint(3, vocab, (2, PROMPT), generator=gen).repeat_interleave(GROUP, 0)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    completion_mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": torch.randint(3, vocab, (rows, COMPLETION), generator=gen),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=gen),
        "old_shift": torch.randn(rows, COMPLETION, generator=gen) * 0.1,
        "ref_shift": torch.randn(rows, COMPLETION, generator=gen) * 0.3,
        "num_items_in_batch": completion_mask.sum(),
    }


def policy_logps(model, data) -> torch.Tensor:
    """[B, C] log-probs of the completion tokens under ``model`` (plain PyTorch, no patch)."""
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(input_ids).logits[:, PROMPT - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, data["completion_ids"][..., None]).squeeze(-1)


def entropy_margin(model_dir, data, quantile) -> float:
    """How far (float64) the batch's completion-token entropies lie from TRL's threshold: for two heads to
    pick the same tokens it must dwarf their fp32 rounding (~1e-6 at these entropies of ~6.2)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    with torch.no_grad():
        log_probs = model(input_ids).logits[:, PROMPT - 1 : -1].double().log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)[data["completion_mask"].bool()]
    threshold = torch.quantile(entropy.float(), 1 - quantile).double()
    return float((entropy - threshold).abs().min())


def trl_args(tmp_path) -> dict:
    """The TRL config keys of a one-batch loss comparison (GRPOConfig's and RLOOConfig's alike): fp32 on
    the CPU without checkpointing, the batch's group and completion width."""
    return dict(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2 * GROUP,
        num_generations=GROUP,
        max_completion_length=COMPLETION,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
    )


def trl_loss_and_grads(models, tmp_path, data, options) -> tuple[float, dict]:
    import datasets

    require("trl")
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**trl_args(tmp_path), **options)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=args,
        train_dataset=datasets.Dataset.from_list(tiny_prompt_rows(8)),
        processing_class=tiny_tokenizer(),
    )
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    logps = policy_logps(model, data)
    inputs = {key: data[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    inputs |= {
        "advantages": data["advantages"],
        "old_per_token_logps": logps + data["old_shift"],
        "ref_per_token_logps": logps + data["ref_shift"],
        "num_items_in_batch": data["num_items_in_batch"],
    }
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}


def fastalign_loss_and_grads(models, data, options) -> tuple[float, dict]:
    model = fastalign.patch_model(
        AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    ).train()
    logps = policy_logps(model, data)
    loss_fn = GRPOLoss(max_completion_length=COMPLETION, **options)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    attention_mask = torch.cat([data["prompt_mask"], data["completion_mask"]], 1)

    def head(hidden, weight, bias):
        return loss_fn(
            hidden[:, PROMPT - 1 : -1],
            weight,
            data["completion_ids"],
            data["completion_mask"],
            data["advantages"],
            old_per_token_logps=logps + data["old_shift"],
            ref_per_token_logps=logps + data["ref_shift"],
            bias=bias,
            num_items_in_batch=data["num_items_in_batch"] if loss_fn.uses_item_count else None,
        )

    loss = model(input_ids=input_ids, attention_mask=attention_mask, head_fn=head).head_output.loss
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_loss_and_gradients_equal_trl(models, tmp_path, data, options) -> None:
    theirs, their_grads = trl_loss_and_grads(models, tmp_path, data, options)
    ours, our_grads = fastalign_loss_and_grads(models, data, options)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "bias_correction"), [(0.0, False), (0.04, True), (0.04, False)])
def test_loss_and_gradients_equal_trl(models, tmp_path, loss_type, level, beta, bias_correction):
    data = batch(tiny_tokenizer().vocab_size)
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28 if loss_type != "cispo" else 5.0,
        use_bias_correction_kl=bias_correction,
    )
    assert_loss_and_gradients_equal_trl(models, tmp_path, data, options)


@pytest.mark.parametrize("quantile", [1.0, 0.8, 0.2])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_entropy_masked_loss_and_gradients_equal_trl(models, tmp_path, loss_type, level, beta, quantile):
    """``top_entropy_quantile``: TRL's entropies of its fused head and fastalign's of its own give the same
    high-entropy tokens (no entropy of the batch is within rounding of the threshold), and then the same
    loss and gradients."""
    data = batch(tiny_tokenizer().vocab_size)
    if quantile < 1.0:
        assert entropy_margin(models[0], data, quantile) > 1e-5
    options = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28 if loss_type != "cispo" else 5.0,
        top_entropy_quantile=quantile,
    )
    assert_loss_and_gradients_equal_trl(models, tmp_path, data, options)
