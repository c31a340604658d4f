"""``fastalign train distill``: knowledge distillation, TRL's ``DistillationTrainer`` with GKD's
(``trl.experimental.gkd``) ``lmbda`` and ``seq_kd``.

Rows are prompt-completion (standard or conversational; SFT's data path), or messages, whose last
(assistant) message is the completion and the others the prompt (as GKD's chat collator splits them).
Each micro-batch's completions are, with probability ``lmbda``, sampled by the student from its prompts
(on-policy: GRPO's rollout, ``generate_completions``, at ``temperature`` with the sampling options, up to
``max_completion_length`` tokens); otherwise sampled by the teacher when ``seq_kd``, else the data's own.
The draw is seeded by the micro-batch's position in the data (``GenerationBatches``), so a resumed run
makes the same choices and samples the same completions. ``lmbda`` 1 (the default) is TRL's
``DistillationTrainer``: always on-policy, each prompt tokenized alone as that trainer's (a
prompt-completion row's completion is not read, and its prompt does not take the ids it shares with the
row tokenized whole, as SFT's split gives).

Prompt-only rows (a ``prompt`` without a ``completion``, or messages that end with the user's, as
``DistillationTrainer`` reads its ``prompt`` column) are for runs that sample every completion they
train on (``lmbda`` 1, or ``seq_kd``); where some micro-batch would train on the data's completion, such a
row is an error naming it, before any step.

Evaluation is TRL's: with ``lmbda`` 1 (``DistillationTrainer``, on-policy in evaluation too) the student,
in eval mode, samples one completion of each held-out prompt (their completions are not read), and the
evaluation loss is each micro-batch's token mean weighted by its rows (transformers' evaluation loop);
with ``lmbda`` below 1 (GKD, whose evaluation runs the loss on the dataset) the held-out rows' own
completions are scored, a token mean over them all (the engine's evaluation of data rows).

The loss is the generalized Jensen-Shannon divergence between the student's and the teacher's next-token
distributions at ``temperature`` (``beta`` 0: forward KL(teacher ‖ student), 1: reverse KL), summed over
the completion tokens (up to and including the EOS) and divided by the step's count of them on all ranks:
a loss term is a completion token. It goes through the fused ``linear_divergence``: the student's final
hidden states and LM head inside its forward (``head_fn``), the teacher's from its own forward without
gradient (under FSDP2 its gathered head is copied there, before the forward reshards it); neither model's
[tokens, vocab] logits are built. The student's entropy at ``temperature`` (TRL's ``entropy`` metric, a
mean over the step's completion tokens) comes from the same pass. The teacher
(``teacher_model_name_or_path``) is loaded like a reference model (``RunParts.load_frozen_model``:
quantized with the policy's ``quantization``, patched, sharded under FSDP2, frozen); its vocabulary must
be the student's.

Offline (``teacher_logprobs_path``: a directory ``fastalign teacher-logprobs`` wrote), the teacher is never
loaded: the loss is TRL's ``ServerDistillationTrainer``'s on the teacher's stored top-k log-probs
(``loss_top_k``, ``loss_add_tail``; ``beta`` 0 forward KL on the top-k support, ``beta`` > 0 TRL's top-1
support of the teacher's top token and the completion's own), through the fused
``linear_sparse_divergence`` (the student's log-sum-exp over the whole vocabulary and its logits at the
support from one pass of its head). A stored top-k log-prob of −inf (a teacher with fewer than k finite
logits, or an fp16 store's overflow) is off the support, as TRL masks it; with ``beta`` > 0 a completion
token the teacher gives no mass (−inf) is an error naming the row, as in TRL (its reverse KL is infinite).
Where the files hold tail draws (``teacher-logprobs --tail_samples``;
fastalign's, not TRL's), the β 0 support is the top-k and the draws, each draw standing for its share of
the tail's mass (``tail_sample_support``): an unbiased estimate of full-logit distillation's gradient,
where the tail bucket alone only moves the tail's total mass. ``loss_tail_samples`` false ignores them;
β > 0, a ``loss_top_k`` other than the stored k or ``loss_add_tail`` false with them is an error.
Only the data's completions have stored scores: ``lmbda`` is 0, ``seq_kd`` off, and the keys only sampling
reads (``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``, ``generation_engine``,
``max_completion_length``) are refused when set. Rows are matched to the stored ones by the hash of their
tokens; a row without scores, or a tokenizer, teacher or temperature other than the manifest's, or a k over
its, is a one-line error naming both. An ``eval_dataset_name``'s rows are looked for in the directory's
``eval`` sub-directory (``fastalign teacher-logprobs --eval_dataset_name`` writes it), scored by the same
teacher; held-out training rows (``eval_split_ratio``) in the directory itself.
The loss is summed over the completion tokens and divided by the step's count of them on all ranks
(TRL's server path divides by its micro-batch's count: the same with one micro-batch on one process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastalign.data import tokenize_prompt_dataset, tokenize_sft_dataset
from fastalign.data.formats import check_messages
from fastalign.data.sources import Rows, row_origins
from fastalign.data.teacher_logprobs import (
    EVAL_DIR,
    MANIFEST,
    Manifest,
    TeacherLogprobs,
    read_manifest,
    row_hash,
    tokenizer_hash,
)
from fastalign.models.structure import IGNORE_INDEX, disable_dropout
from fastalign.ops import linear_divergence
from fastalign.ops.sparse_divergence import linear_sparse_divergence, tail_sample_support
from fastalign.train.config import ConfigError, TrainConfig, options_from, set_keys
from fastalign.train.distributed import DistributedContext
from fastalign.train.objectives.base import BatchPlan, Objective, Prepared, RunParts
from fastalign.train.objectives.online import (
    ROLLOUT_KEY,
    GenerationBatches,
    check_generation_keys,
    sample_completions,
)
from fastalign.train.rollout import (
    Completions,
    SamplingKeys,
    SamplingOptions,
    all_gather_rows,
    completion_length_metrics,
    scoring_batch,
)

#: The sampling keys (``SamplingKeys``') that only sampling reads: offline (``teacher_logprobs_path``), where
#: nothing is sampled, they are refused when set, with ``max_completion_length`` (``temperature`` is the
#: divergence's too, checked against the stored scores').
SAMPLING_ONLY_KEYS = tuple(key for key in SamplingKeys.__dataclass_fields__ if key != "temperature")

#: TRL's DistillationConfig defaults where the config leaves a key None.
DISTILL_DEFAULTS = {"beta": 1.0, "disable_dropout": False, "lmbda": 1.0}


@dataclass(frozen=True)
class DistillOptions(SamplingKeys):
    """The keys distillation reads (TRL's DistillationConfig names, GKDConfig's ``lmbda`` and ``seq_kd``)."""

    teacher_model_name_or_path: str | None
    shuffle_dataset: bool  # false: the prompts in the data's order (read by the batch plan)
    lmbda: float
    seq_kd: bool
    beta: float
    max_completion_length: int
    use_vllm: bool
    max_length: int
    truncation: bool
    truncation_mode: str
    chat_template_kwargs: dict[str, Any] | None
    disable_dropout: bool
    teacher_logprobs_path: str | None
    loss_top_k: int | None
    loss_add_tail: bool
    loss_tail_samples: bool | None

    @classmethod
    def from_config(cls, config: TrainConfig) -> DistillOptions:
        offline = config.teacher_logprobs_path is not None
        defaults = DISTILL_DEFAULTS | ({"lmbda": 0.0} if offline else {})
        options = options_from(config, cls, **defaults)
        if options.teacher_model_name_or_path is None and not offline:
            raise ConfigError(
                "config key 'teacher_model_name_or_path' must name the teacher for distill (or "
                "teacher_logprobs_path its stored log-probs)"
            )
        if not 0 <= options.beta <= 1:
            raise ConfigError(f"config key 'beta' for distill must be in [0, 1], got {options.beta!r}")
        if offline:
            options._check_offline()
        else:
            offline_keys = {
                "loss_top_k": options.loss_top_k is not None,
                "loss_add_tail": not options.loss_add_tail,
                "loss_tail_samples": options.loss_tail_samples is not None,
            }
            key = next((key for key, set_ in offline_keys.items() if set_), None)
            if key is not None:
                raise ConfigError(f"config key {key!r} applies to distill with teacher_logprobs_path only")
            if options.lmbda == 0 and not options.seq_kd:
                options._refuse_sampling_keys("with lmbda 0 and seq_kd false nothing is sampled")
        if options.seq_kd and options.lmbda == 1:
            raise ConfigError(
                "config key 'seq_kd' has no effect with lmbda 1 (the student samples every micro-batch's "
                "completions): lower lmbda or remove seq_kd"
            )
        check_generation_keys(options.use_vllm, options.generation_kwargs, [], None)
        return options

    def _refuse_sampling_keys(self, why: str, top_k_hint: str = "") -> None:
        """The keys only sampling reads, refused in one line where nothing is sampled (lmbda 0, seq_kd
        false): they would be ignored."""
        sampling = set_keys(self, (*SAMPLING_ONLY_KEYS, "max_completion_length"))
        if sampling:
            named = ", ".join(f"{key!r} ({getattr(self, key)!r})" for key in sampling)
            hint = top_k_hint if "top_k" in sampling else ""
            keys, them = ("keys", "them") if len(sampling) > 1 else ("key", "it")
            raise ConfigError(
                f"config {keys} {named}: {why}, so the sampling keys are not read{hint}: remove {them}"
            )

    def _check_offline(self) -> None:
        """What stored scores cannot serve, refused in one line: sampled completions (``lmbda``,
        ``seq_kd``: they have no stored scores), the keys only sampling reads (nothing is sampled, so they
        would be ignored) and a ``loss_top_k`` over TRL's top-1 with ``beta`` > 0."""
        if self.lmbda != 0 or self.seq_kd:
            key = "lmbda" if self.lmbda != 0 else "seq_kd"
            raise ConfigError(
                f"config key {key!r}: with teacher_logprobs_path only the data's completions have the "
                "teacher's log-probs (lmbda 0, seq_kd false); sampled ones would need the teacher"
            )
        hint = (
            " (the teacher's top-k support is chosen when scoring, fastalign teacher-logprobs --top_k; "
            "loss_top_k trains on fewer of the stored ids)"
        )
        self._refuse_sampling_keys("with teacher_logprobs_path nothing is sampled (lmbda 0)", hint)
        if self.beta > 0 and self.loss_top_k not in (None, 1):
            raise ConfigError(  # TRL's ServerDistillationConfig
                f"config key 'loss_top_k' must be 1 with beta>0 (got loss_top_k={self.loss_top_k}): mixed "
                "forward/reverse distillation on stored log-probs is only implemented for top-1 support"
            )

    @property
    def offline(self) -> bool:
        return self.teacher_logprobs_path is not None

    @property
    def sampling(self) -> SamplingOptions:
        """One completion of each prompt (the student's or the teacher's)."""
        return SamplingOptions.of(self, 1, self.max_completion_length)


