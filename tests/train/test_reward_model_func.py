"""A trained reward model in ``reward_funcs`` (``fastalign.train.reward_model``): TRL 1.16's GRPOTrainer as
the oracle of its rewards, a GRPO run that logs them, and the specs that are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fastalign.builtin import tiny_model, tiny_prompt_rows, tiny_tokenizer
from fastalign.train.config import TrainConfig
from fastalign.train.rewards import compute_rewards, resolve_reward_funcs
from fastalign.train.run import run_training
from tests.helpers import require
from tests.train.test_hub_ids import cache_tiny_model, hub  # noqa: F401  (hub: a fixture)

#: A chat template with a variable, to show that ``chat_template_kwargs`` reach the reward tokenizer.
TEMPLATE = (
    "{% if system_note %}<|im_start|>system\n{{ system_note }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
)
TEMPLATE_KWARGS = {"system_note": "be brief"}
PROMPTS = ["What is 2 + 3?", "Say hi", "a", "the model learns numbers"]
COMPLETIONS = [" 5", " hello there friend", "", " and words quickly while training"]


def save_reward_model(path: Path, *, seed: int, pad: bool = True, **options) -> str:
    """A tiny random Llama reward model (one-label head) with the tiny tokenizer, whose chat template
    reads ``system_note``; ``pad=False`` saves the tokenizer without a pad token."""
    tiny_model("llama", task="sequence_classification", seed=seed, **options).save_pretrained(path)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    if not pad:
        tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory) -> list[str]:
    """Two reward models: ``rm`` and ``rm_nopad``, whose tokenizer has no pad token (EOS pads, as TRL)."""
    root = tmp_path_factory.mktemp("reward-models")
    return [save_reward_model(root / "rm", seed=1), save_reward_model(root / "rm_nopad", seed=2, pad=False)]


def conversations(texts: list[str], role: str) -> list[list[dict[str, str]]]:
    return [[{"role": role, "content": text}] for text in texts]


def fastalign_rewards(specs, prompts, completions, **options) -> torch.Tensor:
    funcs = resolve_reward_funcs(specs, **options)
    return compute_rewards(
        funcs, prompts, completions, [[1]] * len(prompts), {"answer": ["5"] * len(prompts)}
    )


@pytest.mark.slow
def test_rewards_equal_trl_grpo_trainers_for_standard_and_conversational_samples(reward_models, tmp_path):
    """TRL's own ``GRPOTrainer._calculate_rewards`` with the same two model directories in its
    ``reward_funcs``: the same names and the same rewards, for text prompts (prompt + completion) and
    message prompts (the reward tokenizer's chat template, with ``chat_template_kwargs``); a tokenizer
    without a pad token pads with EOS, which both set as the model's pad id."""
    import datasets

    require("trl")
    from trl import GRPOConfig, GRPOTrainer

    policy = tmp_path / "policy"
    tiny_model("llama").save_pretrained(policy)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        num_generations=2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        chat_template_kwargs=TEMPLATE_KWARGS,
    )
    trainer = GRPOTrainer(
        model=str(policy),
        reward_funcs=list(reward_models),
        args=args,
        train_dataset=datasets.Dataset.from_list(tiny_prompt_rows(4)),
        processing_class=tiny_tokenizer(),
    )
    funcs = resolve_reward_funcs(reward_models, chat_template_kwargs=TEMPLATE_KWARGS)
    assert [func.name for func in funcs] == trainer.reward_func_names == ["rm", "rm_nopad"]
    for prompts, completions in [
        (PROMPTS, COMPLETIONS),
        (conversations(PROMPTS, "user"), conversations(COMPLETIONS, "assistant")),
    ]:
        inputs = [{"prompt": prompt, "answer": "5"} for prompt in prompts]
        theirs = trainer._calculate_rewards(inputs, prompts, completions, [[1]] * len(prompts))
        ours = fastalign_rewards(funcs, prompts, completions)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
        assert ours.std(0).min() > 0  # the samples really score differently


