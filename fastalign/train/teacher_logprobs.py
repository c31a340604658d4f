"""``fastalign teacher-logprobs``: score a data set's completions with a teacher once, for offline
distillation (``fastalign train distill --teacher_logprobs_path``).

The rows are read and tokenized as ``train distill`` reads them (prompt-completion, conversational or messages
rows; the same ``max_length``, ``truncation`` and chat template keys); prompt-only rows have nothing to score
and are left out. ``dataset_name``'s rows (a Hub dataset's ``dataset_train_split``) go to ``output_dir``,
``eval_dataset_name``'s (its ``dataset_test_split``), when set, to ``output_dir/eval`` with their own
manifest, where ``train distill`` looks for its evaluation rows (``eval_split_ratio`` holds out training rows,
which are scored already). The teacher (``model_name_or_path``) is loaded as ``train distill`` loads its
teacher (``dtype``, ``attn_implementation`` or ``model_init_kwargs``; 4-bit with ``quantization``, its
unquantized rest in bf16 under ``bf16`` as there) and runs in eval mode, patched, under the engine's autocast
(``bf16`` or ``fp16``), its head fused: per completion token, ``linear_topk_logprobs`` walks the vocabulary in
slices and keeps a running top-``top_k`` and log-sum-exp (no [tokens, vocab] logits), at ``temperature``; with
``tail_samples`` M > 0 (fastalign's), a second walk over the slices draws M ids per token from the
distribution outside the top-k, at uniforms seeded by (``tail_samples_seed``, default the run's ``seed``; the
row's content hash), so the draws do not depend on batches, shards, ranks or resumes. Rows go to shards of
``shard_rows`` (``fastalign.data.teacher_logprobs``), each written atomically once its rows are scored; under
``torchrun`` rank r scores shards r, r + world, ... (a whole teacher on each process, no collective during
scoring). A rerun on the same directory skips the shards that exist: a killed run resumes from its last
complete shard, and adding ``eval_dataset_name`` later scores only its rows. A rerun whose teacher (its
weights' fingerprint: a local directory's weight files' names, sizes and mtimes, a Hub model's resolved
commit; whether it is patched: ``use_liger_kernel``; its weights' dtype, attention kernel, autocast and
quantization), data or keys differ from the directory's manifest is refused. Only ``SCORING_KEYS`` are read: a
training key set is refused, never ignored. Memory holds one batch's activations and one shard's scores.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import fastalign
from fastalign.data.teacher_logprobs import (
    DTYPES,
    EVAL_DIR,
    MANIFEST,
    Manifest,
    ScoredRow,
    dataset_hash,
    read_manifest,
    row_hash,
    shard_name,
    tail_uniforms,
    tokenizer_hash,
    weights_fingerprint,
    write_manifest,
    write_shard,
)
from fastalign.data.tokenizer_options import override_tokenizer
from fastalign.ops.sparse_divergence import linear_topk_logprobs
from fastalign.quant.bitsandbytes_import import bitsandbytes_hidden
from fastalign.train.config import ConfigError, TrainConfig, refuse_unread
from fastalign.train.distributed import DistributedContext, init_distributed, shutdown_distributed
from fastalign.train.engine import autocast
from fastalign.train.loading import (
    is_hub_dataset,
    load_dataset_rows,
    load_model_and_tokenizer,
    materialize_model,
    resolve_model,
)
from fastalign.train.objectives import with_objective_defaults
from fastalign.train.objectives.distill import CompletionCollator, DistillExample, DistillObjective
from fastalign.train.policy import model_dtype, patch_fused_head, quant_options, set_model_options

#: The ``TrainConfig`` keys scoring reads; any other one set away from its default (a training key: an
#: optimizer's, a loss's, LoRA's, sampling's) is refused rather than ignored (``refuse_unread``).
SCORING_KEYS = frozenset(
    {
        # the teacher, loaded and run as train distill loads and runs its teacher (``load_frozen_model``
        # under the engine's autocast)
        "model_name_or_path",
        "model_revision",
        "dtype",
        "attn_implementation",
        "model_init_kwargs",
        "quantization",
        "bnb_4bit_use_double_quant",
        "bf16",
        "fp16",
        "use_liger_kernel",
        "seed",  # the fill of weights a checkpoint lacks; the tail draws' default seed
        # the rows, read and tokenized as train distill reads them
        "dataset_name",
        "dataset_config",
        "dataset_train_split",
        "dataset_test_split",
        "dataset_revision",
        "eval_dataset_name",
        "max_length",
        "truncation",
        "truncation_mode",
        "chat_template_kwargs",
        "eos_token",
        "pad_token",
        "chat_template_path",
        # the scores
        "top_k",
        "temperature",
        "per_device_eval_batch_size",
        "output_dir",
    }
)


@dataclass(frozen=True)
class ScoringOptions:
    """What the command reads besides the ``TrainConfig`` keys (the teacher, data and length keys)."""

    shard_rows: int = 256
    logprobs_dtype: str = "float32"
    tail_samples: int = 0  # draws per token from the tail outside the top-k
    tail_samples_seed: int | None = None  # None: the run's seed

    def __post_init__(self):
        if self.shard_rows < 1:
            raise ConfigError(f"--shard_rows must be positive, got {self.shard_rows}")
        if self.logprobs_dtype not in DTYPES:
            raise ConfigError(
                f"--logprobs_dtype must be one of {', '.join(DTYPES)}, got {self.logprobs_dtype!r}"
            )
        if self.tail_samples < 0:
            raise ConfigError(f"--tail_samples must be 0 or more, got {self.tail_samples}")
        if self.tail_samples_seed is not None and not 0 <= self.tail_samples_seed < 2**32:
            raise ConfigError(f"--tail_samples_seed must be in [0, 2**32), got {self.tail_samples_seed}")

    def draws_seed(self, config: TrainConfig) -> int | None:
        """The seed of the tail draws' uniforms (None without draws)."""
        if not self.tail_samples:
            return None
        return config.seed if self.tail_samples_seed is None else self.tail_samples_seed


