"""The patched causal-LM forward: loss and per-token log-probs from the final hidden states, no logits.

Runs inside the model's own ``forward`` call, so under FSDP2 the LM head is unsharded at that moment.
Without ``labels`` or ``logprob_targets`` it is the model's original forward, unchanged.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from fastalign.models.structure import IGNORE_INDEX, decoder_body
from fastalign.ops import linear_cross_entropy, token_logprobs
from fastalign.ops.backend import Backend
from fastalign.ops.linear_cross_entropy import LinearCrossEntropyStats, Reduction, token_mean_scale
from fastalign.patching.bound import rebuildable
from fastalign.patching.modules import plain_linear


@dataclass
class FusedCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus what the fused head computed.

    token_logprobs: [B, S] log p(logprob_targets) (0 where the target is -100), when asked for.
    entropy: [B, S] entropy of the next-token distribution, with ``return_entropy=True``.
    token_stats: [B, S] detached per-target statistics of the ``labels`` loss (entropy, whether the
        target is the argmax), with ``return_token_stats=True``: what TRL's SFT metrics are made of.
    head_output: what ``head_fn`` returned, when one was given.
    aux_loss: the router's load-balancing loss (unscaled), with ``output_router_logits`` in a family
        whose ``*ForCausalLM`` computes it; the "mean" loss already includes it times
        ``router_aux_loss_coef``, as transformers' does.
    router_logits: each MoE layer's router logits, with ``output_router_logits``.
    """

    token_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    token_stats: LinearCrossEntropyStats | None = None
    head_output: object | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets of each position: the next label, -100 after the last (as transformers shifts them)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits the caller wants, as transformers selects them."""
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep, :]


def _head_inputs(head: nn.Module, hidden: torch.Tensor):
    """``(features, weight, bias)`` with ``features·weightᵀ + bias`` equal to ``head(hidden)`` (up to the
    rounding of the sums), or None where the head is not one of these:

    - a plain ``nn.Linear``: ``(hidden, weight, bias)``;
    - peft's ``ModulesToSaveWrapper``: the module it runs (the trainable copy, or the original);
    - peft's LoRA ``Linear`` over a plain linear, vanilla adapters: ``base(x) + s·B(A(dropout(x)))`` for
      each active adapter is ``[x, A(dropout(x)), ...]·[W, s·B, ...]ᵀ + b``, exactly, dropout included,
      and both A and B get their gradients (the features and the weight carry them).
    """
    if plain_linear(head):
        return hidden, head.weight, head.bias
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return None
    if hasattr(head, "_hf_hook") or head._forward_hooks or head._forward_pre_hooks:  # the call, not its parts
        return None
    if type(head) is ModulesToSaveWrapper:
        active = head.active_adapters
        if head.disable_adapters or not active:
            return _head_inputs(head.original_module, hidden)
        if active[0] not in head.modules_to_save:
            return None
        return _head_inputs(head.modules_to_save[active[0]], hidden)
    if type(head) is not LoraLinear or not plain_linear(head.base_layer):
        return None
    base = head.base_layer
    if head.merged:  # peft runs the base layer (unmerging first when adapters are disabled)
        return None if head.disable_adapters else (hidden, base.weight, base.bias)
    if head.disable_adapters:
        return hidden, base.weight, base.bias
    features, weights, bias, x = [hidden], [base.weight], base.bias, hidden
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if name in head.lora_variant:  # DoRA and the like: not a sum of linears
            return None
        lora_a, lora_b, scaling = head.lora_A[name], head.lora_B[name], head.scaling[name]
        x = head._cast_input_dtype(x, lora_a.weight.dtype)
        features.append(lora_a(head.lora_dropout[name](x)).to(hidden.dtype))
        weights.append((lora_b.weight * scaling).to(base.weight.dtype))
        if lora_b.bias is not None:
            extra = (lora_b.bias * scaling).to(base.weight.dtype)
            bias = extra if bias is None else bias + extra
    if len(features) == 1:
        return hidden, base.weight, bias
    return torch.cat(features, dim=-1), torch.cat(weights, dim=1), bias


@rebuildable
def fused_causal_lm_forward(
    backend: Backend,
    return_logits_default: bool,
    logit_scale: Callable[[PretrainedConfig], float] | None = None,
    router_aux_loss: bool = False,
    original_with_router_logits: bool = False,
) -> Callable:
    """The forward of a family whose ``*ForCausalLM`` computes ``lm_head(hidden) · logit_scale(config)``
    (Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``), then the config's
    ``final_logit_softcapping``. The fused paths scale the hidden states and the head bias instead:
    ``(s·h)Wᵀ + s·b = s·(hWᵀ + b)``, exactly so in floating point for the powers of two that the
    published scales are.

    With ``router_aux_loss`` (Mixtral, Qwen-MoE, GPT-OSS), ``output_router_logits`` (the argument, else
    the config's) adds ``router_aux_loss_coef · load_balancing_loss_func(router_logits, num_experts,
    num_experts_per_tok, attention_mask)`` to the loss, the family's own function with its
    ``*ForCausalLM``'s arguments, so a patched model trains on transformers' loss. With
    ``original_with_router_logits`` (the generic patch, which does not know how the family adds a router
    loss), a loss asked for with ``output_router_logits`` is the original forward's."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        *,
        logprob_targets: torch.LongTensor | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        return_logits: bool | None = None,
        loss_reduction: Reduction = "mean",
        return_token_stats: bool = False,
        head_fn: Callable[..., object] | None = None,
        **kwargs,
    ):
        """Causal-LM forward with the fused head (see ``fastalign.patch_model``).

        labels: as transformers takes them (shifted here; or pass ``shift_labels``); the loss honours
            ``num_items_in_batch`` and ``ignore_index``. No logits are built unless ``return_logits=True``
            or (``return_logits`` unset) the model is evaluated: with ``labels``, in eval mode and with
            gradients off, as transformers.Trainer's evaluation runs it (its ``compute_metrics`` needs
            them); ``return_logits=False`` leaves them out there too.
        return_dict: False returns ``output.to_tuple()`` (the argument, else the config's), as
            transformers does, with the logits (``return_logits`` unset): a tuple leaves out what is
            None, so without them its second element would be another output than transformers'.
        loss_reduction: "mean" (transformers' loss), or "none": the loss of each position [B, S] (its
            next label's; 0 where ignored), differentiable, for losses that weight tokens (SFT's DFT);
            the router's ``aux_loss`` is not in it (add ``router_aux_loss_coef · output.aux_loss``).
        return_token_stats: also return the ``labels`` loss's per-target ``token_stats``.
        logprob_targets: [B, S] token ids whose per-position log-probs (at ``temperature``) come back
            as ``output.token_logprobs``, for DPO/GRPO-style trainers (already aligned: position t
            scores logprob_targets[:, t]; -100 skips a position).
        head_fn: ``head_fn(hidden [B, S, D], lm_head.weight, lm_head.bias)`` runs on the final hidden
            states inside this forward (so under FSDP2 the head weight is unsharded), and its result
            comes back as ``output.head_output``: how a loss module that takes hidden states
            (``fastalign.losses``) trains a patched model. For a family with a logit scale, hidden and
            bias come scaled, so that ``hidden·weightᵀ + bias`` are the model's logits. With a peft
            LoRA ``lm_head``, hidden is [B, S, D + r] and weight [V, D + r]: the adapters' features and
            scaled ``lora_B`` weights appended (``_head_inputs``), so that this still holds. A family
            with a final-logit softcap (Gemma-2's ``final_logit_softcapping``) passes it as
            ``head_fn(..., softcap=s)``, for the fused ops' ``softcap=``: the model's logits are then
            ``s·tanh((hidden·weightᵀ + bias)/s)``; a ``head_fn`` without that parameter (or ``**kwargs``)
            is refused there.
        """
        shifted = kwargs.pop("shift_labels", None)
        # transformers' ``can_return_tuple``: the argument, else the config's; the body always returns
        # its output object here, and the result becomes a tuple at the end
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        inputs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if labels is None and shifted is None and logprob_targets is None and head_fn is None:
            original = type(self).forward
            return original(self, **inputs, logits_to_keep=logits_to_keep, return_dict=return_dict, **kwargs)
        router_logits = kwargs.get("output_router_logits")
        if router_logits is None:
            router_logits = getattr(self.config, "output_router_logits", False)
        original_needed = router_logits and original_with_router_logits and not router_aux_loss
        fastalign_call = logprob_targets is not None or head_fn is not None or return_token_stats
        if original_needed and not fastalign_call and loss_reduction == "mean":
            # a mixture of experts whose load-balancing loss this head does not know how to add (the
            # generic patch): the original forward, which adds it. A call asking for what only the fused
            # head gives (token stats, per-token losses, log-probs, a head function) keeps it: its caller
            # adds the router loss itself (fastalign's objectives do, from the returned router logits)
            return type(self).forward(
                self, **inputs, labels=labels, logits_to_keep=logits_to_keep, return_dict=return_dict,
                shift_labels=shifted, **kwargs,
            )  # fmt: skip
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        # transformers' loss: a target equal to ignore_index is skipped (the fused loss skips -100)
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        if not return_dict:
            kwargs["return_dict"] = True
        if router_aux_loss:  # as the family's forward: the argument, else the config's
            if kwargs.get("output_router_logits") is None:
                kwargs["output_router_logits"] = self.config.output_router_logits
        outputs = decoder_body(self)(**inputs, **kwargs)
        hidden = _keep_positions(outputs.last_hidden_state, logits_to_keep)
        scale = None if logit_scale is None else logit_scale(self.config)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        fused = dict(softcap=softcap, backend=backend)
        head = _head_inputs(self.lm_head, hidden)
        head_logits = None
        if head is None:  # a head that is not a sum of linears (DoRA, quantized, offloaded): its own forward
            unsupported = [
                name
                for name, used in (
                    ("logprob_targets", logprob_targets is not None),
                    ("head_fn", head_fn is not None),
                    ("return_token_stats", return_token_stats),
                )
                if used
            ]
            if unsupported:
                raise ValueError(
                    f"{', '.join(unsupported)} needs a linear LM head (nn.Linear, or peft LoRA on one); this "
                    f"model's lm_head is a {type(self.lm_head).__name__}"
                )
            head_logits = _scaled_logits(self.lm_head(hidden), scale, softcap)
            head_hidden = weight = head_bias = None
        else:
            head_hidden, weight, bias = head
            head_bias = bias
            if scale is not None:
                head_hidden = head_hidden * scale
                head_bias = None if bias is None else bias * scale

        loss = token_stats = None
        if labels is not None or shifted is not None:
            targets = shifted if shifted is not None else shift_labels(labels)
            if ignore_index != IGNORE_INDEX:
                targets = targets.masked_fill(targets == ignore_index, IGNORE_INDEX)
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(hidden.device)
        if head_logits is not None and (labels is not None or shifted is not None):
            flat = head_logits.float().flatten(0, -2)
            per_token = F.cross_entropy(
                flat, targets.to(flat.device).flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            ).view(targets.shape)
            if loss_reduction == "none":
                loss = per_token
            else:  # transformers' fixed_cross_entropy, with the fused head's divisor (a batch without a
                # target: 0, not 0/0)
                loss = per_token.sum() * token_mean_scale(targets, IGNORE_INDEX, num_items_in_batch)
        elif labels is not None or shifted is not None:
            loss = linear_cross_entropy(
                head_hidden,
                weight,
                targets.to(hidden.device),
                head_bias,
                reduction=loss_reduction,
                num_items_in_batch=num_items_in_batch if loss_reduction == "mean" else None,
                return_stats=return_token_stats,
                **fused,
            )
            loss, token_stats = loss if return_token_stats else (loss, None)

        aux_loss = None
        if router_aux_loss and kwargs["output_router_logits"]:
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux_loss = balance(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            if loss is not None and loss_reduction == "mean":
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)

        logprobs = entropy = None
        if logprob_targets is not None:
            result = token_logprobs(
                head_hidden,
                weight,
                logprob_targets.to(hidden.device),
                head_bias,
                temperature=temperature,
                return_entropy=return_entropy,
                **fused,
            )
            logprobs, entropy = result if return_entropy else (result, None)

        head_output = None
        if head_fn is not None:
            if softcap is None:
                head_output = head_fn(head_hidden, weight, head_bias)
            elif _takes_softcap(head_fn):
                head_output = head_fn(head_hidden, weight, head_bias, softcap=softcap)
            else:
                raise ValueError(
                    f"head_fn takes no softcap, so it cannot apply final_logit_softcapping ({softcap}) of "
                    f"{self.config.model_type}: give it a softcap parameter (the fused ops take softcap=), "
                    "or use logprob_targets"
                )

        if return_logits is None:  # evaluation (eval mode, no gradients: transformers.Trainer's
            # prediction_step) gets the logits the unpatched model returns with its loss, for
            # compute_metrics; training keeps the fused head's saving
            evaluating = loss is not None and not self.training and not torch.is_grad_enabled()
            return_logits = return_logits_default or evaluating or not return_dict
        logits = None
        if return_logits:
            logits = (
                head_logits
                if head_logits is not None
                else _scaled_logits(self.lm_head(hidden), scale, softcap)
            )
        output = FusedCausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            token_logprobs=logprobs,
            entropy=entropy,
            token_stats=token_stats,
            head_output=head_output,
            aux_loss=aux_loss,
            router_logits=getattr(outputs, "router_logits", None),
        )
        return output if return_dict else _as_tuple(output, router_aux_loss)

    return forward