def direct_scores(path: str, texts: list[str]) -> list[float]:
    """TRL's documented scoring, one sequence at a time with plain transformers (no padding at all)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [
            float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            for text in texts
        ]


@pytest.mark.slow
def test_a_grpo_run_logs_the_reward_models_scores_of_its_completions(reward_models, tmp_path):
    """``fastalign train grpo`` with a model directory in ``reward_funcs``: each logged completion's reward
    and the logged ``rewards/rm/mean`` are the model's scores of prompt + completion, computed here apart."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in tiny_prompt_rows(4)))
    config = TrainConfig(
        dataset_name=str(data),
        output_dir=str(tmp_path / "run"),
        reward_funcs=[reward_models[0]],
        num_generations=2,
        max_completion_length=6,
        per_device_train_batch_size=4,
        max_steps=1,
        logging_steps=1,
        log_completions=True,
        loss_curve_png=False,
    )
    logged = json.loads((run_training(config, "grpo") / "metrics.jsonl").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    scores = direct_scores(reward_models[0], [row["prompt"] + row["completion"] for row in rows])
    assert [row["rm"] for row in rows] == pytest.approx(scores, rel=1e-5, abs=1e-6)
    assert logged["rewards/rm/mean"] == pytest.approx(sum(scores) / len(scores), rel=1e-5, abs=1e-6)


def test_chunks_loaded_objects_and_dtypes_score_alike(reward_models, monkeypatch):
    """Scoring in several passes gives what one pass gives; a loaded model (with or without its tokenizer)
    scores as its directory does; ``dtype`` casts the weights, and without it the checkpoint's own dtype
    is kept, as transformers 5's ``from_pretrained`` (TRL's default) loads it."""
    path = reward_models[0]
    whole = fastalign_rewards([path], PROMPTS, COMPLETIONS)
    monkeypatch.setattr("fastalign.train.reward_model.SCORING_CHUNK", 3)
    torch.testing.assert_close(fastalign_rewards([path], PROMPTS, COMPLETIONS), whole, rtol=1e-6, atol=1e-7)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    pair = (model, AutoTokenizer.from_pretrained(path))
    for spec in (model, pair, [pair]):
        funcs = resolve_reward_funcs(spec)
        assert [func.name for func in funcs] == ["rm"]
        torch.testing.assert_close(fastalign_rewards(funcs, PROMPTS, COMPLETIONS), whole)
    [func] = resolve_reward_funcs([path], dtype="bfloat16")
    assert func.fn.model.dtype == torch.bfloat16
    assert func.fn.device == torch.device("cpu") and not func.fn.model.training


def test_a_checkpoints_own_dtype_is_kept_unless_dtype_says_otherwise(tmp_path):
    path = save_reward_model(tmp_path / "rm16", seed=3, dtype=torch.bfloat16)
    assert AutoModelForSequenceClassification.from_pretrained(path).dtype == torch.bfloat16
    for dtype, expected in [(None, torch.bfloat16), ("auto", torch.bfloat16), ("float32", torch.float32)]:
        [func] = resolve_reward_funcs([path], dtype=dtype)
        assert func.fn.model.dtype == expected


def test_a_hub_id_loads_from_the_hugging_face_cache(hub, reward_models):  # noqa: F811
    cache_tiny_model(hub, "fastalign-tests/tiny-rm", task="sequence_classification", seed=1)
    [func] = resolve_reward_funcs(["fastalign-tests/tiny-rm"])
    assert func.name == "tiny-rm"
    # the same weights and tokenizer as reward_models[0] (its template aside, unused by text prompts)
    torch.testing.assert_close(
        fastalign_rewards([func], PROMPTS, COMPLETIONS),
        fastalign_rewards(reward_models[:1], PROMPTS, COMPLETIONS),
    )


def one_line_error(specs) -> str:
    with pytest.raises(ValueError) as caught:
        resolve_reward_funcs(specs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_bad_reward_model_specs_are_one_line_errors_naming_the_spec(tmp_path, hub):  # noqa: F811
    empty = tmp_path / "empty"
    empty.mkdir()
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    two_labels = tmp_path / "two_labels"
    tiny_model("llama", task="sequence_classification", num_labels=2).save_pretrained(two_labels)
    causal = tmp_path / "causal"
    tiny_model("llama").save_pretrained(causal)
    cases = [
        (
            str(empty),
            rf"^reward_funcs: '{re.escape(str(empty))}': directory has no config.json \(no model\)$",
        ),
        (str(adapter), r"directory has no config.json \(a LoRA adapter: merge it into its base first"),
        (str(two_labels), rf"^reward_funcs: '{re.escape(str(two_labels))}' has num_labels=2; a reward model"),
        (str(causal), r"' is a LlamaForCausalLM, not a sequence-classification \(reward\) model"),
        (__file__, r"' is a file: a reward model is a directory, a reward function 'path/file.py:function'$"),
        ("./no/such/dir", r"^reward_funcs: './no/such/dir': no such model directory$"),
        ("fastalign-tests/no-such-rm", r"^reward_funcs 'fastalign-tests/no-such-rm' .*HF_HUB_OFFLINE is set"),
        (
            "nothing_like_it",
            r"unknown built-in reward .* a reward model is a directory or a Hub id 'org/name'$",
        ),
    ]
    for spec, pattern in cases:
        assert re.search(pattern, one_line_error([spec])), spec
    loaded = AutoModelForSequenceClassification.from_pretrained(two_labels)
    assert re.search(
        r"^reward_funcs: LlamaForSequenceClassification '.*two_labels' has num_labels=2",
        one_line_error(loaded),
    )
