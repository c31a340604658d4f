"""SFT rows → token ids and a loss mask (1 where the token is a training target).

- text (the ``dataset_text_field`` column): all tokens, plus EOS.
- messages: the chat template's rendering; with ``assistant_only_loss`` only the assistant tokens,
  which needs a template that marks them with ``{% generation %}`` (else a clear error, never a silent
  run that trains on nothing).
- prompt + completion: the whole row's tokens (and EOS for standard text); with
  ``completion_only_loss`` (the default) only the completion's, which start where the prompt's own
  tokens (conversational: rendered with the generation prompt) and the row's first differ, as TRL
  splits them (``fastalign.data.prompt_split``).

EOS is the tokenizer's (``eos_token`` overrides it), appended as TRL appends it: to standard text and
completions only (a chat template ends turns itself), and not where the text already ends with it.
Conversational rows are rendered with their ``template_arguments`` (``tools``, ``chat_template_kwargs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from fastalign.data.chat import check_template_kwargs_apply, render_chat, template_arguments
from fastalign.data.formats import DatasetFormat, as_chatml, check_row, detect_format
from fastalign.data.prompt_split import (
    BoundaryNotes,
    special_prefix,
    split_prompt,
    text_ids,
    with_eos,
    with_prefix,
)
from fastalign.data.sources import Rows, row_origins

#: TRL 1.16's ``truncation_mode`` values: which end of an over-long row truncation keeps.
TRUNCATION_MODES = ("keep_start", "keep_end")


def check_truncation_mode(truncation_mode: str) -> None:
    """A ValueError for a value that is not one of ``TRUNCATION_MODES`` (never read as another)."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, got {truncation_mode!r}"
        )


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1: a training target

    def __len__(self) -> int:
        return len(self.input_ids)


def _has_generation_marks(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "generation" in template and "endgeneration" in template


def tokenize_sft_row(
    row: dict,
    index: int | str,
    tokenizer: PreTrainedTokenizerBase,
    fmt: DatasetFormat,
    *,
    max_length: int | None = None,
    truncation: bool = True,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    chat_template_kwargs: dict | None = None,
    prefix: list[int] | None = None,
    notes: BoundaryNotes | None = None,
) -> TokenizedExample:
    """Token ids and loss mask of one row. ``index`` names it in errors: its index in a list (``row 3``)
    or where it is written (``"train.jsonl line 4"``). A row over ``max_length`` is an error unless
    ``truncation``, which keeps its first ``max_length`` tokens, or with ``truncation_mode`` keep_end its
    last (TRL's SFTTrainer). ``chat_template_kwargs``: the config's template variables for conversational
    rows (the row's own ``chat_template_kwargs`` column wins). ``prefix``: ``special_prefix(tokenizer)``,
    computed once per data set by the caller (None: here). ``notes``: where a prompt-completion row whose
    prompt tokens are not a prefix of its sequence's is counted (``fastalign.data.prompt_split``)."""
    check_truncation_mode(truncation_mode)
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    where = index if isinstance(index, str) else f"row {index}"
    check_row(row, where, fmt)
    template = template_arguments(row, where, chat_template_kwargs) if fmt.conversational else {}
    if fmt.kind == "language_modeling" and not fmt.conversational:
        ids = with_eos(tokenizer, with_prefix(prefix, text_ids(tokenizer, row[fmt.text_field])))
        mask = [1] * len(ids)
    elif fmt.kind == "language_modeling":
        if assistant_only_loss:
            if not _has_generation_marks(tokenizer):
                raise ValueError(
                    "assistant_only_loss needs a chat template that marks assistant turns with "
                    "{% generation %} ... {% endgeneration %}; this tokenizer's template does not"
                )
            rendered = render_chat(tokenizer, row["messages"], return_assistant_tokens_mask=True, **template)
            ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
        else:
            ids = list(render_chat(tokenizer, row["messages"], **template)["input_ids"])
            mask = [1] * len(ids)
    else:
        split = split_prompt(
            tokenizer,
            row["prompt"],
            {"completion": row["completion"]},
            where,
            template=template,
            prefix=prefix,
        )
        prompt = (notes or BoundaryNotes()).note(split, where).prompt_ids
        ids = prompt + split.completions["completion"]
        only_completion = True if completion_only_loss is None else completion_only_loss
        mask = [0 if only_completion and i < len(prompt) else 1 for i in range(len(ids))]

    if max_length is not None and len(ids) > max_length:
        if not truncation:
            raise ValueError(f"{where}: {len(ids)} tokens exceed max_length={max_length} (truncation is off)")
        kept = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids, mask = ids[kept], mask[kept]
    if not any(mask):
        raise ValueError(f"{where}: no loss tokens (after truncation to max_length={max_length})")
    return TokenizedExample(ids, mask)


def _check_loss_masks_apply(options: dict, fmt) -> None:
    """A ValueError for a loss mask the data set's format has nothing to apply to (TRL refuses both): the
    assistant turns of conversational ``messages`` rows, the completions of prompt-completion rows."""
    messages = fmt.kind == "language_modeling" and fmt.conversational
    if options.get("assistant_only_loss") and not messages:
        raise ValueError(
            "config key 'assistant_only_loss' trains on the assistant turns of conversational 'messages' "
            "rows, and the data set's rows are not those"
            + (
                " (prompt-completion rows train on their whole completion; for only its assistant turns, "
                "write the rows as messages)"
                if fmt.kind != "language_modeling"
                else ""
            )
            + ": remove it"
        )
    if options.get("completion_only_loss") and fmt.kind == "language_modeling":
        raise ValueError(
            "config key 'completion_only_loss' trains on the completions of prompt-completion rows, and the "
            "data set's rows have none"
            + (" (for assistant turns: assistant_only_loss)" if fmt.conversational else "")
            + ": remove it"
        )


def tokenize_sft_dataset(
    rows: Iterable[dict], tokenizer: PreTrainedTokenizerBase, *, dataset_text_field: str = "text", **options
) -> list[TokenizedExample]:
    """Every row of a dataset (or list of dicts) in one format, standard text rows in the
    ``dataset_text_field`` column; options as ``tokenize_sft_row``. Errors name a row by its file and
    line where ``rows`` are ``Rows`` loaded from files, else by its index."""
    rows = rows if isinstance(rows, Rows) else list(rows)
    if not rows:
        raise ValueError("the dataset is empty")
    origins = row_origins(rows)
    for row, where in zip(rows, origins, strict=True):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a dict of columns, got {type(row).__name__}")
    rows = [as_chatml(row) for row in rows]  # ShareGPT's conversations, as TRL's SFTTrainer reads them
    # The first row's format: its columns with a value (a table's other columns are None there).
    columns = [key for key, value in rows[0].items() if value is not None]
    fmt = detect_format(columns, rows[0], origins[0], dataset_text_field)
    if dataset_text_field != "text" and (fmt.kind != "language_modeling" or fmt.conversational):
        raise ValueError(
            f"config key 'dataset_text_field' ({dataset_text_field!r}) names the column of text rows, and "
            "the data set's rows are not text: remove it"
        )
    check_template_kwargs_apply(options.get("chat_template_kwargs"), fmt.conversational)
    _check_loss_masks_apply(options, fmt)
    prefix, notes = special_prefix(tokenizer), BoundaryNotes()
    examples = [
        tokenize_sft_row(row, where, tokenizer, fmt, prefix=prefix, notes=notes, **options)
        for row, where in zip(rows, origins, strict=True)
    ]
    notes.warn(tokenizer)
    return examples
