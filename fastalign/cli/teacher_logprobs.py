"""``fastalign teacher-logprobs --model_name_or_path TEACHER --dataset_name DATA --top_k K --output_dir DIR``:
the teacher's top-k log-probs of a data set's completions, stored once for ``fastalign train distill
--teacher_logprobs_path DIR`` (``fastalign.train.teacher_logprobs``).

Other keys are ``TrainConfig``'s that scoring reads (``SCORING_KEYS``: the teacher's loading and
precision, ``dtype``, ``attn_implementation``, ``quantization``, ``bf16``; the data and tokenizing keys
``train distill`` reads, ``max_length``, ``truncation``, ``truncation_mode``, ``chat_template_kwargs``;
``temperature``, ``per_device_eval_batch_size``, ``seed``); ``--config FILE`` reads them from YAML first. A
training key (``learning_rate``, ``use_peft``, ``loss_top_k``, ...) set away from its default is refused in
one line naming it, never ignored. ``--eval_dataset_name EVAL`` scores its rows too, into ``DIR/eval``,
where ``train distill --eval_dataset_name EVAL`` finds them.
"""

from __future__ import annotations

import argparse
import sys

from fastalign.errors import one_line


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "teacher-logprobs",
        help="store a teacher's top-k log-probs of a data set, for offline distillation",
        description="Scores every completion token of the data (the formats train distill reads) with the "
        "teacher and writes its top-k token ids and log-probs, sharded, beside a manifest. Keys are "
        "TrainConfig fields, read as train distill reads them: the teacher's (model_name_or_path, "
        "model_revision, dtype, attn_implementation, model_init_kwargs, quantization, "
        "bnb_4bit_use_double_quant, bf16 or fp16 autocast, use_liger_kernel, seed), the data's (dataset "
        "keys, max_length, truncation, truncation_mode, chat template keys, eos_token, pad_token: pass the "
        "training run's), top_k, temperature, per_device_eval_batch_size and output_dir; a training key "
        "set is refused. --eval_dataset_name EVAL (a Hub dataset's "
        "dataset_test_split) also scores the evaluation rows, into OUTPUT_DIR/eval, where train distill "
        "with the same eval_dataset_name finds them (eval_split_ratio holds out training rows: nothing "
        "more to score). A rerun on the same output_dir resumes from its complete shards (adding "
        "eval_dataset_name later scores only its rows); one with another teacher (a local directory's "
        "weight files changed: names, sizes, mtimes), dtype, attention, autocast, quantization, "
        "use_liger_kernel, data or keys is refused.",
        epilog="example: fastalign teacher-logprobs --model_name_or_path TEACHER --dataset_name data.jsonl "
        "--eval_dataset_name held_out.jsonl --top_k 32 --output_dir teacher_lp; then fastalign train "
        "distill --teacher_logprobs_path teacher_lp --dataset_name data.jsonl --eval_dataset_name "
        "held_out.jsonl --beta 0 ...",
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config (TrainConfig keys)")
    parser.add_argument("--shard_rows", type=int, default=256, help="rows per shard file (default 256)")
    parser.add_argument(
        "--logprobs_dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="stored log-probs' dtype (ids are int32)",
    )
    parser.add_argument(
        "--tail_samples",
        type=int,
        default=0,
        help="draws per token from the teacher's distribution outside its top-k, stored for train distill "
        "to estimate the tail's shape (fastalign's, not TRL's; 4 B a draw; default 0: none)",
    )
    parser.add_argument(
        "--tail_samples_seed",
        type=int,
        default=None,
        help="seed of the tail draws (each row's from it and the row's content hash; default: --seed)",
    )
    parser.set_defaults(run=run, allow_extra=True)


def run(args: argparse.Namespace) -> int:
    from fastalign.train.config import load_config
    from fastalign.train.teacher_logprobs import SCORING_KEYS, ScoringOptions, score_teacher

    try:
        config = load_config(args.config, getattr(args, "extra", ()), reads=SCORING_KEYS)

        scoring = ScoringOptions(
            args.shard_rows, args.logprobs_dtype, args.tail_samples, args.tail_samples_seed
        )
        report = score_teacher(config, scoring)
    except (ValueError, OSError, MemoryError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    from fastalign.data.teacher_logprobs import EVAL_DIR

    evaluation = (
        f" and {report.eval_rows} eval rows into {report.output_dir / EVAL_DIR}" if report.eval_rows else ""
    )
    print(
        f"scored {report.rows} rows into {report.output_dir}{evaluation} ({report.shards_written} shards "
        f"written, {report.shards_skipped} already there, {report.tokens} tokens, {report.seconds:.1f} s)"
    )
    if scoring.tail_samples:  # distill's default beta (1.0, TRL's) is refused with draws: say so now
        print(
            f"train on its {scoring.tail_samples} tail draws with forward KL: fastalign train distill "
            f"--teacher_logprobs_path {report.output_dir} --beta 0"
        )
    return 0
