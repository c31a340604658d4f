"""``fastalign teacher-logprobs``: score a data set's completions with a teacher once, for offline
distillation (``fastalign train distill --teacher_logprobs_path``).

The rows are read and tokenized as ``train distill`` reads them (prompt-completion, conversational or
messages rows; the same ``max_length``, ``truncation`` and chat template keys); prompt-only rows have
nothing to score and are left out. The teacher (``model_name_or_path``) runs in eval mode, patched, its
head fused: per completion token, ``linear_topk_logprobs`` walks the vocabulary in slices and keeps a
running top-``top_k`` and log-sum-exp (no [tokens, vocab] logits), at ``temperature``. Rows go to shards
of ``shard_rows`` (``fastalign.data.teacher_logprobs``), each written atomically once its rows are scored;
under ``torchrun`` rank r scores shards r, r + world, ... (a whole teacher on each process, no
collective during scoring). A rerun on the same directory skips the shards that exist: a killed run
resumes from its last complete shard. A rerun whose teacher (its weights' fingerprint: a local
directory's weight files' names, sizes and mtimes, a Hub model's resolved commit; and whether it is
patched: ``use_liger_kernel``), data or keys differ from the directory's manifest is refused. Memory
holds one batch's activations and one shard's scores.
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
    Manifest,
    ScoredRow,
    dataset_hash,
    read_manifest,
    row_hash,
    shard_name,
    tokenizer_hash,
    weights_fingerprint,
    write_manifest,
    write_shard,
)
from fastalign.data.tokenizer_options import override_tokenizer
from fastalign.ops.sparse_divergence import linear_topk_logprobs
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext, init_distributed, shutdown_distributed
from fastalign.train.loading import (
    is_hub_dataset,
    load_dataset_rows,
    load_model_and_tokenizer,
    materialize_model,
    resolve_model,
)
from fastalign.train.objectives.distill import CompletionCollator, DistillExample, DistillObjective
from fastalign.train.policy import set_model_options


@dataclass(frozen=True)
class ScoringOptions:
    """What the command reads besides the ``TrainConfig`` keys (the teacher, data and length keys)."""

    shard_rows: int = 256
    logprobs_dtype: str = "float32"

    def __post_init__(self):
        if self.shard_rows < 1:
            raise ConfigError(f"--shard_rows must be positive, got {self.shard_rows}")
        if self.logprobs_dtype not in DTYPES:
            raise ConfigError(
                f"--logprobs_dtype must be one of {', '.join(DTYPES)}, got {self.logprobs_dtype!r}"
            )


@dataclass(frozen=True)
class ScoringReport:
    output_dir: Path
    rows: int
    shards_written: int
    shards_skipped: int
    tokens: int
    seconds: float


def score_teacher(config: TrainConfig, scoring: ScoringOptions = ScoringOptions()) -> ScoringReport:
    """Score ``config.dataset_name``'s completions with ``config.model_name_or_path`` (the teacher), its
    ``top_k`` log-probs into ``config.output_dir``; returns what was done (this rank's part)."""
    if config.top_k < 1:
        raise ConfigError("config key 'top_k' must be positive: how many of the teacher's log-probs to store")
    ctx = init_distributed()
    try:
        return _score(config, scoring, ctx)
    finally:
        shutdown_distributed()


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
    model, tokenizer = load_model_and_tokenizer(path, None, ctx.device, materialize=False)
    model = materialize_model(model, path, None, ctx.device, config.seed)
    override_tokenizer(tokenizer, model, config.eos_token, config.pad_token, config.chat_template_path)
    examples = _examples(config, tokenizer)
    if not examples:
        raise ValueError(f"dataset {config.dataset_name!r}: no row has a completion to score")
    hashes = [row_hash(e.prompt_ids, e.completion_ids) for e in examples]
    vocab = model.get_output_embeddings().weight.shape[0]
    if config.top_k > vocab:
        raise ConfigError(f"config key 'top_k' ({config.top_k}) is over the teacher's vocabulary ({vocab})")
    manifest = Manifest(
        teacher=config.model_name_or_path,
        teacher_revision=config.model_revision,
        tokenizer_hash=tokenizer_hash(tokenizer),
        k=config.top_k,
        dtype=scoring.logprobs_dtype,
        temperature=config.temperature,
        dataset_hash=dataset_hash(hashes),
        rows=len(examples),
        shard_rows=scoring.shard_rows,
        shards=max(1, math.ceil(len(examples) / scoring.shard_rows)),
        teacher_weights=teacher_weights(config, path),
        teacher_patched=config.use_liger_kernel,
    )
    earlier = read_manifest(out)
    if earlier is not None and earlier.run_keys() != manifest.run_keys():
        key = next(k for k, v in manifest.run_keys().items() if earlier.run_keys()[k] != v)
        raise ConfigError(
            f"config key 'output_dir': {out} holds teacher log-probs of another scoring ({key} "
            f"{earlier.run_keys()[key]!r} there, {manifest.run_keys()[key]!r} now): use another directory"
        )
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if earlier is None:
            write_manifest(out, manifest)
    if ctx.enabled:
        torch.distributed.barrier()

    set_model_options(model, str(path), config, ctx.device)
    if config.use_liger_kernel:
        fastalign.patch_model(model)
    else:  # the fused head alone
        fastalign.patch_model(model, rms_norm=False, rope=False, mlp=False, linear=False)
    model.requires_grad_(False).eval().to(ctx.device)
    collate = CompletionCollator(tokenizer.pad_token_id)
    written = skipped = tokens = 0
    for shard in range(ctx.rank, manifest.shards, ctx.world_size):
        if (out / shard_name(shard)).exists():  # written atomically: complete
            skipped += 1
            continue
        rows = range(shard * scoring.shard_rows, min(len(examples), (shard + 1) * scoring.shard_rows))
        scored: list[ScoredRow] = []
        for start in range(rows.start, rows.stop, config.per_device_eval_batch_size):
            batch_rows = range(start, min(rows.stop, start + config.per_device_eval_batch_size))
            batch_examples = [examples[i] for i in batch_rows]
            scores_of_rows = _score_batch(model, collate(batch_examples), config, ctx)
            for index, scores in zip(batch_rows, scores_of_rows, strict=True):
                scored.append(ScoredRow(hashes[index], *scores))
        tokens += sum(row.ids.shape[0] for row in scored)
        write_shard(out, shard, scored, scoring.logprobs_dtype)
        written += 1
    if ctx.enabled:
        torch.distributed.barrier()
    if ctx.is_main:
        missing = [i for i in range(manifest.shards) if not (out / shard_name(i)).exists()]
        if missing:
            raise RuntimeError(f"{out}: shards {missing[:5]} were not written")
        total = _count_tokens(out, manifest.shards)
        write_manifest(out, dataclasses.replace(manifest, complete=True, tokens=total))
    return ScoringReport(out, len(examples), written, skipped, tokens, time.perf_counter() - started)


def _examples(config: TrainConfig, tokenizer) -> list[DistillExample]:
    """The data's rows as ``train distill`` tokenizes them; prompt-only rows (nothing to score) left out."""
    name = config.dataset_name or DistillObjective.default_dataset
    if is_hub_dataset(name):
        rows = load_dataset_rows(
            name, config.dataset_train_split, config.dataset_config, config.dataset_revision
        )
    else:
        rows = load_dataset_rows(name)
    scoring_config = dataclasses.replace(
        config, teacher_model_name_or_path=config.model_name_or_path, lmbda=0.0, top_k=0
    )
    objective = DistillObjective.from_config("distill", scoring_config, DistributedContext(0, 1, 0, "cpu"))
    return [e for e in objective.tokenize(rows, tokenizer) if e.completion_ids]


@torch.no_grad()
def _score_batch(model, batch: dict, config: TrainConfig, ctx: DistributedContext):
    """Per row of ``batch``: the top-k ids and log-probs, tail and token log-prob of its completion."""
    mask = batch["completion_mask"].bool()
    width = batch["input_ids"].shape[1] - mask.shape[1]
    tokens = batch["input_ids"][:, width:]
    inputs = {key: batch[key].to(ctx.device) for key in ("input_ids", "attention_mask", "position_ids")}
    device_mask, device_tokens = mask.to(ctx.device), tokens.to(ctx.device)

    def head(hidden, weight, bias):
        rows = hidden[:, width - 1 : -1][device_mask]
        return linear_topk_logprobs(
            rows, weight, config.top_k, device_tokens[device_mask], bias=bias, temperature=config.temperature
        )

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
