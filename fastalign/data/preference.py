"""TRL's preference, unpaired (KTO) and prompt-only formats → token ids → micro-batches.

- preference (DPO, ORPO, SimPO, CPO): ``prompt``, ``chosen`` and ``rejected``; or only ``chosen`` and
  ``rejected`` (implicit prompt: their shared beginning, as TRL's ``extract_prompt`` finds it);
- unpaired (KTO): ``prompt``, ``completion`` and a bool ``label`` (True: desirable), or preference pairs,
  which KTO unpairs as TRL's KTOTrainer does;
- prompt-only (GRPO): ``prompt``, and any other columns the reward functions read (e.g. ``answer``).

A row's text fields are all strings (standard) or all lists of messages (conversational). Prompts and
completions are kept apart because the losses score completions only. Standard completions end with
EOS so the model learns to stop (unless they already end with it, as TRL appends it); conversational
prompts are rendered with the generation prompt, and a conversational completion is what the full
conversation's rendering adds to the prompt's. Every rendering of a row passes its ``template_arguments``
(its ``tools`` and ``chat_template_kwargs`` columns over the config's ``chat_template_kwargs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from fastalign.data.chat import check_template_kwargs_apply, conversation_prompt_ids, template_arguments
from fastalign.data.collate import PaddingCollator
from fastalign.data.formats import check_messages
from fastalign.data.prompt_split import (
    BoundaryNotes,
    Split,
    common_prefix_length,
    special_prefix,
    split_prompt,
    text_ids,
    with_eos,
    with_prefix,
)
from fastalign.data.sft import TokenizedExample, check_truncation_mode
from fastalign.data.sources import Rows, row_origins


@dataclass(frozen=True)
class PreferenceExample:
    prompt_ids: list[int]
    chosen_ids: list[int]  # the chosen completion's tokens only
    rejected_ids: list[int]
    ref_chosen_logp: float | None = None  # set when reference log-probs are precomputed
    ref_rejected_logp: float | None = None
    # where the chosen and the rejected rows start in prompt_ids: 0 but after keep_end truncation, which
    # cuts each prompt + completion at its start on its own (``Fitted.prompt_starts``)
    chosen_prompt_start: int = 0
    rejected_prompt_start: int = 0
    # how many of the chosen's (rejected's) first tokens are not scored: the prompt's own tokens where the
    # other completion merged into the prompt's end and this one did not (TRL's CPO trainer, ``Split.shared``)
    chosen_unscored: int = 0
    rejected_unscored: int = 0


@dataclass(frozen=True)
class KTOExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool  # True: a desirable completion
    # KTO's mismatched completion for the KL estimate (``with_mismatched_completions``): fixed per example
    # so that precomputed reference log-probs stay valid however the examples are later batched (in
    # evaluation too). None: the previous example of the micro-batch's.
    kl_completion_ids: list[int] | None = None
    ref_logp: float | None = None
    # the completion before truncation cut it to fit this row's prompt: what another row's mismatched
    # completion starts from (TRL rotates the completions whole, then cuts each sequence); None: the same
    whole_completion_ids: list[int] | None = None
    ref_kl_logp: float | None = None


@dataclass(frozen=True)
class PromptExample:
    prompt_ids: list[int]
    prompt: str | list[dict]  # as in the dataset, for the reward functions
    columns: dict[str, object]  # every other column of the row, for the reward functions


def _nonempty(
    rows: Iterable[dict], fields: tuple[str, ...], chat_template_kwargs: dict | None
) -> list[tuple[dict, str]]:
    """Each row with what errors call it: its file and line (``Rows`` from files) or ``row <index>``;
    and a ValueError where ``chat_template_kwargs`` is set but no row has messages in ``fields``."""
    rows = rows if isinstance(rows, Rows) else list(rows)
    if not rows:
        raise ValueError("the dataset is empty")
    named = list(zip(rows, row_origins(rows), strict=True))
    for row, where in named:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a dict of columns, got {type(row).__name__}")
    conversational = any(isinstance(row.get(field), list) for row, _ in named for field in fields)
    check_template_kwargs_apply(chat_template_kwargs, conversational)
    return named


def _is_conversational(row: dict, where: str, fields: tuple[str, ...]) -> bool:
    """Whether the fields are all messages (True) or all text (False); a ValueError otherwise."""
    for field in fields:
        value = row.get(field)
        if value is None:
            raise ValueError(f"{where}: missing {field!r}")
        if not isinstance(value, (str, list)):
            raise ValueError(
                f"{where}: {field!r} must be text or a list of messages, got {type(value).__name__}"
            )
    messages = [field for field in fields if isinstance(row[field], list)]
    if messages and len(messages) < len(fields):
        text = [field for field in fields if field not in messages]
        raise ValueError(f"{where}: mixed formats: {messages} are messages but {text} text")
    for field in messages:
        check_messages(row[field], where, field)
    return bool(messages)


def _template(row: dict, where: str, conversational: bool, chat_template_kwargs: dict | None) -> dict:
    """The row's chat template arguments (none for standard text, which no template renders)."""
    return template_arguments(row, where, chat_template_kwargs) if conversational else {}


