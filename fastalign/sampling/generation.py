"""The rollout engine: ``num_generations`` sampled completions of each prompt, with the tokens (greedy) and
the token distribution (sampling) of ``model.generate``, for less work.

Why not ``generate`` as is: the rollout asks for G completions of each prompt, and ``generate`` given the
prompt repeated G times prefills it G times and then decodes every row until the longest completion ends,
a finished row feeding padding through the whole model at every step. On a CPU, where a decode step's
cost grows with its rows, both are paid in full; on a GPU the padding rows cost KV-cache reads. Here:

- **The prompt is prefilled once**: the unique prompts run through the model, and their last-position
  logits are repeated G times. With sdpa attention and prompts at least as long as the completions'
  limit, their KV is then held once and read once per decode step for all G rows
  (``fastalign.sampling.prefix_attention``); otherwise it is repeated G times
  (``Cache.batch_repeat_interleave``), each row appending to its own copy.
- **Finished rows leave the batch**: once an eighth of the rows in the batch have ended (an EOS), the
  batch, its cache (``Cache.batch_select_indices``) and its ids are compacted to the rows still running
  (the CUDA graphs below: once half have, each new batch size a capture).
- **On CUDA the decode steps are CUDA graphs**: they run at a fixed shape and are replayed
  (``fastalign.sampling.decode_steps``), where the model allows it and the prompts' KV is not held once;
  the eager steps (``EagerSteps``) otherwise, and on a CPU, which has no kernel launches to save.
- **Sampling draws by inverse CDF** (one uniform number per row, a binary search of the probabilities
  cumulated in float64) instead of ``torch.multinomial``, whose exponential draw over the whole vocabulary
  cost a tenth of a SmolLM2 decode step on a CPU. The distribution is the same; the draws are not
  ``generate``'s (its random stream is another).

Sampling is ``generate``'s by construction: the merged generation config (the model's
``generation_config`` under the rollout's options, as ``generate`` merges them) goes through the model's
own ``_get_logits_processor``, so temperature, top-k, top-p, min-p, repetition penalty, minimum lengths
and every other processor of ``generation_kwargs`` mean what they mean to ``generate`` on the installed
transformers (the repetition penalty's handling of left padding differs between transformers 5.17 and
5.23; each version's is kept). That method and ``_eos_token_tensor`` are transformers internals, tested on
every supported version (``tests/train/test_generation.py`` runs in the lowest-versions environment).

Under a sharded model (``synced``: FSDP, DeepSpeed ZeRO-3) a rank whose rows have all ended keeps
stepping one row until every rank's have: the sharded layers' all-gathers are collective. A model or an
option the engine cannot run (an encoder-decoder, beam search, a streamer, stop strings, a cache with
linear-attention or conv states, a quantized cache, ...) is sampled by ``generate``, said once in one log
line (``engine_refusal``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from fastalign.models.structure import base_model
from fastalign.sampling.decode_cache import ReservedLayer, SharedPrefixLayer
from fastalign.sampling.decode_steps import EagerSteps, StaticSteps, may_capture, static_refusal
from fastalign.sampling.prefix_attention import can_share, shared_prefix_decoding

try:  # transformers >= 5.23: the layers of a model's layers without attention
    from transformers.cache_utils import DummyLayer
except ImportError:
    DummyLayer = None

logger = logging.getLogger(__name__)

#: ``generate`` options the engine implements besides the logits processors' (which it takes from the
#: model): the stopping, the ids it needs and the cache (``_SAME_CACHE_IMPLEMENTATIONS``). Any other
#: generation option that is set makes the rollout use ``generate`` (``engine_refusal``).
_DECODING_OPTIONS = frozenset(
    {"do_sample", "max_new_tokens", "min_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id"}
    | {"use_cache", "cache_implementation"}
)
#: The generation-config fields that only choose logits processors (``generate``'s list, built by the
#: model): the engine applies whatever they build.
_PROCESSOR_OPTIONS = frozenset(
    {
        "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
        "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "renormalize_logits",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    }
)  # fmt: skip
#: Generation-config fields that do not change the sampled tokens of a decoder-only model.
_INERT_OPTIONS = frozenset(
    {
        "max_length", "num_return_sequences", "output_scores", "output_logits", "output_attentions",
        "output_hidden_states", "return_dict_in_generate", "cache_config",
        "decoder_start_token_id", "is_assistant", "transformers_version", "compile_config",
        "disable_compile", "low_memory", "length_penalty", "early_stopping", "num_beam_groups",
    }
)  # fmt: skip
#: What the engine reads of a model's transformers generation mixin (internals, tested on every supported
#: transformers).
_GENERATION_METHODS = ("generation_config", "_prepare_generation_config", "_get_logits_processor")
#: ``cache_implementation``s whose attention sees the keys and values the engine's cache holds: the default
#: and dynamic caches, offloaded or static (preallocated, masked). Another (``quantized`` keys and values,
#: ``paged``, the deprecated sliding-window ones) makes the rollout use ``generate``.
_SAME_CACHE_IMPLEMENTATIONS = frozenset({None, "dynamic", "offloaded", "static", "offloaded_static"})
#: Cache layers whose state is all keys and values along the batch (``batch_repeat_interleave`` and
#: ``batch_select_indices`` repeat and select all of it). A linear-attention layer's conv and recurrent
#: states, or a hybrid layer's, are not; such a model samples with ``generate``.
_BATCHED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer) + ((DummyLayer,) if DummyLayer else ())
#: Prompts at least this many times as long as the completions' limit hold their KV once for their rows
#: (``shares_prefix``). On SmolLM2 on a CPU (4 prompts × 8, 64 tokens, one thread) sharing took 35.7
#: against 46.9 CPU seconds with 772-token prompts and 20.6 against 20.8 with 50-token ones; on a GPU,
#: where a decode step's cost is its kernel launches until the KV reads outgrow them, the few extra
#: small operations per layer are not measured yet, so short prompts keep the repeated cache.
SHARE_FROM = 1
#: Tokens per block of ``_draw``'s two-level inverse CDF.
DRAW_BLOCK = 256


def merged_generation_config(model: torch.nn.Module, kwargs: dict[str, Any]):
    """The generation config ``generate`` would sample with, merged by ``generate``'s own
    ``_prepare_generation_config``: ``kwargs`` over the model's ``generation_config`` over transformers'
    global defaults (``top_k`` 50 where neither sets it, ...); a ``generation_config`` among ``kwargs``
    takes the model's config's place, as in ``generate(generation_config=...)``. Returns (config, keys of
    ``kwargs`` that are not generation-config fields)."""
    kwargs = dict(kwargs)
    config, _ = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    unused = {key: value for key, value in kwargs.items() if not hasattr(config, key)}
    return config, unused


def eos_token_ids(model: torch.nn.Module, kwargs: dict[str, Any]) -> list[int]:
    """The ids that end a row when ``generate`` (or the engine) samples with ``kwargs``: the merged
    config's ``eos_token_id``, one or several (none where nothing sets one)."""
    if all(hasattr(model, name) for name in _GENERATION_METHODS):
        value = merged_generation_config(model, kwargs)[0].eos_token_id
    else:
        value = kwargs.get("eos_token_id")
    return [] if value is None else token_id_list(value)


