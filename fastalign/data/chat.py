"""Conversations → token ids through the tokenizer's own chat template, shared by the SFT and the
preference formats so that a conversational prompt and its completion split the same way in both.

Every rendering of a row passes the same template arguments (``template_arguments``), built as TRL's
trainers build them: the row's ``tools`` column, the config's ``chat_template_kwargs``, then the row's
own ``chat_template_kwargs`` column."""

from __future__ import annotations

import json

from transformers import PreTrainedTokenizerBase


def template_arguments(row: dict, where: str, chat_template_kwargs: dict | None = None) -> dict:
    """The ``apply_chat_template`` arguments of one conversational row: ``tools`` from its ``tools``
    column (a list of tool schemas or functions' JSON schemas, or that list as JSON text, as a dataset
    column often stores it; absent or None: no tools), then ``chat_template_kwargs`` (the config's,
    e.g. ``{"enable_thinking": False}``), then the row's ``chat_template_kwargs`` column, which wins
    where both name a key. A ValueError names the row for a column of the wrong kind."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ValueError(f"{where}: 'tools' is text but not JSON (a list of tool schemas)") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: 'tools' must be a list of tool schemas, got {type(tools).__name__}")
    own = row.get("chat_template_kwargs")
    if own is not None and not isinstance(own, dict):
        raise ValueError(
            f"{where}: 'chat_template_kwargs' must be a mapping of template variables, "
            f"got {type(own).__name__}"
        )
    return {"tools": tools, **(chat_template_kwargs or {}), **(own or {})}


def check_template_kwargs_apply(chat_template_kwargs: dict | None, conversational: bool) -> None:
    """A ValueError when the config sets ``chat_template_kwargs`` for a data set of text rows, which no
    template renders (the key would be ignored)."""
    if chat_template_kwargs and not conversational:
        raise ValueError(
            "config key 'chat_template_kwargs' sets chat template variables, but the data set's rows are "
            "text, which no chat template renders: remove it"
        )


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **kwargs) -> dict:
    """The chat template's rendering of ``messages``, tokenized by the template call itself (so the
    special tokens are exactly the template's, none added twice): ``input_ids``, plus ``assistant_masks``
    with ``return_assistant_tokens_mask=True``. ``kwargs`` go to ``apply_chat_template``."""
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def conversation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: list[dict], template: dict | None = None
) -> list[int]:
    """The tokens of a conversational prompt, ending with the generation prompt (the assistant turn's
    opening, after which a completion starts). ``template``: the row's ``template_arguments``."""
    return list(render_chat(tokenizer, prompt, add_generation_prompt=True, **(template or {}))["input_ids"])