@dataclass(frozen=True)
class Fitted:
    """A prompt and its completions within the length limits. ``prompt_starts``: where each completion's
    row starts in ``prompt_ids`` (0 but with ``truncation_mode`` keep_end, where a row keeps its last
    ``max_length`` tokens, so a longer completion's row starts further into the prompt, or past it)."""

    prompt_ids: list[int]
    completions: dict[str, list[int]]
    prompt_starts: dict[str, int]


@dataclass(frozen=True)
class LengthLimits:
    """TRL's length options, the same for every format here: ``max_length`` bounds prompt + each
    completion, ``max_prompt_length`` the prompt; a longer row is an error unless ``truncation``.
    ``truncation_mode`` (TRL's DPOConfig; KTO and the prompt-only data keep the start) says which end of
    prompt + completion truncation keeps."""

    max_length: int | None = None
    max_prompt_length: int | None = None
    truncation: bool = False
    truncation_mode: str = "keep_start"

    def __post_init__(self) -> None:
        check_truncation_mode(self.truncation_mode)

    def fit(self, prompt_ids: list[int], completions: dict[str, list[int]], where: str) -> Fitted:
        """TRL's truncation: a prompt over ``max_prompt_length`` keeps its end (next to the completion);
        prompt + completion over ``max_length`` keeps its start (the completion is cut; a prompt that
        leaves it no room is an error) or with keep_end its end (the prompt is cut first, each row on its
        own, as TRL's preference collator cuts each sequence)."""
        max_length, max_prompt_length = self.max_length, self.max_prompt_length
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            if not self.truncation:
                raise ValueError(
                    f"{where}: the prompt has {len(prompt_ids)} tokens, over "
                    f"max_prompt_length={max_prompt_length} (truncation is off)"
                )
            prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
        if max_length is None:
            return Fitted(prompt_ids, completions, dict.fromkeys(completions, 0))
        room = max_length - len(prompt_ids)
        for field, ids in completions.items():
            if len(ids) > room and not self.truncation:
                raise ValueError(
                    f"{where}: prompt + {field!r} has {len(prompt_ids) + len(ids)} tokens, over "
                    f"max_length={max_length} (truncation is off)"
                )
        if self.truncation_mode == "keep_end":
            return _keep_end(prompt_ids, completions, max_length)
        if room <= 0 and completions:
            raise ValueError(
                f"{where}: no {next(iter(completions))!r} tokens fit in max_length={max_length} after the "
                f"{len(prompt_ids)}-token prompt: raise max_length, or cut prompts with max_prompt_length"
            )
        return Fitted(
            prompt_ids,
            {field: ids[:room] for field, ids in completions.items()},
            dict.fromkeys(completions, 0),
        )


def _keep_end(prompt_ids: list[int], completions: dict[str, list[int]], max_length: int) -> Fitted:
    """Each prompt + completion's last ``max_length`` tokens; ``prompt_ids`` only as far back as the
    row that starts earliest in it needs."""
    starts = {field: max(0, len(prompt_ids) + len(ids) - max_length) for field, ids in completions.items()}
    first = min(starts.values(), default=0)
    return Fitted(
        prompt_ids[first:],
        {field: ids[-max_length:] for field, ids in completions.items()},
        {field: min(start, len(prompt_ids)) - first for field, start in starts.items()},
    )


def implicit_prompt_length(chosen: str | list, rejected: str | list) -> int:
    """How much of ``chosen`` (characters, or messages) is the prompt it shares with ``rejected``, as TRL's
    ``extract_prompt`` finds it: up to the first that differs, less a space right before it (the space
    goes to the completions); where one is the other's beginning, one short of the shorter (TRL's loop ends
    on the last index it compared)."""
    shared = common_prefix_length(chosen, rejected)
    if 0 < shared < min(len(chosen), len(rejected)) and chosen[shared - 1] == " ":
        return shared - 1
    if shared == min(len(chosen), len(rejected)):
        return max(shared - 1, 0)
    return shared