@dataclass(frozen=True)
class ScoringReport:
    output_dir: Path
    rows: int  # the training rows (dataset_name's)
    shards_written: int  # of both data sets
    shards_skipped: int
    tokens: int
    seconds: float
    eval_rows: int = 0  # eval_dataset_name's rows, scored into output_dir / EVAL_DIR


@dataclass(frozen=True)
class _Part:
    """One data set's scoring: its rows, their hashes and the manifest of the directory they go to."""

    directory: Path
    examples: list[DistillExample]
    hashes: list[bytes]
    manifest: Manifest


def score_teacher(config: TrainConfig, scoring: ScoringOptions = ScoringOptions()) -> ScoringReport:
    """Score ``config.dataset_name``'s completions with ``config.model_name_or_path`` (the teacher), its
    ``top_k`` log-probs into ``config.output_dir``, and ``config.eval_dataset_name``'s (when set) into its
    ``EVAL_DIR`` sub-directory; returns what was done (this rank's part). A key other than
    ``SCORING_KEYS`` set away from its default is a ``ConfigError`` naming it."""
    refuse_unread(config, SCORING_KEYS)
    # the temperature and max_length distillation reads the scores at, where the config leaves them null
    config = with_objective_defaults("distill", config)
    if config.top_k < 1:
        raise ConfigError("config key 'top_k' must be positive: how many of the teacher's log-probs to store")
    ctx = init_distributed()
    failed = True
    try:
        with bitsandbytes_hidden(config.quantization is None):  # as training: imported by 4-bit runs only
            report = _score(config, scoring, ctx)
        failed = False
        return report
    finally:
        shutdown_distributed(failed)


def teacher_weights(config: TrainConfig, path: Path | str) -> str:
    """What identifies the teacher's weights (``path``: ``resolve_model``'s answer): a Hub model's
    resolved commit, a built-in model's name (its weights are fixed), else the fingerprint of a local
    directory's weight files (names, sizes, mtimes: ``weights_fingerprint``)."""
    if isinstance(path, str):
        return f"built-in {path}"
    if not Path(config.model_name_or_path).exists():  # a Hub id: its snapshot directory is the commit's
        return f"revision {path.name}"
    return weights_fingerprint(path)


