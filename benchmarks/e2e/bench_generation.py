"""Rollout generation: fastalign's engine against ``model.generate`` and transformers' continuous batching.

    python benchmarks/e2e/bench_generation.py --preset cpu      # SmolLM2-135M-Instruct, 64 and 256 tokens
    python benchmarks/e2e/bench_generation.py --preset cpu-long # the same with ~770-token prompts, 64 tokens
    python benchmarks/e2e/bench_generation.py --preset gpu      # Llama-3.2-1B shape, random weights, bf16
    python benchmarks/e2e/bench_generation.py --preset quick    # a tiny random model: it works

What GRPO's rollout asks for: ``prompts`` chat prompts (questions about the Python documentation's
topics, ``pydoc_data``), ``group`` sampled completions of each (temperature 1, no top-k or top-p), up to
``max_new_tokens``, ending at the model's EOS where it samples one. Rows (providers):

- ``generate``: ``model.generate`` on the prompts repeated ``group`` times (fastalign's rollout before the
  engine, and TRL's GRPOTrainer without vLLM);
- ``fastalign``: the engine (``fastalign.sampling.generation.sample_groups``): each prompt prefilled once,
  ended rows dropped, inverse-CDF draws; on a GPU its decode steps replayed as CUDA graphs (the row's
  ``decode``: ``graphs``, or ``eager`` where the model keeps them eager, with the reason where a step
  could not be captured or replayed);
- ``fastalign-eager`` (GPU only: on a CPU the engine always steps eagerly, the ``fastalign`` row): the
  engine without the graphs, what they gain;
- ``continuous``: transformers' continuous batching (``model.generate_batch``, paged attention; TRL's
  ``use_transformers_paged``), each completion a request (on a CPU one call, at the shortest length
  only, without a warm-up: a first call took 2.6 to 25 minutes on a shared 2-core CPU).

Every provider runs the same prompts, seeds and options in one process, one provider after the other
(its warm-up, a shorter call on a GPU, then its repeats; its row is recorded as soon as it is measured,
so a run stopped early keeps the rows it finished). A row: ``seconds`` (median wall time of a call),
``cpu_seconds`` (median CPU time of this process: on a CPU shared with other work it moves less than the
wall time), ``completion_tokens`` (completion tokens up to and including the EOS, summed over the rows,
median), ``tokens_per_s`` = completion_tokens / seconds, ``speedup`` = tokens_per_s over ``generate``'s,
``tokens_per_cpu_s`` and ``cpu_speedup`` the same over CPU seconds (on a CPU shared with other work, at
one thread, the figures to read: the wall time also counts the waits for a core), and
``model_tokens``: the token positions the provider ran through the model (prefill tokens, padding
included, plus one per row and decode step), its work.

Floor: exact sampling leaves no FLOP of a forward out, so an engine gains only by running fewer token
positions. ``work_bound`` (generate's ``model_tokens`` over the provider's, times the completion tokens'
ratio) is the speedup it would reach at generate's cost per position; it reaches less where its decode
steps hold fewer rows (a step's cost per row falls as its rows grow, down to the GEMMs' compute ceiling;
a step of a few rows costs one read of the weights). On a CPU the decode GEMMs run near the core's FMA
ceiling above ~32 rows, so the work bound is the ceiling of the speedup there.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import arguments, keep_rows_on_termination, record, select_providers  # noqa: E402
from fastalign.sampling import decode_steps  # noqa: E402

KERNEL = "e2e_generation"
PROVIDERS = ("generate", "fastalign", "fastalign-eager", "continuous")
PRESETS = {
    "cpu": {"model": "smollm2", "prompts": 4, "group": 8, "lengths": [64, 256], "repeats": 2,
            "dtype": "float32", "continuous_lengths": [64]},
    # warmup_tokens: the untimed first call's length (default: the timed one's). On a GPU it warms CUDA's
    # libraries and kernels, which a short call does as well, and the GPU check's phase is capped
    "gpu": {"model": "llama-3.2-1b", "prompts": 8, "group": 8, "lengths": [128], "repeats": 1,
               "dtype": "bfloat16", "warmup_tokens": 8},
    "cpu-long": {"model": "smollm2", "prompts": 4, "group": 8, "lengths": [64], "repeats": 2,
                 "dtype": "float32", "context_words": 400, "continuous_lengths": []},
    # continuous_cache: the paged cache's size (ContinuousBatchingConfig). Left unset, transformers sizes
    # it to 90% of the free memory, on a CPU the host's: a tiny model's four requests then wait ~20 s for
    # gigabytes of cache to be zeroed (and take them from whatever runs beside), at every call.
    "quick": {"model": "tiny-llama", "prompts": 2, "group": 2, "lengths": [8], "repeats": 1,
              "dtype": "float32", "continuous_cache": {"num_blocks": 16, "max_batch_tokens": 512}},
}  # fmt: skip


def questions(count: int, context_words: int = 0) -> list[str]:
    """Chat questions about the first ``count`` topics of the Python documentation; with
    ``context_words``, each preceded by the topic's text, cut to that many words (a long prompt, as a
    retrieval-augmented or few-shot rollout has)."""
    from pydoc_data.topics import topics

    names = sorted(topics)[:count]
    texts = []
    for name in names:
        question = f"In a few sentences, what does the Python documentation's topic '{name}' cover?"
        if context_words:
            passage = " ".join(topics[name].split()[:context_words])
            question = f"Documentation:\n{passage}\n\n{question}"
        texts.append(question)
    return texts


def load(preset: dict, device: torch.device):
    """The model (eval mode) and tokenizer of a preset."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, preset["dtype"])
    if preset["model"] == "smollm2":
        from tests.real.model import smollm2_dir

        path = smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    elif preset["model"] == "tiny-llama":
        from fastalign.builtin import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama", dtype=dtype), tiny_tokenizer()
    else:  # random weights of a built-in shape, the byte-level tokenizer padded to its vocabulary
        from fastalign.builtin import tiny_tokenizer
        from fastalign.plan.shapes import builtin_config

        config = builtin_config(preset["model"])
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = tiny_tokenizer(config.vocab_size)
    tokenizer.padding_side = "left"
    return model.to(device).eval(), tokenizer


def encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in texts
        ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


def completion_tokens(completions: list[list[int]], eos: int) -> int:
    """Tokens up to and including each completion's first EOS."""
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in completions)


def sample(
    provider: str, model, ids, mask, group: int, options: dict, cache: dict | None = None
) -> list[list[int]]:
    """Each completion's ids (a prompt's ``group`` adjacent); ``cache``: continuous batching's paged cache
    size (``ContinuousBatchingConfig``'s ``num_blocks``, ``max_batch_tokens``), None to let it size itself."""
    from fastalign.sampling.generation import sample_groups

    if provider == "generate":
        out = model.generate(
            input_ids=ids.repeat_interleave(group, 0),
            attention_mask=mask.repeat_interleave(group, 0),
            **options,
        )
        return out[:, ids.shape[1] :].tolist()
    if provider in ("fastalign", "fastalign-eager"):
        static = None if provider == "fastalign" else False
        return sample_groups(model, ids, mask, group, options, static=static)[:, ids.shape[1] :].tolist()
    from transformers import GenerationConfig

    prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True) for _ in range(group)]
    sizing: dict = {}
    if cache:
        try:
            from transformers import ContinuousBatchingConfig

            sizing["continuous_batching_config"] = ContinuousBatchingConfig(**cache)
        except ImportError:  # transformers before ContinuousBatchingConfig: they were generation options
            options = options | cache
    outputs = model.generate_batch(
        inputs=prompts, generation_config=GenerationConfig(**options), progress_bar=False, **sizing
    )
    return [list(output.generated_tokens) for output in outputs.values()]