#: Pairs per batch of TRL's unpairing (``unpair_preference_dataset``: ``datasets.map``'s default batch
#: size): the unpaired rows of each are its pairs' chosen completions, then their rejected ones.
UNPAIR_BATCH = 1000


def _unpaired(named: list[tuple[dict, str]]) -> list[tuple[dict, str]]:
    """Preference pairs as KTO's unpaired rows, as TRL's KTOTrainer makes them (``extract_prompt`` where
    the prompt is implicit, then ``unpair_preference_dataset``): each pair's chosen completion desirable, its
    rejected one undesirable, in TRL's order; a pair's other columns go with both."""
    unpaired = []
    for start in range(0, len(named), UNPAIR_BATCH):
        chosen_rows, rejected_rows = [], []
        for row, where in named[start : start + UNPAIR_BATCH]:
            missing = [key for key in ("chosen", "rejected") if row.get(key) is None]
            if missing:
                raise ValueError(
                    f"{where}: missing {missing[0]!r} (the first row is a preference pair, which KTO "
                    "unpairs: every row must be one, or every row prompt, completion and label)"
                )
            prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
            if prompt is None:
                shared = implicit_prompt_length(chosen, rejected)
                prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            rest = {key: value for key, value in row.items() if key not in ("prompt", "chosen", "rejected")}
            chosen_rows.append(
                ({**rest, "prompt": prompt, "completion": chosen, "label": True}, f"{where} (chosen)")
            )
            rejected_rows.append(
                ({**rest, "prompt": prompt, "completion": rejected, "label": False}, f"{where} (rejected)")
            )
        unpaired += chosen_rows + rejected_rows
    return unpaired


def _split_preference_row(
    row: dict,
    where: str,
    tokenizer: PreTrainedTokenizerBase,
    chat_template_kwargs: dict | None,
    prefix: list[int],
) -> Split:
    explicit = row.get("prompt") is not None
    fields = ("prompt", "chosen", "rejected") if explicit else ("chosen", "rejected")
    conversational = _is_conversational(row, where, fields)
    chosen, rejected = row["chosen"], row["rejected"]
    if explicit:
        prompt = row["prompt"]
    elif conversational:
        # TRL's extract_prompt: the shared leading messages; the completions start at the first
        # message that differs, which must be an assistant turn in both (what the prompt asks for).
        shared = common_prefix_length(chosen, rejected)
        if shared == 0 or any(
            shared == len(messages) or messages[shared]["role"] != "assistant"
            for messages in (chosen, rejected)
        ):
            raise ValueError(
                f"{where}: 'chosen' and 'rejected' must share their first messages (the prompt), "
                f"then both go on with a different assistant turn; they first differ at message {shared}"
            )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        # TRL's extract_prompt, then split as an explicit prompt, as TRL's DPO trainer tokenizes one
        shared = implicit_prompt_length(chosen, rejected)
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    template = _template(row, where, conversational, chat_template_kwargs)
    return split_prompt(
        tokenizer, prompt, {"chosen": chosen, "rejected": rejected}, where, template=template, prefix=prefix
    )


def tokenize_preference_dataset(
    rows: Iterable[dict],
    tokenizer: PreTrainedTokenizerBase,
    *,
    cpo_special_tokens: bool = False,
    chat_template_kwargs: dict | None = None,
    **limits,
) -> list[PreferenceExample]:
    """Every row of a preference dataset, explicit or implicit prompt, standard or conversational.

    ``limits`` are ``LengthLimits``' fields: ``max_length`` bounds prompt + chosen and prompt + rejected;
    a longer row is an error unless ``truncation``, which keeps the prompt's last ``max_prompt_length``
    tokens and cuts completions (with ``truncation_mode`` keep_end, each row's start instead).
    ``cpo_special_tokens``: as TRL 1.16's CPO and ORPO trainers tokenize: text without the tokenizer's
    own special tokens, then each prompt starts with its BOS and each completion ends with its EOS where
    they do not already, conversational rows too (its DPO trainer writes neither); and each completion's
    scored tokens start where it diverges from the prompt (DPO's where the earlier of the two does).
    ``chat_template_kwargs``: the config's template variables for conversational rows."""
    fit = LengthLimits(**limits).fit
    prefix = [] if cpo_special_tokens else special_prefix(tokenizer)
    notes = BoundaryNotes()
    examples = []
    for row, where in _nonempty(rows, ("prompt", "chosen", "rejected"), chat_template_kwargs):
        split = notes.note(_split_preference_row(row, where, tokenizer, chat_template_kwargs, prefix), where)
        prompt_ids, completions = split.prompt_ids, split.completions
        if cpo_special_tokens:
            if tokenizer.bos_token_id is not None:
                prompt_ids = with_prefix([tokenizer.bos_token_id], prompt_ids)
            completions = {name: with_eos(tokenizer, ids) for name, ids in completions.items()}
        unscored = split.shared if cpo_special_tokens else dict.fromkeys(completions, 0)
        fitted = fit(prompt_ids, completions, where)
        examples.append(
            PreferenceExample(
                fitted.prompt_ids,
                fitted.completions["chosen"],
                fitted.completions["rejected"],
                chosen_prompt_start=fitted.prompt_starts["chosen"],
                rejected_prompt_start=fitted.prompt_starts["rejected"],
                chosen_unscored=unscored["chosen"],
                rejected_unscored=unscored["rejected"],
            )
        )
    notes.warn(tokenizer)
    return examples