def reads_prompt_padding(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a logits processor of these options sees the prompts' left padding (an absolute
    ``min_length``, which counts it; a repetition penalty, n-gram or bad-word rule over the prompt's ids,
    pad ids included): then prompts padded to another width sample otherwise, and the rollout samples
    each width of micro-batch in a call of its own. The repetition penalty skips the padding on
    transformers 5.23 (``prompt_ignore_length``, from the attention mask), not on 5.17: each is asked."""
    config, _ = merged_generation_config(model, kwargs)
    return bool(
        (config.min_length and config.min_new_tokens is None)
        or (config.repetition_penalty not in (None, 1.0) and _penalty_reads_padding(model))
        or config.no_repeat_ngram_size
        or config.bad_words_ids
        or config.sequence_bias
    )


def rope_switch_length(model: torch.nn.Module) -> int | None:
    """The sequence length past which the model's rotary embedding changes with the length (None: it never
    does): a ``longrope``'s long factors past its original maximum, a ``dynamic`` one's rescaling past the
    maximum positions. Past it the frequencies of a forward depend on the longest row of its batch (which
    the engine's compactions and shared calls change), and Phi-3's ``prepare_inputs_for_generation``
    recomputes the whole cache when the sequence crosses it: the engine samples no longer as ``generate``."""
    config = model.config.get_text_config(decoder=True)
    parameters = getattr(config, "rope_parameters", None) or {}
    per_layer = parameters and all(isinstance(value, dict) for value in parameters.values())
    lengths = []
    for rope in parameters.values() if per_layer else [parameters]:
        kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if kind == "longrope":
            lengths.append(rope.get("original_max_position_embeddings", config.max_position_embeddings))
            lengths.append(getattr(config, "original_max_position_embeddings", None))  # Phi-3's recompute
        elif "dynamic" in kind:
            lengths.append(config.max_position_embeddings)
    lengths = [length for length in lengths if isinstance(length, int)]
    return min(lengths) if lengths else None


def _penalty_reads_padding(model: torch.nn.Module) -> bool:
    """Whether ``generate``'s repetition penalty counts the prompts' left padding (its pad ids penalized as
    any id of the prompt), asked of the installed transformers: it skips the padding where the processor
    it builds for a left-padded row holds the row's padding length."""
    padded = torch.tensor([[0, 1]])
    processors = model._get_logits_processor(
        GenerationConfig(repetition_penalty=2.0), input_ids_seq_length=2, device=torch.device("cpu"),
        model_kwargs={"attention_mask": padded},
    )  # fmt: skip
    penalties = [p for p in processors if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    return not penalties or not all(
        torch.is_tensor(getattr(p, "prompt_ignore_length", None)) for p in penalties
    )


def engine_refusal(model: torch.nn.Module, kwargs: dict[str, Any], width: int | None = None) -> str | None:
    """Why the engine cannot sample ``model`` with ``generate``'s ``kwargs`` (None: it can), for prompts
    left-padded to ``width`` (the widest of the rollout's; unknown: None, which refuses what it decides)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if not all(hasattr(model, name) for name in _GENERATION_METHODS):
        return f"{type(model).__name__} has no transformers generation mixin"
    config, unused = merged_generation_config(model, kwargs)
    if unused:
        return f"generation option {sorted(unused)[0]!r} is not a generation-config field"
    if config.num_beams not in (None, 1):
        return f"num_beams is {config.num_beams} (beam search)"
    if config.use_cache is False:
        return "use_cache is false"
    if config.max_new_tokens is None:
        return "max_new_tokens is not set"
    if config.eos_token_id is None:
        return "no eos_token_id is set (the engine stops rows at an end token)"
    base = base_model(model)
    if "past_key_values" not in inspect.signature(type(base).forward).parameters:
        return f"{type(base).__name__} keeps no KV cache"
    if config.cache_implementation not in _SAME_CACHE_IMPLEMENTATIONS:
        return f"cache_implementation is {config.cache_implementation!r}"
    switch = rope_switch_length(model)
    if switch is not None and (width is None or width + config.max_new_tokens - 1 > switch):
        return f"its rotary embedding changes past {switch} tokens, which the sequences may pass"
    if hasattr(model, "_supports_default_dynamic_cache") and not model._supports_default_dynamic_cache():
        return f"{type(model).__name__} does not use transformers' DynamicCache"
    for layer in DynamicCache(config=model.config).layers:
        if type(layer) not in _BATCHED_LAYERS:  # e.g. linear attention: conv and recurrent states
            return f"its cache has {type(layer).__name__} layers, which the engine cannot repeat"
    default = type(config)()  # as generate merges it: the global defaults where the model sets nothing
    default.update(**getattr(default, "_get_default_generation_params", dict)(), defaults_only=True)
    known = _DECODING_OPTIONS | _PROCESSOR_OPTIONS | _INERT_OPTIONS
    for name, value in config.to_dict().items():
        if name.startswith("_") or name in known:
            continue
        if value != getattr(default, name, None):
            return f"generation option {name!r} is set ({value!r})"
    return None


def _decode_cache(model: torch.nn.Module, shared: bool) -> DynamicCache:
    """The model's ``DynamicCache`` with each plain full-attention layer a ``ReservedLayer``, or with
    ``shared`` a ``SharedPrefixLayer`` (sliding window layers are bounded, and kept as transformers makes
    them; ``engine_refusal`` has ruled out any other kind)."""
    kind = SharedPrefixLayer if shared else ReservedLayer
    cache = DynamicCache(config=model.config)
    cache.layers = [kind() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # layers made on first use
        cache.layer_class_to_replicate = kind
    return cache


def _for_the_group(cache: DynamicCache, group: int, prompt_mask: torch.Tensor, tokens: int) -> None:
    """The prefilled cache made ready for ``group`` rows per prompt and ``tokens`` decode steps: each
    layer's prompts shared (``SharedPrefixLayer``) or repeated (and reserved: ``ReservedLayer``)."""
    for layer in cache.layers:
        if isinstance(layer, SharedPrefixLayer):
            layer.share(group, prompt_mask, tokens)
            continue
        layer.batch_repeat_interleave(group)
        if isinstance(layer, ReservedLayer):
            layer.reserve(tokens)


def shares_prefix(model: torch.nn.Module, prompt_ids: torch.Tensor, group: int, tokens: int) -> bool:
    """Whether the prompts' KV is held once for their rows (``fastalign.sampling.prefix_attention``): with
    sdpa attention, more than one row per prompt, and prompts at least ``SHARE_FROM`` times as long as
    the completions may grow."""
    return group > 1 and can_share(model) and prompt_ids.shape[1] >= SHARE_FROM * tokens


def sample_groups(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    group: int,
    kwargs: dict[str, Any],
    synced: bool = False,
    seeds: list[int] | None = None,
    static: bool | None = None,
) -> torch.Tensor:
    """``group`` completions of each left-padded prompt (``prompt_ids``/``prompt_mask``: [B, P], on the
    model's device): the [B·group, P + C] ids ``generate`` returns for the prompts repeated ``group``
    times (a prompt's completions adjacent), C the longest completion of this rank's rows (under
    ``synced`` too), ended rows padded with the pad id. ``kwargs`` are ``generate``'s sampling options;
    ``engine_refusal`` must have passed them.

    Sampling draws one uniform number per row and step, for every row (ended or not), from the global
    random state, or with ``seeds`` (one per prompt) from a generator of each prompt's own: then a
    prompt's completions do not depend on which other prompts share the call.

    ``static``: decode at a fixed shape (``fastalign.sampling.decode_steps``; CUDA graphs on a GPU), which
    the model must allow, its prompts' KV then repeated for their rows; None decides: on CUDA where the
    model allows it and the prompts' KV is not held once for their rows (which saves more memory than the
    graphs save time at that length); False: the eager steps."""
    config, _ = merged_generation_config(model, kwargs)
    device = prompt_ids.device
    eos = torch.tensor(token_id_list(config.eos_token_id), dtype=torch.long, device=device)
    pad = config.pad_token_id if config.pad_token_id is not None else int(eos[0])
    config._eos_token_tensor = eos  # what generate's _prepare_special_tokens sets; processors read it
    width = prompt_ids.shape[1]
    # generate's _prepare_generated_length: lengths count the (padded) prompt; processors read them
    config.max_length = width + config.max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = width + config.min_new_tokens
    shared = static is not True and shares_prefix(model, prompt_ids, group, config.max_new_tokens)
    cache = _decode_cache(model, shared)
    static = not shared and _decodes_static(model, cache, synced, static, device)
    output = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=_positions(prompt_mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = output.logits[:, -1].float().repeat_interleave(group, 0)
    cache = output.past_key_values
    _for_the_group(cache, group, prompt_mask, config.max_new_tokens)
    with shared_prefix_decoding(model, cache) if shared else contextlib.nullcontext():
        return _decode(
            model, cache, config, logits, prompt_ids, prompt_mask, group, synced, seeds, eos, pad, static
        )


def _decode(model, cache, config, logits, prompt_ids, prompt_mask, group, synced, seeds, eos, pad, static):
    """``sample_groups``' decode loop, from the prompts' last logits and their cache made ready for it."""
    device, width = prompt_ids.device, prompt_ids.shape[1]

    def processors(mask: torch.Tensor):
        return model._get_logits_processor(
            config, input_ids_seq_length=width, device=device, model_kwargs={"attention_mask": mask}
        )

    prompts = ids = prompt_ids.repeat_interleave(group, 0)  # ids grows (and loses ended rows); prompts stays
    mask = prompt_mask.repeat_interleave(group, 0)
    if static:
        stepper = StaticSteps(model, cache, mask, config.max_new_tokens, graphs=device.type == "cuda")
    else:
        stepper = EagerSteps(model, cache, synced)
    total = ids.shape[0]
    rows = torch.arange(total, device=device)  # each batch row's index among all rows
    ended = torch.zeros(total, dtype=torch.bool, device=device)  # of the batch's rows
    completions = torch.full((total, config.max_new_tokens), pad, dtype=torch.long, device=device)
    process = processors(mask)
    generators = None if seeds is None else [_generator(seed, device) for seed in seeds]
    steps = produced = 0  # produced: the steps up to this rank's last running row (synced: fewer than steps)
    running = True
    while steps < config.max_new_tokens:
        scores = process(ids, logits)
        if config.do_sample:
            tokens = _draw(scores, _uniforms(total, group, generators, device)[rows])
        else:
            tokens = scores.argmax(-1)
        tokens = tokens.masked_fill(ended, pad)
        completions[rows, steps] = tokens
        ended = ended | torch.isin(tokens, eos)
        steps += 1
        produced = steps if running else produced
        running = bool((~ended).any())
        if not _any_running(running, synced, device) or steps == config.max_new_tokens:
            break
        keep = stepper.keep(ended)
        if keep is not None:
            stepper.select(keep)
            ids, mask, rows, ended, tokens = ids[keep], mask[keep], rows[keep], ended[keep], tokens[keep]
            process = processors(mask)
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = stepper.step(tokens, mask)
    return torch.cat([prompts, completions[:, :produced]], dim=1)


def _decodes_static(
    model: torch.nn.Module, cache, synced: bool, asked: bool | None, device: torch.device
) -> bool:
    """Whether the decode steps over ``cache`` (not yet prefilled) run at a fixed shape (``StaticSteps``):
    where ``asked`` (which the model must allow) or, left to decide, on CUDA where the model allows them
    and its steps were never found uncapturable."""
    if asked is False or (asked is None and device.type != "cuda"):
        return False
    refusal = static_refusal(model, cache, synced)
    if refusal is None and rope_switch_length(model) is not None:
        refusal = "its rotary embedding compares the sequence's length on the host"
    if asked and refusal:
        raise ValueError(f"fixed-shape decoding is not possible: {refusal}")
    return refusal is None and (bool(asked) or (device.type == "cuda" and may_capture(model)))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` numbers a prompt's tokens."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _uniforms(total: int, group: int, generators: list | None, device: torch.device) -> torch.Tensor:
    """A uniform number in [0, 1) for each of the ``total`` rows (float64, as ``_draw`` cumulates): from
    the global random state, or ``group`` from each prompt's generator."""
    kind = dict(device=device, dtype=torch.float64)
    if generators is None:
        return torch.rand(total, **kind)
    return torch.cat([torch.rand(group, generator=generator, **kind) for generator in generators])


def _draw(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(``scores``), by inverse CDF: the first token whose cumulated
    probability exceeds the row's ``uniform`` share of the total. Cumulated in float64: in float32 a token
    below half an ulp of the running sum (3e-8 once it nears 1) adds nothing to it, so that the long tail
    of a real vocabulary could never be drawn (on SmolLM2, 2e-4 to 4e-4 of a step's distribution), and a
    uniform number's 24 bits would quantize the rest.

    In two levels, since a float64 scan over the whole vocabulary is the slow part (on a CPU a cumsum
    and a running max of [32, 49,152] took 22 and 27 ms, a fifth of a SmolLM2 decode step): the sums of
    blocks of ``DRAW_BLOCK`` tokens are cumulated to find the block the number falls in, then that block's
    tokens alone. A token of probability 0 (cut by top-k, top-p, a bad word), or a block of them, is never
    drawn: its cumulated value is set to its predecessor's (a GPU's parallel scan may otherwise give it
    an interval an ulp wide; the running maximum keeps the values sorted), and where float64 rounding
    puts the number past a block's last cumulated value, the block's last token of nonzero probability
    is taken."""
    probabilities = torch.softmax(scores, dim=-1)
    rows, vocab = probabilities.shape
    padded = torch.nn.functional.pad(probabilities, (0, -vocab % DRAW_BLOCK)).double()
    blocks = padded.view(rows, -1, DRAW_BLOCK)
    block_sums = blocks.sum(-1)
    cumulated = _nondecreasing(block_sums.cumsum(-1), block_sums)
    target = uniform.to(torch.float64)[:, None] * cumulated[:, -1:]
    block = torch.searchsorted(cumulated, target, right=True).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, cumulated.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows, device=scores.device), block.squeeze(1)]
    within = _nondecreasing(inside.cumsum(-1), inside)
    token = torch.searchsorted(within, target - before, right=True)
    positions = torch.arange(DRAW_BLOCK, device=scores.device)
    last_nonzero = torch.where(inside > 0, positions, 0).amax(-1, keepdim=True)
    token = torch.where(token >= DRAW_BLOCK, last_nonzero, token)
    return (block * DRAW_BLOCK + token).squeeze(1)


def _nondecreasing(cumulated: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``cumulated`` (a cumsum of ``values``) with each entry of a zero value set to its predecessor's."""
    return cumulated.masked_fill_(values == 0, 0).cummax(-1).values


def _any_running(local: bool, synced: bool, device: torch.device) -> bool:
    """Whether any row of any rank still samples (``synced``: one all-reduce, as generate's synced_gpus)."""
    if not synced:
        return local
    flag = torch.tensor(float(local), device=device)
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def token_id_list(value) -> list[int]:
    """An ``eos_token_id`` as configs hold it (one id or several) as a list of ints."""
    if value is None:
        raise ValueError("generation needs an eos_token_id (the tokenizer's or the model's)")
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]
