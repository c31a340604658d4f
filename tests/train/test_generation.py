"""The rollout engine (``fastalign.sampling.generation``) against ``model.generate``, the oracle: greedy
tokens equal on every tiny family, LoRA and patched models, with rows ending at different steps and generate's
logits processors; sampled tokens follow the exact next-token distribution; per-prompt seeds make a
prompt's completions independent of the call; a model or option it cannot run falls back to generate,
said once. Runs on every supported transformers (the lowest-versions environment too): the engine reads
``_get_logits_processor`` and ``_eos_token_tensor``, transformers internals."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from fastalign.builtin import tiny_model
from fastalign.builtin.models import TINY_MODEL_TYPES
from fastalign.sampling import decode_steps, generation
from fastalign.sampling.decode_cache import ReservedLayer, SharedPrefixLayer
from fastalign.sampling.generation import engine_refusal, sample_groups
from fastalign.train.distributed import DistributedContext
from fastalign.train.rollout import SamplingOptions, generate_completions

PAD = 0
CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def left_padded(lengths: list[int], seed: int = 0, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length :] = 1
    return ids, mask


def generate(model, ids, mask, group: int, **kwargs) -> torch.Tensor:
    return model.generate(
        input_ids=ids.repeat_interleave(group, 0), attention_mask=mask.repeat_interleave(group, 0), **kwargs
    )


def an_eos_that_ends_some_rows(model, ids, mask, steps: int) -> int:
    """A token that greedy decoding emits in some rows but not all, and not first: as EOS, rows end at
    different steps (the engine drops ended rows from the batch)."""
    out = generate(
        model, ids, mask, 1, do_sample=False, max_new_tokens=steps, eos_token_id=511, pad_token_id=PAD
    )
    completions = out[:, ids.shape[1] :]
    for token in completions[:, 1:].flatten().tolist():
        rows = (completions[:, 1:] == token).any(-1)
        if 0 < int(rows.sum()) < len(rows) and token != PAD:
            return token
    pytest.skip("greedy decoding of this random model repeats the same tokens in every row")


def compactions(monkeypatch) -> list[int]:
    """The row counts the engine's KV cache was compacted to (a spy on its layers)."""
    seen: list[int] = []
    for layer in (ReservedLayer, SharedPrefixLayer):
        select = layer.batch_select_indices

        def spy(self, indices, select=select):
            seen.append(len(indices))
            return select(self, indices)

        monkeypatch.setattr(layer, "batch_select_indices", spy)
    return seen


def sharing(monkeypatch, shared: bool) -> None:
    """Make the engine hold the prompts' KV once (``shared``) or repeat it, whatever their length."""
    monkeypatch.setattr(generation, "SHARE_FROM", 0 if shared else 10**9)