def tokenize_kto_dataset(
    rows: Iterable[dict],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template_kwargs: dict | None = None,
    **limits,
) -> list[KTOExample]:
    """Every row of an unpaired preference dataset, or of a paired one unpaired as TRL's KTOTrainer does
    (``_unpaired``); ``chat_template_kwargs`` and ``limits`` as ``tokenize_preference_dataset``'s."""
    lengths = LengthLimits(**limits)
    prefix, notes = special_prefix(tokenizer), BoundaryNotes()
    examples = []
    named = _nonempty(rows, ("prompt", "completion", "chosen", "rejected"), chat_template_kwargs)
    if "chosen" in named[0][0] and "rejected" in named[0][0] and "completion" not in named[0][0]:
        named = _unpaired(named)
    for row, where in named:
        conversational = _is_conversational(row, where, ("prompt", "completion"))
        label = row.get("label")
        if label is None:
            raise ValueError(f"{where}: missing 'label'")
        if not isinstance(label, bool):  # "false" is truthy: only a bool surely says which side
            raise ValueError(f"{where}: 'label' must be a bool (True: desirable), got {label!r}")
        template = _template(row, where, conversational, chat_template_kwargs)
        split = split_prompt(
            tokenizer,
            row["prompt"],
            {"completion": row["completion"]},
            where,
            template=template,
            prefix=prefix,
        )
        fitted = lengths.fit(split.prompt_ids, notes.note(split, where).completions, where)
        completion, whole = fitted.completions["completion"], split.completions["completion"]
        whole = None if whole == completion else whole  # kept only where truncation cut it
        examples.append(KTOExample(fitted.prompt_ids, completion, label, whole_completion_ids=whole))
    notes.warn(tokenizer)
    return examples


def with_mismatched_completions(
    examples: Sequence[KTOExample], block: int, max_length: int | None
) -> list[KTOExample]:
    """Each example with KTO's mismatched completion, as TRL 1.16's KTOTrainer pairs them: within each block
    of ``block`` consecutive examples (its ``per_device_train_batch_size``, so that under sequential
    sampling a micro-batch's mismatched completions are its own completions, each with another prompt) the
    completions rotate by one: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), whole (as tokenized, before
    truncation fitted them to their own prompts), each then cut to what fits after its new prompt in
    ``max_length`` (TRL's collator keeps a sequence's start)."""
    paired = []
    for start in range(0, len(examples), block):
        chunk = examples[start : start + block]
        for index, example in enumerate(chunk):
            room = None if max_length is None else max(1, max_length - len(example.prompt_ids))
            other = chunk[index - 1]
            whole = other.completion_ids if other.whole_completion_ids is None else other.whole_completion_ids
            paired.append(dataclasses.replace(example, kl_completion_ids=whole[:room]))
    return paired