def _score(config: TrainConfig, scoring: ScoringOptions, ctx: DistributedContext) -> ScoringReport:
    started = time.perf_counter()
    out = Path(config.output_dir)
    path = resolve_model(config.model_name_or_path, config.model_revision)
    quantization = quant_options(config)  # 4-bit as training's teacher (its unquantized rest as there)
    model, tokenizer = load_model_and_tokenizer(path, quantization, ctx.device, materialize=False)
    set_model_options(model, str(path), config, ctx.device)  # on the skeleton: filled in its dtype
    model = materialize_model(
        model, path, quantization, ctx.device, config.seed, dtype=model_dtype(config, str(path))
    )
    override_tokenizer(tokenizer, model, config.eos_token, config.pad_token, config.chat_template_path)
    vocab = model.get_output_embeddings().weight.shape[0]
    if config.top_k > vocab:
        raise ConfigError(f"config key 'top_k' ({config.top_k}) is over the teacher's vocabulary ({vocab})")
    teacher = dict(  # the manifest's keys that both data sets share
        teacher=config.model_name_or_path,
        teacher_revision=config.model_revision,
        teacher_weights=teacher_weights(config, path),
        teacher_patched=config.use_liger_kernel,
        teacher_dtype=_dtype_name(_weights_dtype(model)),
        teacher_attn_implementation=model.config._attn_implementation,
        teacher_autocast=_dtype_name(_autocast_dtype(config)),
        teacher_quantization=None
        if quantization is None
        else quantization.quant_type + ("+double_quant" if quantization.double_quant else ""),
        teacher_vocab=vocab,
        tokenizer_hash=tokenizer_hash(tokenizer),
        k=config.top_k,
        dtype=scoring.logprobs_dtype,
        temperature=config.temperature,
        shard_rows=scoring.shard_rows,
        tail_samples=scoring.tail_samples,
        tail_samples_seed=scoring.draws_seed(config),
    )
    train_name = config.dataset_name or DistillObjective.default_dataset
    parts = [_part(out, _examples(config, tokenizer, train_name, "dataset_name"), teacher, scoring)]
    if config.eval_dataset_name:
        eval_examples = _examples(config, tokenizer, config.eval_dataset_name, "eval_dataset_name")
        parts.append(_part(out / EVAL_DIR, eval_examples, teacher, scoring))
    for part in parts:  # every directory checked before any scoring
        _check_earlier(part)
    if ctx.is_main:
        for part in parts:
            part.directory.mkdir(parents=True, exist_ok=True)
            for leftover in part.directory.glob(".*.tmp"):  # a killed run's half-written files
                leftover.unlink(missing_ok=True)
            if read_manifest(part.directory) is None:
                write_manifest(part.directory, part.manifest)
    if ctx.enabled:
        torch.distributed.barrier()

    if config.use_liger_kernel:
        fastalign.patch_model(model)
    else:  # the fused head alone, as training's
        patch_fused_head(model)
    model.requires_grad_(False).eval().to(ctx.device)
    collate = CompletionCollator(tokenizer.pad_token_id)
    written = skipped = tokens = 0
    for part in parts:
        for shard in range(ctx.rank, part.manifest.shards, ctx.world_size):
            if (part.directory / shard_name(shard)).exists():  # written atomically: complete
                skipped += 1
                continue
            tokens += _score_shard(model, collate, part, shard, config, scoring, ctx)
            written += 1
    if ctx.enabled:
        torch.distributed.barrier()
    if ctx.is_main:
        for part in parts:
            shards = range(part.manifest.shards)
            missing = [i for i in shards if not (part.directory / shard_name(i)).exists()]
            if missing:  # a rank's files rank 0 cannot see (a directory not shared), or removed meanwhile
                raise ConfigError(
                    f"config key 'output_dir': {part.directory} lacks shards {missing[:5]} after scoring "
                    "(every rank must write to one directory they all see; or a file was removed meanwhile): "
                    "rerun fastalign teacher-logprobs on it to score them"
                )
            total = _count_tokens(part.directory, part.manifest.shards)
            write_manifest(part.directory, dataclasses.replace(part.manifest, complete=True, tokens=total))
    eval_rows = len(parts[1].examples) if len(parts) > 1 else 0
    seconds = time.perf_counter() - started
    return ScoringReport(out, len(parts[0].examples), written, skipped, tokens, seconds, eval_rows)


