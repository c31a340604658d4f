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
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return float(loss), grads, {key: values[-1] for key, values in trainer._metrics["train"].items()}


def fastalign_loss_and_grads(models, data, options) -> tuple[float, dict]:
    model = fastalign.patch_model(
        AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    ).train()
    logps = policy_logps(model, data)
    loss_fn = GRPOLoss(max_completion_length=COMPLETION, **options)
    input_ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    attention_mask = torch.cat([data["prompt_mask"], data["completion_mask"]], 1)

    def head(hidden, weight, bias, softcap=None):
        return loss_fn(
            hidden[:, PROMPT - 1 : -1],
            weight,
            data["completion_ids"],
            data["completion_mask"],
            data["advantages"],
            old_per_token_logps=logps + data["old_shift"],
            ref_per_token_logps=logps + data["ref_shift"],
            bias=bias,
            softcap=softcap,
            num_items_in_batch=data["num_items_in_batch"] if loss_fn.uses_item_count else None,
        )

    output = model(input_ids=input_ids, attention_mask=attention_mask, head_fn=head).head_output
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return float(output.loss), grads, {key: float(value) for key, value in output.metrics.items()}


#: The metrics TRL 1.16's ``_compute_loss`` logs that ``GRPOLoss`` logs under the same name: the clip
#: shares (TRL logs cispo's as ``cispo_clip_ratio``), their extremes over the completions, entropy, kl.
CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def assert_loss_and_gradients_equal_trl(models, tmp_path, data, options) -> dict:
    """Loss, gradients and the metrics both log; returns TRL's metrics."""
    theirs, their_grads, their_metrics = trl_loss_and_grads(models, tmp_path, data, options)
    ours, our_grads, our_metrics = fastalign_loss_and_grads(models, data, options)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    shared = [key for key in (*CLIP_METRICS, "cispo_clip_ratio", "entropy", "kl") if key in their_metrics]
    assert set(shared) == set(our_metrics), (sorted(their_metrics), sorted(our_metrics))
    for key in shared:
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=2e-4, abs=2e-6, nan_ok=True), key
    return their_metrics


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


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_clip_metrics_equal_trl(models, tmp_path, level, delta):
    """With an old policy far enough off (log-ratios ~ N(0, 0.4)) that tokens and completions are
    clipped both ways, the clip shares and their extremes over the completions
    (``clip_ratio/low_min``, ``clip_ratio/high_max``) are TRL's; with ``delta`` capping the ratio first."""
    data = batch(tiny_tokenizer().vocab_size)
    data["old_shift"] = data["old_shift"] * 4
    options = dict(loss_type="grpo", importance_sampling_level=level, beta=0.04, epsilon=0.2)
    options |= {"epsilon_high": 0.28, "delta": delta}
    theirs = assert_loss_and_gradients_equal_trl(models, tmp_path, data, options)
    if level == "token":  # exercised: some completion has clipped tokens each way, some has none
        assert theirs["clip_ratio/high_max"] > 0 and theirs["clip_ratio/low_mean"] > 0
        assert theirs["clip_ratio/low_min"] == 0


class _Sampler(torch.nn.Module):
    """A stand-in policy whose ``generate`` returns fixed rows: the prompts, then ``completions``."""

    def __init__(self, completions: torch.Tensor):
        super().__init__()
        self.completions = completions

    def generate(self, input_ids, **kwargs):
        return torch.cat([input_ids, self.completions], 1)


def test_generation_metrics_and_num_tokens_equal_trl(models, tmp_path):
    """The same sampled rows (one prompt left-padded; completions that end with an EOS at the start, in
    the middle, at the last position, or never) give TRL's ``completions/*`` metrics, the terminated
    lengths included, and its ``num_tokens``: the prompts' and completions' tokens (up to the EOS),
    padding left out."""
    import datasets

    from fastalign.train.batches import batch_tokens
    from fastalign.train.distributed import DistributedContext
    from fastalign.train.rollout import Rewards, SamplingOptions, generate_completions, scoring_batch

    require("trl")
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, tokenizer.vocab_size, (2, PROMPT), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :2], prompt_mask[1, :2] = pad, 0
    completions = torch.randint(3, tokenizer.vocab_size, (2 * GROUP, COMPLETION), generator=gen)
    for row, end in enumerate([2, None, 0, COMPLETION - 1, None, 4, 3, None]):
        if end is not None:
            completions[row, end] = eos
    (done,) = generate_completions(
        _Sampler(completions),
        [{"input_ids": prompts, "attention_mask": prompt_mask}],
        SamplingOptions(GROUP, COMPLETION, engine="generate"),
        tokenizer,
        DistributedContext(0, 1, 0, torch.device("cpu")),
    )
    rows = slice(0, 2 * GROUP)
    zeros = torch.zeros(2 * GROUP, 1)
    ours = Rewards(zeros[:, :0], zeros[:, 0], done.lengths.float(), done.truncated, rows).metrics([])
    batch, _, _ = scoring_batch(done, done.completion_mask)
    ours["num_tokens"] = batch_tokens(batch)

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=GRPOConfig(**trl_args(tmp_path)),
        train_dataset=datasets.Dataset.from_list(tiny_prompt_rows(8)),
        processing_class=tokenizer,
    )
    trainer.model.train()
    prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask, strict=True)]
    prompt_ids = [ids for ids in prompt_ids for _ in range(GROUP)]
    completion_ids = [
        row[: int(length)].tolist() for row, length in zip(completions, done.lengths, strict=True)
    ]
    trainer._tokenize_prompts = lambda prompts: (prompt_ids, None, {})
    trainer._generate_single_turn = lambda *args, **kwargs: (completion_ids, None)
    trainer._generate(["p"] * len(completion_ids))
    theirs = {key: values[-1] for key, values in trainer._metrics["train"].items()}

    keys = [key for key in theirs if key.startswith("completions/")] + ["num_tokens"]
    assert "completions/mean_terminated_length" in keys and 0 < theirs["completions/clipped_ratio"] < 1
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6), (key, ours[key], theirs[key])