#: The places of transformers' outputs in a tuple (``return_dict=False``): ``CausalLMOutputWithPast``'s,
#: and ``MoeCausalLMOutputWithPast``'s (the router's loss second) for a family that adds it.
_TUPLE_ORDER = ("loss", "logits", "past_key_values", "hidden_states", "attentions")
_MOE_TUPLE_ORDER = (
    "loss",
    "aux_loss",
    "logits",
    "past_key_values",
    "hidden_states",
    "attentions",
    "router_logits",
)


def _as_tuple(output: FusedCausalLMOutput, moe: bool) -> tuple:
    """``output`` as the tuple transformers' forward returns (what is None left out, as ``to_tuple``),
    then what only the fused head computes."""
    order = _MOE_TUPLE_ORDER if moe else _TUPLE_ORDER
    names = order + tuple(name for name in output.keys() if name not in order)
    return tuple(getattr(output, name) for name in names if getattr(output, name) is not None)


def _takes_softcap(head_fn: Callable) -> bool:
    """Whether ``head_fn`` has a ``softcap`` parameter (or takes any keyword)."""
    parameters = inspect.signature(head_fn).parameters.values()
    return any(p.name == "softcap" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _scaled_logits(logits: torch.Tensor, scale: float | None, softcap: float | None) -> torch.Tensor:
    """The family's logits from ``lm_head``'s output: times the logit scale, then softcapped."""
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