@dataclass(frozen=True)
class DistillExample:
    """A row's prompt tokens and its completion's (none for a prompt-only row, which only a sampled
    micro-batch can train on), and what errors call the row."""

    prompt_ids: list[int]
    completion_ids: list[int]
    where: str

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


class CompletionCollator:
    """Examples as prompt + completion rows: prompts left-padded (ready to sample from), completions
    right-padded, with ``completion_mask`` and the positions ``generate`` would give them. Examples that
    are all prompt-only make a batch of prompts (``input_ids`` and ``attention_mask``, no
    ``completion_mask``), as GRPO's prompt micro-batches: the completions are to be sampled."""

    def __init__(
        self,
        pad_token_id: int,
        teacher_logprobs: TeacherLogprobs | None = None,
        k: int = 1,
        tail_samples: int = 0,
        beta: float = 0.0,
    ):
        self.pad_token_id = pad_token_id
        self.teacher_logprobs = teacher_logprobs
        self.k = k
        self.tail_samples = tail_samples  # the stored tail draws the loss reads (0: none)
        self.beta = beta  # > 0: TRL's top-1 support, whose teacher log-probs must be finite

    def __call__(self, examples: Sequence[DistillExample]) -> dict:
        prompt_ids, prompt_mask = _pad([e.prompt_ids for e in examples], self.pad_token_id, left=True)
        if not any(example.completion_ids for example in examples):
            return {"input_ids": prompt_ids, "attention_mask": prompt_mask}
        completions = [example.completion_ids for example in examples]
        completion_ids, completion_mask = _pad(completions, self.pad_token_id, left=False)
        done = Completions(
            prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(len(examples))
        )
        batch, _, _ = scoring_batch(done, completion_mask)
        if self.teacher_logprobs is not None:
            batch |= self._teacher(examples, completion_ids.shape[1])
        return batch

    def _teacher(self, examples: Sequence[DistillExample], width: int) -> dict:
        """The stored top-k ids and log-probs [B, T, k] and completion-token log-probs [B, T] of the
        examples (matched by their hash; zeros at padding), and with ``tail_samples`` their tail draws
        [B, T, M] and the log of the mass outside the top-k [B, T]. With ``beta`` > 0 a completion token
        whose stored log-prob is −inf (the teacher gives it no mass: a masked vocabulary), or, below 1, a
        top-1 of −inf, is a ValueError naming the row, as TRL's server path refuses it: the reverse KL
        is infinite there (β 0 masks −inf top-k entries off the support, as TRL does)."""
        size = (len(examples), width)
        batch = {
            "teacher_ids": torch.zeros((*size, self.k), dtype=torch.long),
            "teacher_logprobs": torch.zeros((*size, self.k), dtype=torch.float32),
            "teacher_token_logprobs": torch.zeros(size, dtype=torch.float32),
        }
        if self.tail_samples:
            batch["teacher_sample_ids"] = torch.zeros((*size, self.tail_samples), dtype=torch.long)
            batch["teacher_tail"] = torch.zeros(size, dtype=torch.float32)
        for index, example in enumerate(examples):
            stored = self.teacher_logprobs.get(row_hash(example.prompt_ids, example.completion_ids))
            length = stored["ids"].shape[0]
            batch["teacher_ids"][index, :length] = stored["ids"][:, : self.k].long()
            batch["teacher_logprobs"][index, :length] = stored["logprobs"][:, : self.k].float()
            batch["teacher_token_logprobs"][index, :length] = stored["token_logprobs"]
            if self.beta > 0:
                _check_top1_support(example, stored, self.beta)
            if self.tail_samples:
                batch["teacher_sample_ids"][index, :length] = stored["sample_ids"].long()
                batch["teacher_tail"][index, :length] = stored["tail"]
        return batch


