"""The config keys that change the tokenizer a run trains with (TRL's SFTConfig names): ``eos_token``,
``pad_token`` and ``chat_template_path``. Applied once, right after loading, so that everything after
reads them from the tokenizer: the EOS appended to standard text and completions, the padding of every
collator, the chat template of every conversational row, where generation stops; and the exported
tokenizer is the one trained with. As TRL does, the model's config (and generation config) is told the
new EOS and PAD ids, so the exported model agrees with its tokenizer.

Tokens are never added: an ``eos_token`` or ``pad_token`` must already be in the vocabulary, and a
tokenizer directory's chat template is taken only when every special token it adds is there too (TRL
then adds the missing ones and resizes the embeddings; fastalign refuses, naming them).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastalign.errors import one_line

#: Chat template files, as TRL recognises them.
TEMPLATE_SUFFIXES = (".jinja", ".j2")


def override_tokenizer(
    tokenizer: PreTrainedTokenizerBase,
    model: PreTrainedModel,
    eos_token: str | None = None,
    pad_token: str | None = None,
    chat_template_path: str | None = None,
) -> None:
    """Set the chat template from ``chat_template_path`` (with a tokenizer directory, also that
    tokenizer's EOS, as TRL's ``clone_chat_template``), then ``eos_token`` (so an explicit one wins),
    then ``pad_token``, on ``tokenizer`` and ``model``'s configs; None leaves each as it is. A ValueError
    names the key whose value cannot work."""
    if chat_template_path is not None:
        template, template_eos = _chat_template(tokenizer, chat_template_path)
        tokenizer.chat_template = template
        if template_eos is not None:
            _set_eos(tokenizer, model, template_eos, "chat_template_path", add=False)
    if eos_token is not None:
        _set_eos(tokenizer, model, eos_token, "eos_token", add=True)
    if pad_token is not None:
        _check_in_vocabulary(tokenizer, pad_token, "pad_token")
        tokenizer.pad_token = pad_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id


def _check_in_vocabulary(tokenizer: PreTrainedTokenizerBase, token: str, key: str) -> None:
    if token not in tokenizer.get_vocab():
        raise ValueError(
            f"config key {key!r} ({token!r}) is not a token of the tokenizer's vocabulary: it must be one "
            "token that is already there (no token is added)"
        )


def _set_eos(tokenizer, model, token: str, key: str, *, add: bool) -> None:
    """EOS on the tokenizer and the model's config; on the generation config too, where ``add`` puts it
    first among the EOS ids that already stop generation (TRL's ``eos_token``) and otherwise makes it the
    only one (TRL's ``clone_chat_template``)."""
    _check_in_vocabulary(tokenizer, token, key)
    tokenizer.eos_token = token
    eos = tokenizer.eos_token_id
    model.config.get_text_config().eos_token_id = eos
    generation = getattr(model, "generation_config", None)
    if generation is None:
        return
    if not add:
        generation.eos_token_id = eos
        return
    stops = generation.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    if eos not in stops:
        generation.eos_token_id = [eos, *stops]


def _chat_template(tokenizer: PreTrainedTokenizerBase, path_text: str) -> tuple[str, str | None]:
    """The template at ``path_text`` and, for a tokenizer directory, that tokenizer's EOS token."""
    path = Path(path_text)
    if path.is_file():
        if path.suffix not in TEMPLATE_SUFFIXES:
            raise ValueError(
                f"config key 'chat_template_path' ({path_text!r}) is a file but not a chat template: it must "
                f"end with {' or '.join(TEMPLATE_SUFFIXES)} (or be a tokenizer directory)"
            )
        return path.read_text(encoding="utf-8"), None
    if not path.is_dir():
        raise ValueError(
            f"config key 'chat_template_path' ({path_text!r}) is neither a {'/'.join(TEMPLATE_SUFFIXES)} "
            "file nor a local tokenizer directory (Hub ids are not fetched for it)"
        )
    try:
        source = AutoTokenizer.from_pretrained(path)
        template = source.get_chat_template()
    except (ValueError, OSError, KeyError) as error:
        raise ValueError(
            f"config key 'chat_template_path' ({path_text!r}): no chat template can be read from this "
            f"tokenizer directory: {one_line(error)}"
        ) from None
    vocabulary = tokenizer.get_vocab()
    added = [token.content for token in source.added_tokens_decoder.values()]
    missing = [token for token in added if token not in vocabulary]
    if missing:
        shown = ", ".join(repr(token) for token in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"config key 'chat_template_path' ({path_text!r}): its tokenizer has {len(missing)} token(s) "
            f"the model's tokenizer lacks ({shown}); TRL would add them and resize the embeddings, "
            "fastalign does not: use a template whose tokens the model has, or a .jinja file"
        )
    return template, source.eos_token