@pytest.mark.parametrize("shared", [False, True], ids=["repeated", "shared"])
@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_greedy_tokens_equal_generates_on_every_family(model_type, shared, monkeypatch):
    sharing(monkeypatch, shared)
    model = tiny_model(model_type, seed=1).eval()
    ids, mask = left_padded([5, 9, 3, 7])
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=12)
    options = dict(do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    seen = compactions(monkeypatch)
    with torch.no_grad():
        expected = generate(model, ids, mask, 2, **options)
        ours = sample_groups(model, ids, mask, 2, options)
    assert torch.equal(ours, expected)
    if model_type != "gemma3_text":  # every layer a sliding-window one: no layer of fastalign's to spy on
        assert seen, "rows ended but the batch was never compacted"


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_bf16_prompt_held_once_is_attended_in_fp32(model_type, monkeypatch):
    """The shared prefix's attention sums in fp32 and rounds once, as sdpa does: these bf16 models then
    decode greedily as ``generate`` (they parted from it while its pieces were rounded to bf16 one by one;
    in general bf16 equals ``generate`` only up to rounding, docs/objectives.md#sampling)."""
    sharing(monkeypatch, True)
    model = tiny_model(model_type, seed=1, dtype=torch.bfloat16).eval()
    options = dict(do_sample=False, max_new_tokens=16, eos_token_id=511, pad_token_id=PAD)
    with torch.no_grad():
        for seed in range(4):
            ids, mask = left_padded([20, 24, 13, 30], seed=seed)
            assert torch.equal(
                sample_groups(model, ids, mask, 4, options), generate(model, ids, mask, 4, **options)
            )


def test_under_autocast_the_prompt_held_once_is_still_attended_in_fp32(monkeypatch):
    """A bf16 run over fp32 weights rolls out inside the engine's autocast, which would cast the shared
    attention's fp32 products back to bf16: its scores reach the softmax in fp32 all the same, and the
    prefix is kept in fp32 once (no copy a step)."""
    from fastalign.sampling import prefix_attention

    sharing(monkeypatch, True)
    seen, softmax = [], torch.softmax
    monkeypatch.setattr(
        prefix_attention.torch, "softmax", lambda x, *a, **k: seen.append(x.dtype) or softmax(x, *a, **k)
    )
    model = tiny_model("llama", seed=1).eval()
    ids, mask = left_padded([20, 24], seed=0)
    options = dict(do_sample=False, max_new_tokens=4, eos_token_id=511, pad_token_id=PAD)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        sample_groups(model, ids, mask, 2, options)
    assert seen and set(seen) == {torch.float32}


def test_generates_logits_processors_apply(monkeypatch):
    """Repetition penalty (with left padding), no-repeat n-grams and a minimum length: the processors
    generate builds, on the installed transformers."""
    model = tiny_model("llama", seed=2).eval()
    ids, mask = left_padded([4, 8, 6], seed=3)
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=10)
    options = dict(
        do_sample=False,
        max_new_tokens=10,
        min_new_tokens=3,
        repetition_penalty=1.7,
        no_repeat_ngram_size=2,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    with torch.no_grad():
        assert torch.equal(
            sample_groups(model, ids, mask, 3, options), generate(model, ids, mask, 3, **options)
        )


def test_a_shared_prefix_is_held_once_and_never_rebuilt(monkeypatch):
    """With the prompts' KV shared, each full-attention layer holds B prompts (not B·G rows), every
    decode step takes the shared computation (the repeated tensors are never rebuilt), and the tokens
    equal generate's, through compactions, with GQA (4 query heads a key head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sharing(monkeypatch, True)
    kept, rebuilt = [], []
    share, full = SharedPrefixLayer.share, SharedPrefixLayer.full
    monkeypatch.setattr(SharedPrefixLayer, "share", lambda self, *a: (kept.append(self), share(self, *a))[1])
    monkeypatch.setattr(SharedPrefixLayer, "full", lambda self, *a: (rebuilt.append(1), full(self, *a))[1])
    seen = compactions(monkeypatch)
    torch.manual_seed(8)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, pad_token_id=PAD, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids, mask = left_padded([9, 4, 12], seed=14)
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=10)
    options = dict(do_sample=False, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, 3, options)
        assert torch.equal(ours, generate(model, ids, mask, 3, **options))
    assert len(kept) == 2 and all(layer.prefix_keys.shape[0] == 3 for layer in kept)
    assert seen and not rebuilt
    assert model.config._attn_implementation == "sdpa"  # restored after decoding


def test_lengths_count_the_prompt_as_generates_do():
    """``forced_eos_token_id`` (at max_length − 1) and ``min_new_tokens`` read the lengths generate sets
    from the prompt's width and max/min_new_tokens."""
    model = tiny_model("llama", seed=2).eval()
    ids, mask = left_padded([4, 7], seed=11)
    eos = an_eos_that_ends_some_rows(model, ids, mask, steps=6)
    options = dict(
        do_sample=False, max_new_tokens=6, min_new_tokens=2, forced_eos_token_id=eos, eos_token_id=eos,
        pad_token_id=PAD,
    )  # fmt: skip
    with torch.no_grad():
        ours, expected = sample_groups(model, ids, mask, 2, options), generate(model, ids, mask, 2, **options)
    assert torch.equal(ours, expected)
    assert (ours[:, ids.shape[1] :] == eos).any(-1).all()  # the forced EOS ended every row


def test_draws_never_take_a_token_of_probability_zero(monkeypatch):
    """A GPU's parallel scan may give a token cut by top-k a cumulated value an ulp above its
    predecessor's; a draw on that boundary must still not take it (simulated here on the CPU)."""
    scores = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf"), 0.0]]).repeat(3, 1)
    cumsum = torch.Tensor.cumsum

    def scan_with_ulps(self, dim):  # each step's sum an ulp larger, as a reassociated scan may give
        out = cumsum(self, dim)
        return out + torch.arange(out.shape[-1]) * torch.finfo(out.dtype).eps

    monkeypatch.setattr(torch.Tensor, "cumsum", scan_with_ulps)
    third = torch.tensor(1 / 3)
    boundaries = torch.stack([third, torch.nextafter(third, torch.tensor(1.0)), 2 * third])
    drawn = generation._draw(scores, boundaries)
    assert bool((scores.gather(1, drawn[:, None]) == 0).all()), drawn


def test_draws_reach_every_token_of_a_long_tail_of_tiny_probabilities():
    """200,000 tokens of 5e-9 each (1e-3 of the mass together) after one of 0.999: each below half a
    float32 ulp of the running sum, so that a float32 CDF gave most of them no interval (they could never
    be drawn, their mass going to a neighbour). A uniform number in the middle of a tail token's interval
    (the exact CDF of the probabilities the softmax gives) draws that token; and the uniform numbers have
    float64's resolution (float32's 6e-8 steps would skip most tail tokens too)."""
    tail, mass = 200_000, 1e-3
    scores = torch.full((1, tail + 1), math.log(mass / tail))
    scores[0, 0] = math.log(1 - mass)
    probabilities = torch.softmax(scores[0], -1)
    head, each = float(probabilities[0]), float(probabilities[1])  # every tail token's is the same
    assert bool((probabilities[1:] == probabilities[1]).all())
    total = head + tail * each
    tokens = [1, 2, 3, 1000, 54_321, 123_457, tail - 1, tail]
    middles = torch.tensor([(head + (token - 0.5) * each) / total for token in tokens], dtype=torch.float64)
    drawn = generation._draw(scores.repeat(len(tokens), 1), middles)
    assert drawn.tolist() == tokens
    assert generation._uniforms(4, 2, None, torch.device("cpu")).dtype == torch.float64
    assert generation._uniforms(4, 2, [torch.Generator()] * 2, torch.device("cpu")).dtype == torch.float64


def test_a_cache_the_engine_cannot_repeat_is_sampled_by_generate():
    """Linear attention keeps conv and recurrent states that ``batch_repeat_interleave`` does not repeat:
    such a model (LFM2's conv layers here) is refused, and the rollout samples it with generate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "lfm2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, layer_types=["conv", "full_attention"], pad_token_id=PAD,
        eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    refusal = engine_refusal(model, {"do_sample": False, "max_new_tokens": 3})
    assert refusal is not None and "cannot repeat" in refusal


@pytest.mark.parametrize("four_bit", [False, True], ids=["dense-base", "nf4-base"])
@pytest.mark.parametrize("shared", [False, True], ids=["repeated", "shared"])
def test_lora_and_patched_models_decode_as_generate(shared, four_bit, monkeypatch):
    """LoRA over a patched model, its base dense or NF4 (QLoRA's rollouts), as ``generate``."""
    from peft import LoraConfig, get_peft_model

    sharing(monkeypatch, shared)

    from fastalign import patch_model

    model = tiny_model("llama", seed=3)
    if four_bit:
        from fastalign.quant import QuantOptions
        from fastalign.quant.four_bit_linear import quantize_model

        quantize_model(model, QuantOptions())
    patch_model(model)
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    ).eval()
    ids, mask = left_padded([6, 4], seed=4)
    options = dict(do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=PAD)
    assert engine_refusal(model, options) is None
    with torch.no_grad():
        assert torch.equal(
            sample_groups(model, ids, mask, 2, options), generate(model, ids, mask, 2, **options)
        )


def distribution(model, ids: torch.Tensor, options: dict) -> torch.Tensor:
    """The exact next-token distribution after ``ids`` (one row) under generate's processors."""
    config, _ = generation.merged_generation_config(model, options)
    config._eos_token_tensor = torch.tensor([options["eos_token_id"]])
    processors = model._get_logits_processor(
        config, input_ids_seq_length=ids.shape[1], device="cpu", model_kwargs={"attention_mask": ids * 0 + 1}
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1].float()
    return torch.softmax(processors(ids, logits), -1)[0]


def fits(counts: torch.Tensor, probabilities: torch.Tensor) -> bool:
    """Pearson's chi-square of ``counts`` against ``probabilities`` within 5 standard deviations of its
    mean (degrees of freedom: the tokens of non-zero probability, less one); a draw of a token of
    probability 0 fails."""
    if bool((counts[probabilities == 0] > 0).any()):
        return False
    support = probabilities > 0
    expected = probabilities[support] * counts.sum()
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    freedom = int(support.sum()) - 1
    return chi2 < freedom + 5 * (2 * freedom) ** 0.5


def test_sampled_tokens_follow_generates_distribution():
    """First tokens against the exact distribution, and second tokens after the most drawn first one
    against theirs; ``generate``'s own draws pass the same test (the test is not too strict)."""
    model = tiny_model("llama", seed=4).eval()
    ids, mask = left_padded([5], seed=5)
    options = dict(
        do_sample=True,
        max_new_tokens=2,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    draws = 4000
    torch.manual_seed(0)
    with torch.no_grad():
        ours = sample_groups(model, ids, mask, draws, options)[:, -2:]
        theirs = generate(model, ids, mask, draws, **options)[:, -2:]
    first = distribution(model, ids, options)
    for sampled in (ours, theirs):
        assert fits(torch.bincount(sampled[:, 0], minlength=first.numel()).float(), first)
    top = int(torch.bincount(ours[:, 0]).argmax())
    second = distribution(model, torch.cat([ids, torch.tensor([[top]])], 1), options)
    after = ours[ours[:, 0] == top, 1]
    assert after.numel() > 100
    assert fits(torch.bincount(after, minlength=second.numel()).float(), second)


def test_seeded_shared_prompt_draws_follow_the_distribution_as_rows_end(monkeypatch):
    """GRPO's way of sampling: 2 prompts, each its own seeded generator, their KV held once, min_p and a
    repetition penalty, and rows ending at the first token (its most likely one is the EOS, and the batch
    is compacted as soon as one row ends): each prompt's first tokens, and its second tokens after its
    most drawn non-EOS first one, follow the exact distributions."""
    sharing(monkeypatch, True)
    monkeypatch.setattr(decode_steps, "COMPACT_SHARE", 0.0)
    model = tiny_model("llama", seed=4).eval()
    ids, mask = left_padded([5, 5], seed=7)
    options = dict(
        do_sample=True, max_new_tokens=2, temperature=0.5, top_k=40, min_p=0.05, repetition_penalty=1.3,
        pad_token_id=PAD,
    )  # fmt: skip
    options["eos_token_id"] = int(distribution(model, ids[:1], options | {"eos_token_id": 2}).argmax())
    seen = compactions(monkeypatch)
    draws = 4000
    with torch.no_grad():
        out = sample_groups(model, ids, mask, draws, options, seeds=[11, 12])[:, -2:]
    assert seen, "no row ended at its first token"
    for prompt in range(2):
        sampled, row = out[prompt * draws : (prompt + 1) * draws], ids[prompt : prompt + 1]
        first = distribution(model, row, options)
        assert fits(torch.bincount(sampled[:, 0], minlength=first.numel()).float(), first)
        counts = torch.bincount(sampled[:, 0], minlength=first.numel())
        counts[options["eos_token_id"]] = 0
        top = int(counts.argmax())
        second = distribution(model, torch.cat([row, torch.tensor([[top]])], 1), options)
        after = sampled[sampled[:, 0] == top, 1]
        assert after.numel() > 100
        assert fits(torch.bincount(after, minlength=second.numel()).float(), second)


def test_the_generation_config_merges_as_generates_does(monkeypatch):
    """Options over the model's generation config over transformers' global defaults, as ``generate``
    merges them: a model that sets no ``top_k`` samples from the top 50 with ``do_sample`` alone, as
    ``generate`` does (the config ``generate`` hands its logits processors is the engine's)."""
    model = tiny_model("llama", seed=4).eval()
    model.generation_config.temperature = 0.9  # the model's own, kept; top_k: the global default
    assert model.generation_config.top_k is None
    ids, mask = left_padded([5], seed=5)
    options = dict(do_sample=True, max_new_tokens=1, eos_token_id=2, pad_token_id=PAD)
    seen = []
    processors = model._get_logits_processor
    spy = lambda *args, **kwargs: (seen.append(kwargs["generation_config"]), processors(*args, **kwargs))[1]  # noqa: E731
    monkeypatch.setattr(model, "_get_logits_processor", spy)
    with torch.no_grad():
        generate(model, ids, mask, 1, **options)
    monkeypatch.setattr(model, "_get_logits_processor", processors)
    ours, unused = generation.merged_generation_config(model, options)
    theirs = seen[0].to_dict()
    differ = {key for key, value in ours.to_dict().items() if theirs.get(key) != value}
    differ = {key for key in differ if not key.startswith("_")}  # the special tokens' tensors: generate's
    assert differ <= {"max_length"} and not unused  # max_length: generate's from the prompt's width
    assert ours.top_k == 50 and ours.temperature == 0.9
    torch.manual_seed(0)
    with torch.no_grad():
        first = sample_groups(model, ids, mask, 1000, options)[:, -1]
    assert first.unique().numel() <= 50


def test_a_prompts_completions_depend_on_its_seed_only():
    model = tiny_model("llama", seed=5).eval()
    ids, mask = left_padded([4, 7, 5], seed=6)
    options = dict(do_sample=True, max_new_tokens=6, eos_token_id=2, pad_token_id=PAD)
    with torch.no_grad():
        together = sample_groups(model, ids, mask, 2, options, seeds=[11, 12, 13])
        alone = sample_groups(model, ids[1:2, -7:], mask[1:2, -7:], 2, options, seeds=[12])
        again = sample_groups(model, ids, mask, 2, options, seeds=[11, 12, 13])
        other = sample_groups(model, ids, mask, 2, options, seeds=[21, 22, 23])
    assert torch.equal(together, again)
    middle = together[2:4, ids.shape[1] :]
    assert torch.equal(middle[:, : alone.shape[1] - 7], alone[:, 7:])
    assert not torch.equal(together, other)


def test_generation_batches_sample_as_each_micro_batch_alone():
    """The rollout samples a generation's micro-batches in one engine call: each micro-batch's
    completions equal those of a call for it alone (same seed), cut to its own longest."""
    model = tiny_model("llama", seed=6).eval()
    first, second = left_padded([3, 6], seed=7), left_padded([8, 2], seed=8)
    batches = [{"input_ids": ids, "attention_mask": mask} for ids, mask in (first, second)]
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": PAD})()
    options = SamplingOptions(2, 7, temperature=1.0)
    together = generate_completions(model, batches, options, tokenizer, CPU, seeds=[3, 4])
    for index, batch in enumerate(batches):
        (alone,) = generate_completions(model, [batch], options, tokenizer, CPU, seeds=[[3, 4][index]])
        assert torch.equal(together[index].completion_ids, alone.completion_ids)
        assert torch.equal(together[index].prompt_ids, alone.prompt_ids)
        assert torch.equal(together[index].truncated, alone.truncated)


@pytest.mark.parametrize("kwargs", [{"min_length": 6}, {"repetition_penalty": 1.5}], ids=["min", "penalty"])
def test_micro_batches_whose_padding_a_processor_reads_sample_as_alone(kwargs):
    """An absolute ``min_length`` counts the prompt's padding: micro-batches of other widths are sampled
    in calls of their own, so each equals its call alone. The repetition penalty: on transformers 5.17,
    which penalizes the pad id, so too; on 5.23, which skips the padding, in one call."""
    model = tiny_model("llama", seed=6).eval()
    first, second = left_padded([3, 2], seed=12), left_padded([9, 8], seed=13)
    batches = [{"input_ids": ids, "attention_mask": mask} for ids, mask in (first, second)]
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": PAD})()
    eos = an_eos_that_ends_some_rows(model, *first, steps=8)
    tokenizer.eos_token_id = eos
    options = SamplingOptions(2, 8, top_k=1, generation_kwargs=kwargs)
    reads = generation.reads_prompt_padding(model, options.generate_kwargs(tokenizer, model))
    assert reads == ("min_length" in kwargs or generation._penalty_reads_padding(model))
    together = generate_completions(model, batches, options, tokenizer, CPU, seeds=[3, 4])
    for index, batch in enumerate(batches):
        (alone,) = generate_completions(model, [batch], options, tokenizer, CPU, seeds=[[3, 4][index]])
        assert torch.equal(together[index].completion_ids, alone.completion_ids)


def phi3_with_longrope():
    """A tiny Phi-3 whose rope switches to its long factors past 16 tokens (Phi-3 128k's longrope): there
    its ``prepare_inputs_for_generation`` recomputes the cache, with the long factors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 16, "short_factor": [1.0] * 8,
        "long_factor": [float(4 + i) for i in range(8)],
    }  # fmt: skip
    config = AutoConfig.for_model(
        "phi3", hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        partial_rotary_factor=0.5, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters=rope,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_a_rope_that_changes_with_the_length_is_sampled_by_generate_past_it(caplog, monkeypatch):
    """Sequences that pass a longrope's original length (12-token prompts, 12 new tokens; the limit 16)
    are sampled by generate, which recomputes Phi-3's cache there (the engine's tokens differed), said in
    the log line; sequences that stay within it are the engine's, with generate's tokens."""
    from fastalign.train import rollout

    monkeypatch.setattr(rollout, "_SAID", set())
    model = phi3_with_longrope()
    tokenizer = type("Tokenizer", (), {"eos_token_id": 511, "pad_token_id": PAD})()  # rows run to the end
    greedy = dict(do_sample=False, max_new_tokens=12, eos_token_id=511, pad_token_id=PAD)
    ids, mask = left_padded([12, 10], seed=1)
    with caplog.at_level(logging.WARNING, logger="fastalign.train.rollout"):
        (done,) = generate_completions(
            model,
            [{"input_ids": ids, "attention_mask": mask}],
            SamplingOptions(1, 12, top_k=1),
            tokenizer,
            CPU,
        )
    said = [record.message for record in caplog.records if "model.generate" in record.message]
    assert len(said) == 1 and "rotary embedding changes past 16 tokens" in said[0]
    with torch.no_grad():
        assert torch.equal(done.completion_ids, generate(model, ids, mask, 1, **greedy)[:, ids.shape[1] :])
    short, short_mask = left_padded([4, 3], seed=1)  # 4 + 12 - 1 = 15 positions: the short factors only
    assert engine_refusal(model, greedy, width=4) is None
    with torch.no_grad():
        ours = sample_groups(model, short, short_mask, 2, greedy)
        assert torch.equal(ours, generate(model, short, short_mask, 2, **greedy))


def test_a_dynamic_rope_is_the_engines_only_within_its_maximum_positions():
    """A ``dynamic`` rope rescales its frequencies by the longest row of a forward's batch once past the
    maximum positions, so the engine's compactions (a batch without its longest rows) would change them:
    sequences that may pass it are sampled by generate; those that stay within it are the engine's, with
    generate's tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert generation.rope_switch_length(model) == 16
    greedy = dict(do_sample=False, max_new_tokens=12, eos_token_id=511, pad_token_id=PAD)
    assert "rotary embedding changes past 16 tokens" in engine_refusal(model, greedy, width=6)
    assert engine_refusal(model, greedy, width=5) is None  # 5 + 12 - 1 = 16 positions
    ids, mask = left_padded([5, 3], seed=1)
    with torch.no_grad():
        assert torch.equal(
            sample_groups(model, ids, mask, 2, greedy), generate(model, ids, mask, 2, **greedy)
        )
    assert generation.rope_switch_length(tiny_model("llama")) is None


def test_what_the_engine_cannot_run_is_named():
    model = tiny_model("llama")
    assert "num_beams" in engine_refusal(model, {"num_beams": 2, "max_new_tokens": 2})
    assert "'no_such_option'" in engine_refusal(model, {"no_such_option": 1})
    assert "'stop_strings'" in engine_refusal(model, {"stop_strings": ["."], "max_new_tokens": 2})
    assert "max_new_tokens" in engine_refusal(model, {"do_sample": True})
    assert engine_refusal(model, {"do_sample": True, "top_k": 5, "max_new_tokens": 2}) is None


@pytest.mark.parametrize("implementation", ["quantized", "paged", "sliding_window"])
def test_a_cache_implementation_the_engine_does_not_reproduce_is_refused(implementation):
    """A quantized KV cache (or a paged or deprecated one) changes what attention reads: generate runs it.
    The dynamic and static caches hold the keys and values as the engine's does."""
    model = tiny_model("llama")
    refusal = engine_refusal(model, {"cache_implementation": implementation, "max_new_tokens": 2})
    assert refusal == f"cache_implementation is {implementation!r}"
    for same in ("dynamic", "static", "offloaded"):
        assert engine_refusal(model, {"cache_implementation": same, "max_new_tokens": 2}) is None


def test_the_rollout_falls_back_to_generate_saying_why_once(caplog):
    model = tiny_model("llama", seed=7).eval()
    ids, mask = left_padded([4, 4], seed=9)
    batch = {"input_ids": ids, "attention_mask": mask}
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": PAD})()
    options = SamplingOptions(2, 5, top_k=1, generation_kwargs={"typical_p": 0.5, "low_memory": True})
    unsupported = SamplingOptions(2, 5, top_k=1, generation_kwargs={"num_beams": 2, "do_sample": False})
    with caplog.at_level(logging.WARNING, logger="fastalign.train.rollout"):
        generate_completions(model, [batch], options, tokenizer, CPU)  # typical_p: the engine runs it
        for _ in range(2):
            (done,) = generate_completions(model, [batch], unsupported, tokenizer, CPU)
    said = [record.message for record in caplog.records if "model.generate" in record.message]
    assert len(said) == 1 and "num_beams is 2" in said[0]
    expected = generate(model, ids, mask, 2, num_beams=2, do_sample=False, max_new_tokens=5, pad_token_id=PAD)
    assert torch.equal(done.completion_ids[:, :3], expected[:, ids.shape[1] : ids.shape[1] + 3])


@pytest.mark.parametrize("use_cache", [False, True])
def test_use_cache_in_generation_kwargs_is_passed_once(use_cache, caplog, monkeypatch):
    """``use_cache: false`` makes the rollout sample with generate (said), which gets it once (it raised
    'got multiple values for keyword argument'); true, the engine runs."""
    from fastalign.train import rollout

    monkeypatch.setattr(rollout, "_SAID", set())
    model = tiny_model("llama", seed=7).eval()
    ids, mask = left_padded([4, 6], seed=9)
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": PAD})()
    options = SamplingOptions(2, 5, top_k=1, generation_kwargs={"use_cache": use_cache})
    with caplog.at_level(logging.WARNING, logger="fastalign.train.rollout"):
        (done,) = generate_completions(
            model, [{"input_ids": ids, "attention_mask": mask}], options, tokenizer, CPU
        )
    said = [record.message for record in caplog.records if "model.generate" in record.message]
    assert len(said) == (0 if use_cache else 1) and all("(use_cache is false)" in line for line in said)
    greedy = dict(do_sample=False, max_new_tokens=5, eos_token_id=2, pad_token_id=PAD)
    assert torch.equal(done.completion_ids, generate(model, ids, mask, 2, **greedy)[:, ids.shape[1] :])


@pytest.mark.parametrize("given_by", ["generation_kwargs", "model"])
@pytest.mark.parametrize("engine", ["fastalign", "generate"])
def test_a_completion_ends_at_any_of_several_eos_ids(engine, given_by):
    """``generation_kwargs`` may give several EOS ids, and so may the model's generation config (an
    instruct model's end of turn beside the tokenizer's EOS; TRL's sampling trainers stop at both):
    sampling stops at any of them, and the completion's mask ends there, untruncated, as sampling
    ended it."""
    model = tiny_model("llama", seed=7).eval()
    ids, mask = left_padded([4, 6], seed=9)
    stop = an_eos_that_ends_some_rows(model, ids, mask, steps=8)
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2, "pad_token_id": PAD})()
    kwargs = {"eos_token_id": [2, stop]}
    if given_by == "model":
        model.generation_config.eos_token_id = [stop]  # the tokenizer's 2 still ends a row
    given = kwargs if given_by == "generation_kwargs" else None
    options = SamplingOptions(1, 8, top_k=1, generation_kwargs=given, engine=engine)
    (done,) = generate_completions(
        model, [{"input_ids": ids, "attention_mask": mask}], options, tokenizer, CPU
    )
    greedy = generate(model, ids, mask, 1, do_sample=False, max_new_tokens=8, pad_token_id=PAD, **kwargs)
    completions = greedy[:, ids.shape[1] :]
    ended = torch.isin(completions, torch.tensor([2, stop])).any(-1)
    assert bool(ended.any()) and torch.equal(done.truncated, ~ended)
    lengths = torch.where(ended, torch.isin(completions, torch.tensor([2, stop])).int().argmax(-1) + 1, 8)
    assert torch.equal(done.lengths, lengths)
    assert torch.equal(done.completion_ids, completions.masked_fill(done.completion_mask == 0, PAD))


@pytest.mark.slow
def test_ranks_stay_in_step_under_fsdp2():
    """Rank 0's rows end early, rank 1's run to the limit: both ranks run every forward (the worker)."""
    from tests import torchrun

    torchrun.run_two_processes(Path(__file__).with_name("generation_worker.py"), 8, timeout=300)


@pytest.mark.slow
def test_ranks_of_other_prompt_widths_stay_in_step():
    """A processor that reads the padding makes one engine call per width of micro-batch: the ranks'
    widths differ, and every rank still makes the same calls (the worker)."""
    from tests import torchrun

    torchrun.run_two_processes(Path(__file__).with_name("rollout_widths_worker.py"), timeout=300)