class TokenCounter:
    """Counts the token positions every forward of ``model`` runs (``input_ids``' elements)."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.count += ids.numel()

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _decode_mode(before: dict) -> str:
    """How the engine's last call decoded: ``graphs`` if it captured CUDA graphs since ``before`` (the
    capture counts then) and kept them, ``eager: ...`` with the reason if it left them, else ``eager``."""
    new = {key: count - before.get(key, 0) for key, count in decode_steps.CAPTURES.items()}
    if new.get("uncaptured"):
        why = (
            "a replay differed" if new.get("differed") else "a capture failed" if new.get("failed") else None
        )
        return f"eager: {why or 'the step cannot be captured'}"
    return "graphs" if new.get("captured") else "eager"


def _shape(preset: dict, length: int, prompt_tokens: int) -> str:
    return (
        f"{preset['model']}, {preset['prompts']} prompts of ≤ {prompt_tokens} tokens × {preset['group']}, "
        f"≤ {length} tokens"
    )


def _continuous_runs(preset: dict, length: int, repeat: int) -> bool:
    """Whether continuous batching runs at this length and repeat: on a CPU (``continuous_lengths``) one
    timed call at the shortest length, without a warm-up (a call takes over ten minutes there)."""
    lengths = preset.get("continuous_lengths")
    return lengths is None or (length in lengths and repeat == 1)


def run(preset_name: str, providers: list[str], out: Path) -> Path:
    preset = PRESETS[preset_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    model, tokenizer = load(preset, device)
    print(
        f"loaded {preset['model']} in {time.perf_counter() - start:.1f} s", flush=True
    )  # a capped run's last line
    texts = questions(preset["prompts"], preset.get("context_words", 0))
    ids, mask = (t.to(device) for t in encode(tokenizer, texts))
    eos = tokenizer.eos_token_id
    cache = preset.get("continuous_cache")
    rows, skipped = [], {}
    counter = TokenCounter(model)
    with keep_rows_on_termination(skipped), torch.no_grad():
        for length in preset["lengths"]:
            options = dict(
                do_sample=True, max_new_tokens=length, temperature=1.0, top_k=0, top_p=1.0,
                eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            base = None
            # provider by provider (its warm-up, then its repeats), each row recorded as soon as it is
            # measured: a run stopped early (the GPU check's cap) keeps the rows it finished
            for provider in providers:
                got: dict = {"seconds": [], "cpu": [], "tokens": [], "work": []}
                for repeat in range(preset["repeats"] + 1):  # the first repeat warms up
                    if provider == "continuous" and not _continuous_runs(preset, length, repeat):
                        continue
                    if provider == "fastalign-eager" and device.type != "cuda":
                        skipped[f"{provider}/{length}"] = (
                            "on a CPU the engine steps eagerly: the fastalign row"
                        )
                        break
                    torch.manual_seed(repeat)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    wall, cpu = time.perf_counter(), time.process_time()
                    counter.take()
                    captures = dict(decode_steps.CAPTURES)
                    warmup = {"max_new_tokens": preset.get("warmup_tokens", length)} if not repeat else {}
                    try:
                        completions = sample(
                            provider, model, ids, mask, preset["group"], options | warmup, cache
                        )
                    except Exception as failure:  # a provider that fails is a skipped row, not a partial one
                        skipped[f"{provider}/{length}"] = f"{type(failure).__name__}: {failure}"[:300]
                        got["seconds"].clear()
                        break
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    print(
                        f"{provider}, {length} tokens, call {repeat}: {time.perf_counter() - wall:.1f} s",
                        flush=True,
                    )
                    if repeat:
                        got["seconds"].append(time.perf_counter() - wall)
                        got["cpu"].append(time.process_time() - cpu)
                        got["tokens"].append(completion_tokens(completions, eos))
                        got["work"].append(counter.take())
                        got["decode"] = _decode_mode(captures)
                if not got["seconds"]:
                    continue
                seconds, tokens = statistics.median(got["seconds"]), statistics.median(got["tokens"])
                row = {
                    "provider": provider, "shape": _shape(preset, length, ids.shape[1]),
                    "max_new_tokens": length,
                    "prompts": preset["prompts"], "group": preset["group"], "seconds": round(seconds, 3),
                    "cpu_seconds": round(statistics.median(got["cpu"]), 3),
                    "completion_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                    "tokens_per_cpu_s": round(tokens / statistics.median(got["cpu"]), 1),
                    "model_tokens": statistics.median(got["work"]),
                }  # fmt: skip
                if provider.startswith("fastalign"):
                    row["decode"] = got["decode"]
                if provider == "generate":
                    base = row
                if base:
                    row["speedup"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
                    row["cpu_speedup"] = round(row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"], 3)
                    row["work_bound"] = round(
                        base["model_tokens"] / row["model_tokens"] * tokens / base["completion_tokens"], 3
                    )
                rows.append(row)
                print(row, flush=True)
    counter.handle.remove()
    floor = (
        "work: exact sampling runs every FLOP of each forward, so a provider's speedup over generate is at "
        "most work_bound (generate's model_tokens over its own, per completion token) at generate's cost per "
        "token position; steps of fewer rows cost more per row (down to one read of the weights a step)"
    )
    return record(
        suite="e2e", kernel=KERNEL, preset=preset_name, floor=floor, ceiling={}, device=device,
        rows=rows, skipped=skipped, out_dir=out,
    )  # fmt: skip


def main() -> None:
    parser = arguments(__doc__, PRESETS, "cpu")
    args = parser.parse_args()
    providers = select_providers(KERNEL, PROVIDERS, args.providers)
    torch.set_num_threads(torch.get_num_threads())
    run(args.preset, providers, args.out)


if __name__ == "__main__":
    main()
