"""Conversations → token ids through the tokenizer's own chat template, shared by the SFT and the
preference formats so that a conversational prompt and its completion split the same way in both."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **kwargs) -> dict:
    """The chat template's rendering of ``messages``, tokenized by the template call itself (so the
    special tokens are exactly the template's, none added twice): ``input_ids``, plus ``assistant_masks``
    with ``return_assistant_tokens_mask=True``. ``kwargs`` go to ``apply_chat_template``."""
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def conversation_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: list[dict]) -> list[int]:
    """The tokens of a conversational prompt, ending with the generation prompt (the assistant turn's
    opening, after which a completion starts)."""
    return list(render_chat(tokenizer, prompt, add_generation_prompt=True)["input_ids"])


def conversation_completion_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict],
    prompt_ids: list[int],
    completion: list[dict],
    where: str,
    field: str,
) -> list[int]:
    """The tokens of the ``completion`` messages: the rendering of prompt + completion after the
    prompt's own rendering (``prompt_ids``, with the generation prompt), which must be its prefix."""
    ids = list(render_chat(tokenizer, prompt + completion)["input_ids"])
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"{where}: the chat template does not render the prompt as a prefix of the "
            f"prompt + {field} conversation, so the completion tokens cannot be found"
        )
    return ids[len(prompt_ids) :]
