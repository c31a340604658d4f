"""Decode attention over a prompt's keys and values held once for its ``num_generations`` completions.

Why: the rollout engine prefills each prompt once, but repeating its KV cache for the G rows that
sample from it makes every decode step read the prompt's keys and values G times. With long prompts
those reads outweigh the weights': SmolLM2-135M's cache is 46 KB a token, so 4 prompts of 550 tokens ×
8 completions read 0.8 GB of prompt KV per decode step, against 0.54 GB of weights. Holding the prompt
once (B rows, not B·G) cuts both the reads and the memory by G.

How: each full-attention cache layer is a ``SharedPrefixLayer`` (``fastalign.sampling.decode_cache``); after
the prefill (``share``) it keeps the prompts' keys and values [B, H, P, D] and, in a reserved buffer, each
row's own decoded ones [R, H, T, D], and ``update`` returns the rows' own. The attention function registered
with transformers as ``ATTENTION`` (in effect only inside ``shared_prefix_decoding``) gives each row one
softmax over [its prompt's P keys; its own T]: a prompt's rows meet its prefix in one matmul, their queries
stacked (the prefix read once per prompt), and their own keys in another. The model, its mask and every
other layer run as with ``sdpa``: the mask is built for P + T positions (``get_seq_length`` counts the
prefix), and a call this function does not cover (not a single-token decode, or an attention option it does
not implement) runs ``sdpa`` on the prefix and the row's keys concatenated, which is the repeated cache's
computation exactly.

Only a model that attends with ``sdpa`` through transformers' attention functions shares (``can_share``):
eager attention takes another mask, the flash kernels another layout, and a model calling attention
itself never reaches the swapped function.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from fastalign.sampling.decode_cache import SharedPrefixLayer

#: The attention implementation name the engine sets on the model's config while it decodes.
ATTENTION = "fastalign_shared_prefix"
#: Keyword arguments of an attention call that do not change a single-token decode's attention; any
#: other that is set (a softcap, a sliding window, sinks, a position bias, ...) takes the fallback.
_INERT = frozenset(
    {"dropout", "is_causal", "position_ids", "cache_position", "use_cache", "output_attentions"}
    | {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
)

_decoding: list = []  # the cache being decoded (at most one at a time: a stack for re-entrancy)


def can_share(model: torch.nn.Module) -> bool:
    """Whether the model attends with ``sdpa`` (the function's fallback and mask are sdpa's) through
    transformers' attention functions, which the engine swaps (Falcon, Bloom and MPT call their own:
    ``_supports_attention_backend`` is False), over a cache of its keys and values: multi-head latent
    attention (DeepSeek-V2/V3, Kimi, MiniCPM3, ...: ``kv_lora_rank``) caches a compressed latent that each
    step expands, which the shared prefix's attention cannot read as keys."""
    return (
        bool(getattr(model, "_supports_attention_backend", False))
        and getattr(model.config, "_attn_implementation", None) == "sdpa"
        and getattr(model.config.get_text_config(), "kv_lora_rank", None) is None
    )


@contextlib.contextmanager
def shared_prefix_decoding(model: torch.nn.Module, cache):
    """The model attends with ``ATTENTION`` over ``cache`` inside the block, with its own after."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    _decoding.append(cache)
    try:
        yield
    finally:
        _decoding.pop()
        config._attn_implementation = previous


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """``sdpa_attention_forward``'s contract (query [R, Hq, L, D], the cache's key and value
    [R, Hkv, T, D]; returns [R, L, Hq, D] and no weights), over the prefix and the row's own keys."""
    layer = _decoding[-1].layers[module.layer_idx] if _decoding else None
    if not isinstance(layer, SharedPrefixLayer) or not layer.shared:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    unhandled = any(value is not None for name, value in kwargs.items() if name not in _INERT)
    if query.shape[-2] != 1 or kwargs.get("dropout", 0.0) or unhandled:
        key, value = layer.full(key, layer.prefix_keys), layer.full(value, layer.prefix_values)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads  # query heads sharing a key head, adjacent (as repeat_kv lays them out)
    scale = dim**-0.5 if scaling is None else scaling
    query = query.reshape(rows, kv_heads, per_kv, dim)
    prompts, slots = layer.prompt_of_row, layer.slot_of_row
    batch, prefix = layer.prefix_keys.shape[0], layer.prefix_keys.shape[-2]

    def stacked(per_row: torch.Tensor) -> torch.Tensor:  # [R, Hkv, per_kv, X] -> [B, Hkv, slots·per_kv, X]
        out = per_row.new_zeros(batch, layer.slots, *per_row.shape[1:])
        out[prompts, slots] = per_row
        return out.transpose(1, 2).reshape(batch, kv_heads, layer.slots * per_kv, per_row.shape[-1])

    def unstacked(per_prompt: torch.Tensor) -> torch.Tensor:  # the inverse
        out = per_prompt.view(batch, kv_heads, layer.slots, per_kv, per_prompt.shape[-1]).transpose(1, 2)
        return out[prompts, slots]

    # In fp32 whatever the model's dtype (the prefix is kept in fp32: SharedPrefixLayer.share) and outside
    # autocast, rounded once at the end, as sdpa's kernels accumulate: products rounded to bf16 piece by
    # piece (scores, weights, the prefix's and the row's outputs) made greedy rollouts of a bf16 model
    # part from generate's within tens of tokens
    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        query, key, value = query.float(), key.float(), value.float()
        prefix_scores = stacked(query) @ layer.prefix_keys.transpose(-1, -2)  # [B, Hkv, slots·per_kv, P]
        prefix_scores = prefix_scores.masked_fill(~layer.prefix_mask, float("-inf"))
        scores = torch.cat([unstacked(prefix_scores), query @ key.transpose(-1, -2)], dim=-1) * scale
        weights = torch.softmax(scores, dim=-1)
        prefix_output = unstacked(stacked(weights[..., :prefix]) @ layer.prefix_values)
        output = prefix_output + weights[..., prefix:] @ value
    return output.to(dtype).reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, shared_prefix_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