def _autocast_dtype(config: TrainConfig) -> torch.dtype | None:
    """The autocast of the teacher's forward: bf16 or fp16 over its weights, as the engine runs an online
    teacher under ``bf16`` / ``fp16`` (here on every rank: each holds a whole teacher, no FSDP policy)."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    """A dtype as the manifest records it: "bfloat16", ... (None: none)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _weights_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the teacher's floating weights as loaded (``dtype``, ``model_init_kwargs``): its
    numerics, recorded in the manifest."""
    return next(param.dtype for param in model.parameters() if param.is_floating_point())


def _part(directory: Path, examples: list[DistillExample], teacher: dict, scoring: ScoringOptions) -> _Part:
    hashes = [row_hash(e.prompt_ids, e.completion_ids) for e in examples]
    manifest = Manifest(
        **teacher,
        dataset_hash=dataset_hash(hashes),
        rows=len(examples),
        shards=max(1, math.ceil(len(examples) / scoring.shard_rows)),
    )
    return _Part(directory, examples, hashes, manifest)


def _check_earlier(part: _Part) -> None:
    """A directory that holds another scoring (another teacher, its weights, data, k, ...) is refused,
    naming the first key that differs and both values; so is one holding shards without a manifest."""
    earlier = read_manifest(part.directory)
    if earlier is None:
        shards = sorted(part.directory.glob("shard-*.safetensors")) if part.directory.is_dir() else []
        if shards:  # the manifest is written before any shard: these are of an unknown scoring
            raise ConfigError(
                f"config key 'output_dir': {part.directory} holds shards ({shards[0].name}, ...) but no "
                f"{MANIFEST} saying how they were scored: remove them or use another directory"
            )
        return
    if earlier.run_keys() == part.manifest.run_keys():
        return
    now, there = part.manifest.run_keys(), earlier.run_keys()
    key = next(k for k, v in now.items() if there[k] != v)
    raise ConfigError(
        f"config key 'output_dir': {part.directory} holds teacher log-probs of another scoring ({key} "
        f"{there[key]!r} there, {now[key]!r} now): use another directory"
    )


def _score_shard(
    model, collate, part: _Part, shard: int, config: TrainConfig, scoring: ScoringOptions, ctx
) -> int:
    """Score shard ``shard`` of ``part`` and write it; returns its completion tokens."""
    rows = range(shard * scoring.shard_rows, min(len(part.examples), (shard + 1) * scoring.shard_rows))
    scored: list[ScoredRow] = []
    for start in range(rows.start, rows.stop, config.per_device_eval_batch_size):
        batch_rows = range(start, min(rows.stop, start + config.per_device_eval_batch_size))
        batch_examples = [part.examples[i] for i in batch_rows]
        uniforms = _uniforms(part, batch_rows)
        scores_of_rows = _score_batch(model, collate(batch_examples), config, ctx, uniforms)
        for index, scores in zip(batch_rows, scores_of_rows, strict=True):
            scored.append(ScoredRow(part.hashes[index], *scores))
    write_shard(part.directory, shard, scored, scoring.logprobs_dtype)
    return sum(row.ids.shape[0] for row in scored)


def _uniforms(part: _Part, rows: range) -> torch.Tensor | None:
    """The uniforms of the tail draws of ``part``'s ``rows`` [their completion tokens, M], the rows' in
    order (None without draws)."""
    samples, seed = part.manifest.tail_samples, part.manifest.tail_samples_seed
    if not samples:
        return None
    examples = part.examples
    return torch.cat(
        [tail_uniforms(seed, part.hashes[i], len(examples[i].completion_ids), samples) for i in rows]
    )


def _examples(config: TrainConfig, tokenizer, name: str, key: str) -> list[DistillExample]:
    """The rows of data set ``name`` (config key ``key``) as ``train distill`` tokenizes them (a Hub
    dataset's ``dataset_train_split`` for training, ``dataset_test_split`` for evaluation); prompt-only
    rows (nothing to score) left out."""
    if is_hub_dataset(name):
        split = config.dataset_train_split if key == "dataset_name" else config.dataset_test_split
        rows = load_dataset_rows(name, split, config.dataset_config, config.dataset_revision, key=key)
    else:
        rows = load_dataset_rows(name, key=key)
    scoring_config = dataclasses.replace(
        config, teacher_model_name_or_path=config.model_name_or_path, lmbda=0.0, top_k=0
    )
    objective = DistillObjective.from_config("distill", scoring_config, DistributedContext(0, 1, 0, "cpu"))
    examples = [e for e in objective.tokenize(rows, tokenizer) if e.completion_ids]
    if not examples:
        raise ValueError(f"{key} {name!r}: no row has a completion to score")
    return examples


@torch.no_grad()
def _score_batch(model, batch: dict, config: TrainConfig, ctx: DistributedContext, uniforms):
    """Per row of ``batch``: the top-k ids and log-probs, tail and token log-prob of its completion, and
    its tail draws at ``uniforms`` [completion tokens, M] (the rows' in order; None: no draws)."""
    mask = batch["completion_mask"].bool()
    width = batch["input_ids"].shape[1] - mask.shape[1]
    tokens = batch["input_ids"][:, width:]
    inputs = {key: batch[key].to(ctx.device) for key in ("input_ids", "attention_mask", "position_ids")}
    device_mask, device_tokens = mask.to(ctx.device), tokens.to(ctx.device)

    def head(hidden, weight, bias, softcap=None):
        rows = hidden[:, width - 1 : -1][device_mask]
        return linear_topk_logprobs(
            rows,
            weight,
            config.top_k,
            device_tokens[device_mask],
            bias=bias,
            temperature=config.temperature,
            softcap=softcap,
            tail_samples=0 if uniforms is None else uniforms.shape[1],
            uniforms=None if uniforms is None else uniforms.to(ctx.device),
        )

    precision = _autocast_dtype(config)
    with autocast(ctx.device, precision, precision or _weights_dtype(model)):  # the engine's GEMMs too
        top = model(**inputs, head_fn=head).head_output
    lengths = mask.sum(-1).tolist()
    parts = [torch.split(tensor.cpu(), lengths) for tensor in top]
    return list(zip(*parts, strict=True))


def _count_tokens(out: Path, shards: int) -> int:
    from safetensors import safe_open

    total = 0
    for shard in range(shards):
        with safe_open(str(out / shard_name(shard)), framework="pt") as handle:
            total += int(handle.get_slice("tail").get_shape()[0])
    return total
