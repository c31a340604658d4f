"""A trained reward model as a GRPO/RLOO reward function, as TRL's ``GRPOTrainer`` / ``RLOOTrainer`` take a
model in ``reward_funcs``: a sequence-classification checkpoint with one label (what ``fastalign train
reward`` or TRL's ``RewardTrainer`` saves) scores each prompt + completion, and that score is the reward.

Loading (``load_reward_model``): a local directory with a config.json, or a Hub id ``org/name`` fetched
through the Hugging Face cache (``fastalign.train.loading.resolve_model``: safetensors weights only, never
a pickle), under ``AutoModelForSequenceClassification`` with the checkpoint's own tokenizer. A checkpoint
that is not a one-label sequence classifier is refused: loading a causal LM (or a classifier with another
label count) under ``num_labels=1``, as TRL would, scores with a freshly drawn random head. No
checkpoint's own code ever runs (no ``trust_remote_code``). The dtype is TRL's: the run's ``dtype`` (TRL's
``model_init_kwargs``), or where none is set the checkpoint's declared dtype (transformers 5's default).

Scoring (``RewardModel``), as TRL: conversational samples (message-list prompts) are the reward
tokenizer's chat template over prompt + completion messages (with ``chat_template_kwargs``), standard ones
the prompt text followed by the completion text; tokenized padded on the right without special tokens;
the reward is ``logits[:, 0]`` under inference mode, the model in eval mode. The tokenizer's pad token
(its EOS where it has none) is set as the model's, since a sequence classifier scores the last token that
is not padding. The metric name is the last part of the model's name or path (``rewards/<name>/mean``).

Each rank scores its own completions with its own full copy of the model on its own device: no collective,
so any rank layout works (the rewards are gathered afterwards with everything else,
``fastalign.train.rollout.gather_rewards``). TRL shards the reward model under FSDP; here it is whole on
every rank, which suits reward models up to a few billion parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastalign.errors import one_line
from fastalign.train.loading import cast_parameters, load_model_and_tokenizer, resolve_model
from fastalign.train.policy import checkpoint_dtype

#: Sequences per forward pass when scoring. TRL scores a rank's whole batch in one pass and has no option
#: to split it; its activations grow with the batch (``steps_per_generation`` × the per-device batch), so
#: passes of a fixed size bound the memory instead. Right padding makes each score independent of which
#: pass it is in: a sequence's last token attends only to the tokens before it.
SCORING_CHUNK = 32


def is_model_object(spec: object) -> bool:
    """Whether ``spec`` is a loaded reward model: a ``PreTrainedModel``, or a ``(model, tokenizer)`` pair."""
    if isinstance(spec, tuple) and len(spec) == 2:
        return isinstance(spec[0], PreTrainedModel) and isinstance(spec[1], PreTrainedTokenizerBase)
    return isinstance(spec, PreTrainedModel)


def is_model_path(spec: str) -> bool:
    """Whether the string ``spec`` names a model rather than a built-in or an import path: an existing
    directory, or (no colon, a slash) a Hub id ``org/name`` or a path. Only a Hub id with an organisation
    is taken: a bare name is a (mistyped) built-in, never a download."""
    return Path(spec).expanduser().is_dir() or (":" not in spec and "/" in spec)


class RewardModel:
    """A sequence classifier called as a reward function: ``f(prompts, completions, completion_ids,
    **columns)`` → one float per sample (the other arguments are not read)."""

    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device | str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.__name__ = name
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model = model.to(_process_device() if device is None else device).eval()
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def texts(self, prompts: Sequence, completions: Sequence) -> list[str]:
        """What the model reads: the chat template over prompt + completion messages (conversational
        prompts, as TRL's ``is_conversational`` tells them), else prompt + completion text."""
        if prompts and _is_conversation(prompts[0]):
            return [
                self.tokenizer.apply_chat_template(
                    [*prompt, *completion], tokenize=False, **self.chat_template_kwargs
                )
                for prompt, completion in zip(prompts, completions, strict=True)
            ]
        return [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence, **columns) -> list:
        texts, scores = self.texts(prompts, completions), []
        for start in range(0, len(texts), SCORING_CHUNK):
            batch = self.tokenizer(
                texts[start : start + SCORING_CHUNK],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.device)
            with torch.inference_mode():
                scores.extend(self.model(**batch).logits[:, 0].float().tolist())
        return scores


def reward_model_from_object(
    spec: PreTrainedModel | tuple[PreTrainedModel, PreTrainedTokenizerBase],
    *,
    device: torch.device | str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> RewardModel:
    """A loaded model (its dtype kept, moved to ``device``), with its tokenizer; without one, the tokenizer
    is loaded from the model's ``name_or_path``, as TRL does."""
    model, tokenizer = spec if isinstance(spec, tuple) else (spec, None)
    source = model.config._name_or_path
    what = f"{type(model).__name__} {source!r}" if source else type(model).__name__
    _check_classifier(what, model.config, [type(model).__name__])
    if tokenizer is None:
        if not source:
            raise ValueError(
                f"reward_funcs: {what} has no name_or_path to load its tokenizer from: pass a "
                "(model, tokenizer) pair"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"reward_funcs: {what}: loading its tokenizer failed: {one_line(error)}"
            ) from None
    name = _metric_name(source) or type(model).__name__
    return RewardModel(name, model, tokenizer, device, chat_template_kwargs)


def load_reward_model(
    spec: str,
    *,
    device: torch.device | str | None = None,
    dtype: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> RewardModel:
    """The reward model in directory or Hub id ``spec``, in ``dtype`` (a torch dtype's name; "auto" or
    None: the checkpoint's declared one) on ``device`` (None: this process's, as the policy's). Every
    failure is one ValueError line naming the spec."""
    local = Path(spec).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        adapter = (local / "adapter_config.json").is_file()
        hint = "a LoRA adapter: merge it into its base first (fastalign merge)" if adapter else "no model"
        raise ValueError(f"reward_funcs: {spec!r}: directory has no config.json ({hint})")
    if local.is_file():
        raise ValueError(
            f"reward_funcs: {spec!r} is a file: a reward model is a directory, a reward function "
            "'path/file.py:function'"
        )
    if not local.exists() and spec.startswith((".", "/", "~")):
        raise ValueError(f"reward_funcs: {spec!r}: no such model directory")
    path = resolve_model(str(local) if local.is_dir() else spec, key="reward_funcs")  # errors name the key
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"reward_funcs: {spec!r}: {one_line(error)}") from None
    _check_classifier(repr(spec), config, config.architectures)
    try:
        model, tokenizer = load_model_and_tokenizer(path, task="sequence_classification")
    except (OSError, ValueError) as error:
        raise ValueError(f"reward_funcs: {spec!r}: {one_line(error)}") from None
    cast_parameters(model, checkpoint_dtype(config) if dtype in (None, "auto") else getattr(torch, dtype))
    return RewardModel(_metric_name(spec), model, tokenizer, device, chat_template_kwargs)


def _check_classifier(what: str, config, architectures: Sequence[str] | None) -> None:
    """A one-label sequence classifier, or a ValueError saying what it is instead."""
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ValueError(
            f"reward_funcs: {what} is a {', '.join(architectures)}, not a sequence-classification (reward) "
            "model: it has no trained score head"
        )
    if config.num_labels != 1:
        raise ValueError(
            f"reward_funcs: {what} has num_labels={config.num_labels}; a reward model scores with one label"
        )


def _metric_name(name_or_path: str) -> str:
    """TRL's name of a reward model: the last part of its name or path (a trailing slash aside)."""
    return name_or_path.rstrip("/").split("/")[-1]


def _is_conversation(prompt: object) -> bool:
    """TRL's ``is_conversational`` for a prompt: a list whose first item is a message with a role."""
    return (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]
    )


def _process_device() -> torch.device:
    """The device this process computes on, as ``fastalign.train.distributed.init_distributed`` sets it:
    the current CUDA device (each rank's own under torchrun), else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