def tokenize_prompt_dataset(
    rows: Iterable[dict],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None = None,
    truncation: bool = False,
    chat_template_kwargs: dict | None = None,
    special_tokens: bool = False,
) -> list[PromptExample]:
    """Every row of a prompt-only dataset; a prompt over ``max_prompt_length`` is an error unless
    ``truncation``, which keeps its last tokens. The other columns are kept as the row has them (the
    reward functions get them all, ``tools`` and ``chat_template_kwargs`` included).
    ``chat_template_kwargs``: as ``tokenize_preference_dataset``'s. ``special_tokens``: a text prompt
    starts with the special tokens the tokenizer puts before a text (``special_prefix``), as TRL's GRPO,
    RLOO and distillation trainers tokenize prompts (``processing_class(text=...)``; its online DPO
    trainer adds none)."""
    lengths = LengthLimits(max_prompt_length=max_prompt_length, truncation=truncation)
    prefix = special_prefix(tokenizer) if special_tokens else []
    examples = []
    for row, where in _nonempty(rows, ("prompt",), chat_template_kwargs):
        conversational = _is_conversational(row, where, ("prompt",))
        template = _template(row, where, conversational, chat_template_kwargs)
        prompt = row["prompt"]
        prompt_ids = (
            with_prefix(prefix, text_ids(tokenizer, prompt))
            if isinstance(prompt, str)
            else conversation_prompt_ids(tokenizer, prompt, template)
        )
        if not prompt_ids:
            raise ValueError(f"{where}: 'prompt' is empty")
        prompt_ids = lengths.fit(prompt_ids, {}, where).prompt_ids
        columns = {name: value for name, value in row.items() if name != "prompt"}
        examples.append(PromptExample(prompt_ids, row["prompt"], columns))
    return examples


def _sequence(prompt_ids: list[int], completion_ids: list[int]) -> TokenizedExample:
    return TokenizedExample(prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids))


def _pair_row(prompt_ids: list[int], completion_ids: list[int], unscored: int) -> TokenizedExample:
    return _sequence(prompt_ids + completion_ids[:unscored], completion_ids[unscored:])


def _add_reference(batch: dict, examples: Sequence, keys: dict[str, str]) -> None:
    """Reference log-probs under ``batch[key]`` from each example's ``attribute``, when all have one
    (a micro-batch where only some have one is a bug upstream, not a reason to drop them silently)."""
    for key, attribute in keys.items():
        values = [getattr(example, attribute) for example in examples]
        if all(value is None for value in values):
            continue
        if any(value is None for value in values):
            raise ValueError(f"{attribute} is set on some examples of the micro-batch but not all")
        batch[key] = torch.tensor(values, dtype=torch.float32)


class PreferenceCollator:
    """P pairs → 2P right-padded rows: prompt + chosen in rows 0..P-1, prompt + rejected in P..2P-1,
    labels only on completion tokens; plus ``ref_chosen_logps``/``ref_rejected_logps`` [P] if known."""

    def __init__(self, pad_token_id: int):
        self.padding = PaddingCollator(pad_token_id)

    def __call__(self, examples: Sequence[PreferenceExample]) -> dict[str, torch.Tensor]:
        batch = self.padding(
            [
                _pair_row(e.prompt_ids[e.chosen_prompt_start :], e.chosen_ids, e.chosen_unscored)
                for e in examples
            ]
            + [
                _pair_row(e.prompt_ids[e.rejected_prompt_start :], e.rejected_ids, e.rejected_unscored)
                for e in examples
            ]
        )
        _add_reference(
            batch,
            examples,
            {"ref_chosen_logps": "ref_chosen_logp", "ref_rejected_logps": "ref_rejected_logp"},
        )
        return batch


class KTOCollator:
    """N examples → right-padded prompt + completion rows and ``kto_labels``, and the KL batch (``kl_``
    keys) of mismatched pairs that estimates KTO's reference point: row i is prompt i + its
    ``kl_completion_ids`` (else completion i - 1 (mod N), TRL's rotation); plus
    ``ref_logps``/``ref_kl_logps`` [N] if known."""

    def __init__(self, pad_token_id: int):
        self.padding = PaddingCollator(pad_token_id)

    def __call__(self, examples: Sequence[KTOExample]) -> dict[str, torch.Tensor]:
        batch = self.padding([_sequence(example.prompt_ids, example.completion_ids) for example in examples])
        mismatched = self.padding(
            [
                _sequence(
                    example.prompt_ids,
                    example.kl_completion_ids
                    if example.kl_completion_ids is not None
                    else examples[row - 1].completion_ids,
                )
                for row, example in enumerate(examples)
            ]
        )
        batch.update({f"kl_{key}": value for key, value in mismatched.items()})
        batch["kto_labels"] = torch.tensor([example.label for example in examples], dtype=torch.bool)
        _add_reference(batch, examples, {"ref_logps": "ref_logp", "ref_kl_logps": "ref_kl_logp"})
        return batch


class PromptCollator:
    """Prompts left-padded for generation (every row's next token lands in the same column), with the
    examples themselves so the rollout can hand prompts and columns to the reward functions."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[PromptExample]) -> dict:
        width = max(len(example.prompt_ids) for example in examples)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, example in enumerate(examples):
            start = width - len(example.prompt_ids)
            input_ids[row, start:] = torch.tensor(example.prompt_ids)
            attention_mask[row, start:] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "examples": list(examples)}