def _check_top1_support(example: DistillExample, stored: dict, beta: float) -> None:
    """TRL's refusal (``_compute_server_sparse_top_1_divergence_loss``) of a −inf teacher log-prob on
    the β > 0 support: the completion's token, and the top-1 below β 1."""
    missing = torch.isneginf(stored["token_logprobs"])
    if beta < 1:
        missing |= torch.isneginf(stored["logprobs"][:, 0])
    if bool(missing.any()):
        position = int(missing.nonzero()[0, 0])
        raise ValueError(
            f"{example.where}: the stored teacher log-prob of completion token {position} (id "
            f"{example.completion_ids[position]}) is -inf: with beta {beta} the reverse KL there is "
            "infinite (TRL's server path refuses it too): train with beta 0, or leave the row out"
        )


def _pad(rows: Sequence[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[index, span], mask[index, span] = torch.tensor(row, dtype=torch.long), 1
    return ids, mask


def _as_prompt_completion(row: dict, where: str) -> dict:
    """A messages row as GKD's chat collator reads it: the last message (the assistant's) is the
    completion, the ones before it the prompt; messages that end with the user's are a conversational
    prompt alone (TRL's prompt-only format, which ``DistillationTrainer`` samples from). Rows with a
    prompt as they are; others (text rows) are an error naming the row."""
    messages = row.get("messages")
    if row.get("prompt") is not None:
        return row
    if messages is None:
        columns = sorted(key for key, value in row.items() if value is not None)
        raise ValueError(
            f"{where}: distill reads 'prompt' (with or without 'completion') or 'messages'; the row has "
            f"{columns}"
        )
    check_messages(messages, where, "messages")
    rest = {key: value for key, value in row.items() if key != "messages"}
    role = messages[-1]["role"]
    if role == "user":
        return {**rest, "prompt": messages}
    if role != "assistant":
        raise ValueError(
            f"{where}: 'messages' ends with a {role!r} message; distill reads the last message as the "
            "completion (the assistant's) or, the user's, as a prompt to sample a completion of"
        )
    return {**rest, "prompt": messages[:-1], "completion": messages[-1:]}


def _is_prompt_only(row: dict) -> bool:
    return row.get("prompt") is not None and row.get("completion") is None


def _check_completions(examples: list[DistillExample], sampled: bool, why: str) -> None:
    """A ValueError naming the first prompt-only row of ``examples`` unless their completions are all
    ``sampled``."""
    missing = None if sampled else next((e for e in examples if not e.completion_ids), None)
    if missing is not None:
        raise ValueError(f"{missing.where}: no 'completion' (a prompt-only row); {why}")


class DistillObjective(Objective):
    """The generalized JSD to a teacher on the data's, the student's or the teacher's completions."""

    default_sampling_strategy = None  # TRL's sampler reads shuffle_dataset

    default_dataset = "tiny-sft"

    def __init__(
        self,
        options: DistillOptions,
        ctx: DistributedContext | None = None,
        eval_dataset_name: str | None = None,
    ):
        super().__init__(ctx)
        self.options = options
        # where the evaluation rows come from (offline: their scores are in teacher_logprobs_path/eval)
        self.eval_dataset_name = eval_dataset_name
        self.teacher: torch.nn.Module | None = None
        self.teacher_logprobs: TeacherLogprobs | None = None
        self.tail_samples = 0  # offline: the stored tail draws per token the loss reads (0: none)
        self.tokenizer = None

    @classmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> DistillObjective:
        return cls(DistillOptions.from_config(config), ctx, config.eval_dataset_name)

    @classmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        return frozenset(DistillOptions.__dataclass_fields__)

    # --- data --------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict], tokenizer) -> list[DistillExample]:
        """Prompt-completion rows through SFT's tokenizer, prompt-only rows through the prompt-only
        one; each keeps its place and its name (file and line, or index) for later errors."""
        origins = row_origins(rows)
        rows = [_as_prompt_completion(row, where) for row, where in zip(rows, origins, strict=True)]
        groups: dict[bool, list[int]] = {False: [], True: []}
        for index, row in enumerate(rows):
            # with lmbda 1 every completion is sampled (TRL's DistillationTrainer), from the prompt
            # tokenized alone, as a prompt-only row's
            groups[_is_prompt_only(row) or self.options.lmbda == 1].append(index)
        tokenized = {}
        for prompt_only, indices in groups.items():
            if indices:
                part = Rows([rows[i] for i in indices], [origins[i] for i in indices])
                examples = (
                    self._tokenize_prompts(part, tokenizer)
                    if prompt_only
                    else self._tokenize(part, tokenizer)
                )
                tokenized |= dict(zip(indices, examples, strict=True))
        return [tokenized[index] for index in range(len(rows))]

    def _tokenize(self, rows: Rows, tokenizer) -> list[DistillExample]:
        """Prompt-completion rows: SFT's tokens, the completion from its first loss token on."""
        tokenized = tokenize_sft_dataset(
            rows,
            tokenizer,
            max_length=self.options.max_length,
            truncation=self.options.truncation,
            truncation_mode=self.options.truncation_mode,
            completion_only_loss=True,
            chat_template_kwargs=self.options.chat_template_kwargs,
        )
        examples = []
        for example, where in zip(tokenized, rows.origins, strict=True):
            start = example.loss_mask.index(1)  # there is one: tokenize_sft_dataset checked
            if start == 0:
                raise ValueError(
                    f"{where}: no prompt tokens left after truncation to max_length={self.options.max_length}"
                )
            examples.append(DistillExample(example.input_ids[:start], example.input_ids[start:], where))
        return examples

    def _tokenize_prompts(self, rows: Rows, tokenizer) -> list[DistillExample]:
        """Prompt-only rows; one over ``max_length`` is an error unless ``truncation``, which keeps its
        last tokens whatever ``truncation_mode`` says (its end is where sampling starts; GKD's collator
        cuts prompts the same way)."""
        prompts = tokenize_prompt_dataset(
            rows, tokenizer, chat_template_kwargs=self.options.chat_template_kwargs, special_tokens=True
        )
        limit, examples = self.options.max_length, []
        for prompt, where in zip(prompts, rows.origins, strict=True):
            if len(prompt.prompt_ids) > limit and not self.options.truncation:
                raise ValueError(
                    f"{where}: the prompt has {len(prompt.prompt_ids)} tokens, over max_length={limit} "
                    "(truncation is off)"
                )
            examples.append(DistillExample(prompt.prompt_ids[-limit:], [], where))
        return examples

    def collate(self, tokenizer) -> CompletionCollator:
        return CompletionCollator(
            tokenizer.pad_token_id,
            self.teacher_logprobs,
            self.loss_top_k,
            self.tail_samples,
            self.options.beta,
        )

    @property
    def loss_top_k(self) -> int:
        """The top-k support of the offline loss: the key's, else the stored k (TRL's 1 with beta > 0)."""
        if self.options.loss_top_k is not None:
            return self.options.loss_top_k
        if self.options.beta > 0:
            return 1
        return self.teacher_logprobs.manifest.k if self.teacher_logprobs is not None else 1

    def batches(self, examples: list, tokenizer, plan: BatchPlan) -> GenerationBatches:
        """The data's micro-batches, each with the seed of its draw (and of its sampling)."""
        return GenerationBatches(
            super().batches(examples, tokenizer, plan), plan.accumulation, num_iterations=1
        )

    @property
    def samples_evaluation(self) -> bool:
        """Whether evaluation samples the student's completions of the held-out prompts (lmbda 1: TRL's
        ``DistillationTrainer``, on-policy in evaluation too) rather than scoring the data's (GKD, whose
        evaluation runs the loss on the dataset's completions)."""
        return self.options.lmbda == 1

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        options = self.options
        every_batch_sampled = options.lmbda == 1 or options.seq_kd
        _check_completions(
            train,
            every_batch_sampled,
            f"with lmbda {options.lmbda} and seq_kd false, a share of the micro-batches trains on the "
            "data's completions: set lmbda 1 or seq_kd true to sample every one",
        )
        _check_completions(
            evaluation,
            self.samples_evaluation,
            f"with lmbda {options.lmbda}, evaluation scores the held-out rows' own completions (GKD's): "
            "set lmbda 1 to evaluate on the student's samples of their prompts",
        )
        if self.samples_evaluation:  # only the prompts are read: micro-batches of prompts
            evaluation = [dataclasses.replace(example, completion_ids=[]) for example in evaluation]
        if options.disable_dropout:
            disable_dropout(model)
        if options.offline:  # the teacher is never loaded
            self.tokenizer = parts.tokenizer
            self.teacher_logprobs = open_teacher_logprobs(options, parts.tokenizer, self.loss_top_k)
            stored = self.teacher_logprobs.manifest.teacher_vocab
            if stored is not None:  # (a manifest written before it was recorded: not known)
                _check_same_vocabulary("teacher_logprobs_path", stored, model)
            self.tail_samples = tail_samples_in_use(options, self.teacher_logprobs.manifest)
            separate = self.eval_dataset_name is not None and bool(evaluation)
            if separate:  # eval_dataset_name's rows: scored into the eval sub-directory
                self.teacher_logprobs.include(
                    open_eval_teacher_logprobs(
                        options,
                        parts.tokenizer,
                        self.loss_top_k,
                        self.eval_dataset_name,
                        self.teacher_logprobs,
                    )
                )
            self._check_scored(train, None)
            self._check_scored(evaluation, self.eval_dataset_name if separate else None)
            return Prepared(train, evaluation)
        self.teacher = parts.load_frozen_model(options.teacher_model_name_or_path)
        self.tokenizer = parts.tokenizer
        teacher = self.teacher.get_output_embeddings().weight.shape[0]
        _check_same_vocabulary("teacher_model_name_or_path", teacher, model)
        return Prepared(train, evaluation)

    def _check_scored(self, examples: list[DistillExample], eval_dataset_name: str | None) -> None:
        """A ValueError naming the first of ``examples`` without stored scores, and what to run (the
        rows of ``eval_dataset_name``, when given, are looked for in the eval sub-directory)."""
        path = self.options.teacher_logprobs_path
        for example in examples:
            if row_hash(example.prompt_ids, example.completion_ids) in self.teacher_logprobs:
                continue
            if eval_dataset_name is None:
                raise ValueError(
                    f"{example.where}: no teacher log-probs in {path} for this row (score the same data with "
                    "the same max_length, truncation and chat template: fastalign teacher-logprobs with this "
                    f"run's keys and --output_dir {path})"
                )
            raise ValueError(
                f"{example.where}: no teacher log-probs in {Path(path) / EVAL_DIR} for this row of "
                f"eval_dataset_name {eval_dataset_name!r} (it holds other evaluation rows' scores: remove "
                "it, then score them with the same max_length, truncation and chat template: fastalign "
                f"teacher-logprobs with this run's keys, eval_dataset_name included, and --output_dir {path})"
            )

    # --- a step ------------------------------------------------------------------------------------
    def loss_tokens(self, batch: dict) -> int:
        """A micro-batch's completion tokens; an evaluation micro-batch of prompts counts its rows, so
        the evaluation loss is the mean of each micro-batch's token mean weighted by its rows, as
        transformers' evaluation loop weighs the per-batch losses of TRL's ``DistillationTrainer``."""
        if "completion_mask" not in batch:
            return batch["input_ids"].shape[0]
        return int(batch["completion_mask"].sum())

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        """Each micro-batch's completions: the student's with probability ``lmbda``, else the teacher's
        (``seq_kd``) or the data's."""
        batches, lengths, truncated = [], [], []
        for batch in micro_batches:
            seed = batch[ROLLOUT_KEY][3]
            draw = float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
            sampler = model if draw < self.options.lmbda else self.teacher if self.options.seq_kd else None
            if sampler is None:
                batches.append({key: value for key, value in batch.items() if key != ROLLOUT_KEY})
            else:
                sampled, done = self._sampled(sampler, batch)
                batches.append({key: value.cpu() for key, value in sampled.items()})
                lengths.append(done.lengths.cpu())
                truncated.append(done.truncated.cpu())
        if self.options.lmbda < 1:  # GKD logs no completion lengths (some micro-batches are the data's)
            return batches, {}
        # lmbda 1: every micro-batch sampled, as TRL's DistillationTrainer's, which logs their lengths
        every = all_gather_rows(torch.stack([torch.cat(lengths), torch.cat(truncated).long()]), self.ctx)
        every = every.view(self.ctx.world_size, 2, -1).transpose(0, 1).reshape(2, -1)
        return batches, completion_length_metrics(every[0], every[1].bool())

    def _sampled(self, sampler: torch.nn.Module, batch: dict) -> tuple[dict, Completions]:
        """``batch``'s prompts with completions sampled by ``sampler`` (the student or the teacher),
        seeded by the batch's ``ROLLOUT_KEY`` (an evaluation batch has none: the current random state),
        and the completions themselves."""
        if "completion_mask" in batch:
            width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
            batch = {
                **batch,
                "input_ids": batch["input_ids"][:, :width],
                "attention_mask": batch["attention_mask"][:, :width],
            }
        (done,) = sample_completions(sampler, [batch], self.options.sampling, self.tokenizer, self.ctx)
        sampled, _, _ = scoring_batch(done, done.completion_mask)
        return sampled, done

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        """The micro-batch's summed divergence over the step's completion-token count, and the student's
        mean entropy (TRL's ``entropy``: of its distribution at ``temperature``) weighted the same way."""
        if self.options.offline:
            return self._offline_loss(model, batch, num_items_in_batch)
        assert self.teacher is not None  # set up before any step
        if "completion_mask" not in batch:  # an evaluation micro-batch of prompts: the student samples
            sampled, _ = self._sampled(model, batch)
            return self.compute_loss(model, sampled, sampled["completion_mask"].sum())
        mask = batch["completion_mask"]
        width = batch["input_ids"].shape[1] - mask.shape[1]
        labels = batch["input_ids"][:, width:].masked_fill(mask == 0, IGNORE_INDEX)
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad():  # the teacher's final hidden states of the completion positions, and its head
            teacher_hidden, teacher_weight, teacher_bias, teacher_softcap = self.teacher(
                **inputs, head_fn=self._teacher_head(width)
            ).head_output

        def head(hidden, weight, bias, softcap=None):
            return linear_divergence(
                hidden[:, width - 1 : -1],
                weight,
                teacher_hidden,
                teacher_weight,
                labels,
                beta=self.options.beta,
                temperature=self.options.temperature,
                student_bias=bias,
                teacher_bias=teacher_bias,
                reduction="sum",
                return_entropy=True,
                student_softcap=softcap,
                teacher_softcap=teacher_softcap,
            )

        return _divergence_loss(model, inputs, head, num_items_in_batch)

    def _offline_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        """TRL's server-distillation loss on the stored top-k: β 0 over the teacher's top-k ids, β > 0
        over TRL's top-1 support (the teacher's top token and the completion's, once where they agree;
        β 1 the completion's alone); with the stored tail draws (fastalign's, β 0 only) over the top-k
        and the draws (``tail_sample_support``)."""
        mask = batch["completion_mask"].bool()
        width = batch["input_ids"].shape[1] - mask.shape[1]
        tokens = batch["input_ids"][:, width:]
        ids, logprobs = batch["teacher_ids"], batch["teacher_logprobs"]
        support_mask = None
        beta = self.options.beta
        if self.tail_samples:
            ids, logprobs, support_mask = tail_sample_support(
                ids, logprobs, batch["teacher_tail"], batch["teacher_sample_ids"]
            )
        elif beta == 1:
            ids, logprobs = tokens[..., None], batch["teacher_token_logprobs"][..., None]
        elif beta > 0:
            top1 = ids[..., 0]
            ids = torch.stack([top1, tokens], dim=-1)
            logprobs = torch.stack([logprobs[..., 0], batch["teacher_token_logprobs"]], dim=-1)
            support_mask = torch.stack([torch.ones_like(mask), tokens != top1], dim=-1)
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}

        def head(hidden, weight, bias, softcap=None):
            return linear_sparse_divergence(
                hidden[:, width - 1 : -1],
                weight,
                ids,
                logprobs,
                support_mask,
                mask,
                beta=beta,
                temperature=self.options.temperature,
                add_tail=self.options.loss_add_tail,
                bias=bias,
                reduction="sum",
                return_entropy=True,
                softcap=softcap,
            )

        return _divergence_loss(model, inputs, head, num_items_in_batch)

    def _teacher_head(self, width: int):
        """The teacher's ``head_fn``: the final hidden states of the positions that predict the
        completion, the LM head and the model's final-logit softcap (Gemma-2's; None for most), for the
        student's forward to read after the teacher's returns.

        Under FSDP2 the head is the teacher's root unit's all-gathered weight (and bias), which the
        teacher's forward frees (reshards) as it returns: they are copied here, while whole (one [V, Dt]
        head alive during the student's forward, less than keeping the teacher's root unit gathered).
        On one process they are the parameters themselves, which outlive the forward."""

        def head(hidden, weight, bias, softcap=None):
            if self.ctx.enabled:
                weight, bias = weight.clone(), None if bias is None else bias.clone()
            return hidden[:, width - 1 : -1], weight, bias, softcap

        return head


def _check_same_vocabulary(key: str, teacher: int, student: torch.nn.Module) -> None:
    """The teacher's vocabulary (the rows of its LM head) is the student's, or a one-line error naming
    ``key``: distillation compares their next-token distributions."""
    rows = student.get_output_embeddings().weight.shape[0]
    if teacher != rows:
        raise ConfigError(
            f"config key {key!r}: the teacher's vocabulary ({teacher} tokens) is not the student's ({rows}): "
            "distillation compares their next-token distributions"
        )


def open_teacher_logprobs(options: DistillOptions, tokenizer, k: int) -> TeacherLogprobs:
    """The stored log-probs of ``teacher_logprobs_path``, checked against the run: a tokenizer, teacher,
    k or temperature other than the manifest's is a one-line error naming both values."""
    stored = TeacherLogprobs(options.teacher_logprobs_path)
    manifest, where = stored.manifest, f"{options.teacher_logprobs_path}'s manifest"
    ours = tokenizer_hash(tokenizer)
    if ours != manifest.tokenizer_hash:
        raise ConfigError(
            f"config key 'teacher_logprobs_path': the student's tokenizer (hash {ours[:12]}) is not the one "
            f"{where} was scored with (hash {manifest.tokenizer_hash[:12]}, teacher {manifest.teacher})"
        )
    teacher = options.teacher_model_name_or_path
    if teacher is not None and teacher != manifest.teacher:
        raise ConfigError(
            f"config key 'teacher_model_name_or_path' ({teacher!r}) is not the teacher of {where} "
            f"({manifest.teacher!r})"
        )
    if k > manifest.k:  # a smaller k reads the first of the stored ones (sorted: the top-k)
        raise ConfigError(f"config key 'loss_top_k' ({k}) is over the k of {where} ({manifest.k})")
    if options.temperature != manifest.temperature:
        raise ConfigError(
            f"config key 'temperature' ({options.temperature}) is not the one {where} was scored at "
            f"({manifest.temperature})"
        )
    return stored


def tail_samples_in_use(options: DistillOptions, manifest: Manifest) -> int:
    """How many stored tail draws per token the loss reads: the manifest's unless ``loss_tail_samples``
    is false (0: TRL's tail bucket alone). What the draws cannot serve is a one-line error: β > 0 (they
    estimate forward KL only: JSD's mixture is not linear in the teacher's probabilities), a
    ``loss_top_k`` other than the stored k (they stand for the tail beyond it), ``loss_add_tail`` false
    (the bucket holds the student's mass outside the support: without it both sides are renormalised over
    the support, no longer KL to the estimate over the whole vocabulary); and ``loss_tail_samples`` set
    true where the files hold none."""
    where = f"{options.teacher_logprobs_path}'s manifest"
    if options.loss_tail_samples is False:
        return 0
    if not manifest.tail_samples:
        if options.loss_tail_samples:
            raise ConfigError(
                f"config key 'loss_tail_samples' is true but {where} records no tail draws (score with "
                "fastalign teacher-logprobs --tail_samples M, or leave loss_tail_samples unset)"
            )
        return 0
    if options.beta > 0:
        key, why = f"'beta' ({options.beta}) must be 0", "they estimate forward KL only"
    elif options.loss_top_k not in (None, manifest.k):
        key = f"'loss_top_k' ({options.loss_top_k}) must be the stored k ({manifest.k})"
        why = "they stand for the tail beyond it"
    elif not options.loss_add_tail:
        key, why = "'loss_add_tail' must be true", "their loss needs the student's mass outside the support"
    else:
        return manifest.tail_samples
    raise ConfigError(
        f"config key {key} with the {manifest.tail_samples} tail draws per token of {where} ({why}): "
        "set loss_tail_samples false for TRL's tail bucket alone"
    )


#: The manifest keys the training and evaluation rows' must agree on: which teacher scored, and the k and
#: tail draws the loss reads (the draws stand for the tail beyond the stored k). One ``teacher-logprobs``
#: command scores both alike; a directory scored apart is refused.
SHARED_KEYS = (
    "teacher",
    "teacher_revision",
    "teacher_weights",
    "teacher_patched",
    "teacher_dtype",
    "teacher_attn_implementation",
    "teacher_autocast",
    "teacher_quantization",
    "teacher_vocab",
    "tokenizer_hash",
    "k",
    "tail_samples",
)


def open_eval_teacher_logprobs(
    options: DistillOptions, tokenizer, k: int, eval_dataset_name: str, train: TeacherLogprobs
) -> TeacherLogprobs:
    """The stored log-probs of ``eval_dataset_name``'s rows (``teacher_logprobs_path``'s ``EVAL_DIR``),
    checked as the training rows' are, and scored as those (``train``) were: ``SHARED_KEYS``."""
    path = Path(options.teacher_logprobs_path)
    directory = path / EVAL_DIR
    manifest = read_manifest(directory)
    if manifest is None or not manifest.complete:
        what = f"{directory / MANIFEST} is missing" if manifest is None else f"{directory} is incomplete"
        raise ConfigError(
            f"config key 'eval_dataset_name' ({eval_dataset_name!r}): {path} has no teacher log-probs of the "
            f"evaluation rows ({what}): run fastalign teacher-logprobs with this run's keys, "
            f"eval_dataset_name included, and --output_dir {path} (it scores them into {directory}, "
            "keeping the training rows' shards)"
        )
    stored = open_teacher_logprobs(
        dataclasses.replace(options, teacher_logprobs_path=str(directory)), tokenizer, k
    )
    ours, theirs = dataclasses.asdict(stored.manifest), dataclasses.asdict(train.manifest)
    key = next((key for key in SHARED_KEYS if ours[key] != theirs[key]), None)
    if key is not None:
        raise ConfigError(
            f"config key 'teacher_logprobs_path': {directory} was not scored as {path} was "
            f"({key} {ours[key]!r} there, {theirs[key]!r} in {path}): remove {directory} and score "
            f"eval_dataset_name {eval_dataset_name!r} again (fastalign teacher-logprobs --output_dir {path})"
        )
    return stored


def _divergence_loss(model, inputs: dict, head, num_items_in_batch: torch.Tensor):
    """The student's forward with the divergence ``head`` inside it: the loss summed over the completion
    tokens over the step's count of them, and the student's mean entropy (TRL's metric)."""
    loss, entropy = model(**inputs, head_fn=head).head_output
    count = num_items_in_batch.to(loss.device)
    return loss / count, {"entropy": entropy.sum() / count}
