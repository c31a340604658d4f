"""Bad data files and model directories: each is one line naming the file and its 1-based line (or the
model directory), exit 2, and the earlier run in the output directory untouched; data values arrive as
written in the file (no type rewritten by inference), and a model without a tokenizer never trains."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.data import load_rows, tokenize_kto_dataset, tokenize_prompt_dataset, tokenize_sft_dataset
from fastalign.train.loading import load_dataset_rows, load_model_and_tokenizer
from tests.reliability.conftest import assert_one_line_error, snapshot

PAIR = {"prompt": "What is 3 plus 4?", "chosen": " 7", "rejected": " 8"}
UNPAIRED = {"prompt": "What is 3 plus 4?", "completion": " 7", "label": True}
TEXT = {"text": "the model learns to add"}


def jsonl(*rows: object) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def train_args(objective: str, data: Path | str, output_dir: Path, *extra: str) -> list[str]:
    online = objective in ("grpo", "rloo", "ppo")  # no max_length: prompt and completion lengths
    return [
        "train",
        objective,
        "--model_name_or_path",
        "tiny-llama",
        "--dataset_name",
        str(data),
        "--output_dir",
        str(output_dir),
        "--max_steps",
        "1",
        *([] if online else ["--max_length", "48"]),
        "--per_device_train_batch_size",
        "2",
        "--loss_curve_png",
        "false",
        *extra,
    ]


OVER_EARLIER = ("--overwrite_output_dir", "true")
GRPO_FLAGS = ("--reward_funcs", "exact_match", "--num_generations", "2", "--max_completion_length", "4")


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished tiny SFT run: every bad-input case below is told to overwrite it (``OVER_EARLIER``), and
    must fail before a file of it changes."""
    output_dir = tmp_path_factory.mktemp("earlier") / "run"
    assert main(train_args("sft", "tiny-sft", output_dir)) == 0
    return output_dir


# --- bad data files: (objective, files to write → the dataset_name, culprit) -----------------------------


def files(contents: dict[str, str | bytes]) -> Callable[[Path], Path]:
    """Writes each file (relative path → contents) under tmp_path; the data set is the single file, or
    the directory when there are several."""

    def write(root: Path) -> Path:
        written = []
        for name, content in contents.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
            written.append(path)
        return written[0] if len(written) == 1 else written[0].parent

    return write


def corrupt_parquet(root: Path) -> Path:
    path = root / "train.parquet"
    pq.write_table(pa.table({"text": [TEXT["text"]] * 4}), path)
    path.write_bytes(path.read_bytes()[:-12])  # the footer cut off, as by a full disk
    return path


def string_labels_parquet(root: Path) -> Path:
    path = root / "kto.parquet"
    pq.write_table(
        pa.table({"prompt": ["a", "b"], "completion": [" c", " d"], "label": ["true", "false"]}), path
    )
    return path


CASES = {
    # SFT
    "sft-malformed-line": (
        "sft",
        files({"train.jsonl": jsonl(TEXT) + "\n" + '{"text": "cut off\n'}),
        "train.jsonl line 3: malformed JSON",
    ),
    "sft-empty-file": ("sft", files({"empty.jsonl": ""}), "empty.jsonl is empty"),
    "sft-only-blank-lines": (
        "sft",
        files({"blank.jsonl": "\n  \n\t\r\n"}),
        "blank.jsonl holds only blank lines",
    ),
    "sft-line-is-a-string": (
        "sft",
        files({"train.jsonl": jsonl(TEXT, "the model learns")}),
        "train.jsonl line 2 is a JSON string",
    ),
    "sft-line-is-an-array": (
        "sft",
        files({"train.jsonl": jsonl([TEXT], TEXT)}),
        "train.jsonl line 1 is a JSON array",
    ),
    "sft-invalid-utf8": (
        "sft",
        files({"train.jsonl": b'{"text": "a"}\n{"text": "caf\xe9"}\n'}),
        "train.jsonl line 2: not UTF-8",
    ),
    "sft-corrupt-parquet": ("sft", corrupt_parquet, "train.parquet is not a readable Parquet file"),
    "sft-number-in-text-column": (  # the error said "row 1", no file, no line
        "sft",
        files({"train.jsonl": jsonl(TEXT) + "\n" + jsonl({"text": 12})}),
        "train.jsonl line 3: 'text' must be text",
    ),
    "sft-duplicate-key": (
        "sft",
        files({"train.jsonl": '{"text": "a", "text": "b"}\n'}),
        "train.jsonl line 1: the key 'text' appears twice",
    ),
    "sft-directory-mixing-sft-and-preference": (
        "sft",
        files({"data/a.jsonl": jsonl(TEXT), "data/b.jsonl": jsonl(PAIR)}),
        "a.jsonl holds language modeling (text) rows but b.jsonl preference (chosen/rejected) rows",
    ),
    # preference
    "dpo-row-without-rejected": (
        "dpo",
        files({"pairs.jsonl": jsonl(PAIR, {"prompt": "a", "chosen": " b"})}),
        "pairs.jsonl line 2: missing 'rejected'",
    ),
    "dpo-json-array-item-is-a-string": (
        "dpo",
        files({"pairs.json": "[\n  " + json.dumps(PAIR) + ',\n  "oops"\n]\n'}),
        "pairs.json line 3 is a JSON string",
    ),
    "dpo-malformed-json-array": (
        "dpo",
        files({"pairs.json": "[\n  " + json.dumps(PAIR) + ',\n  {"prompt": "a" "chosen": " b"}\n]\n'}),
        "pairs.json line 3: malformed JSON",
    ),
    "dpo-directory-mixing-preference-and-kto": (
        "dpo",
        files({"data/a.jsonl": jsonl(PAIR), "data/b.jsonl": jsonl(UNPAIRED)}),
        "a.jsonl holds preference (chosen/rejected) rows but b.jsonl unpaired preference",
    ),
    # KTO
    "kto-string-label-in-bool-column": (  # datasets turned "true" into True, and the run trained on it
        "kto",
        files({"kto.jsonl": jsonl(UNPAIRED, {**UNPAIRED, "label": "true"})}),
        "kto.jsonl line 2: 'label' must be a bool",
    ),
    "kto-string-labels-in-parquet": (
        "kto",
        string_labels_parquet,
        "kto.parquet row 0: 'label' must be a bool",
    ),
    "kto-empty-shard-in-directory": (  # datasets skipped the empty file without a word
        "kto",
        files({"data/a.jsonl": jsonl(UNPAIRED, UNPAIRED), "data/b.jsonl": ""}),
        "b.jsonl is empty",
    ),
    # GRPO prompts
    "grpo-nan-in-a-column": (  # datasets turned NaN into None, and the "1" of line 1 into 1
        "grpo",
        files({"prompts.jsonl": '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": NaN}\n'}),
        "prompts.jsonl line 2: NaN is not JSON",
    ),
    "grpo-line-is-a-number": (
        "grpo",
        files({"prompts.jsonl": "7\n"}),
        "prompts.jsonl line 1 is a JSON number",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_data_file_is_one_line_naming_file_and_line(case, bad_input, earlier_run, tmp_path):
    objective, write, culprit = CASES[case]
    data = write(tmp_path)
    before = snapshot(earlier_run)
    extra = GRPO_FLAGS if objective == "grpo" else ()
    bad_input(*train_args(objective, data, earlier_run, *OVER_EARLIER, *extra), culprit=culprit)
    assert snapshot(earlier_run) == before


# --- values arrive as written ------------------------------------------------------------------------------

ANSWERS = {"a": 9, "b": "9", "c": "null", "d": "[1, 2]", "e": "true", "f": None}
RECORDED: list[tuple[str, object]] = []


def record_answers(prompts, completions, completion_ids, answer, **columns):
    RECORDED.extend(zip(prompts, answer, strict=True))
    return [0.0] * len(completions)


def test_prompt_columns_reach_reward_functions_as_written(tmp_path):
    """A mixed-type column: datasets made the strings "9", "null", "[1, 2]", "true" into 9, None, a list
    and True before the reward functions saw them; a row without the column gets None."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        jsonl(
            *(
                {"prompt": prompt, "answer": answer}
                for prompt, answer in ANSWERS.items()
                if answer is not None
            )
        )
        + jsonl({"prompt": "f"})
    )
    examples = tokenize_prompt_dataset(load_dataset_rows(str(data)), tiny_tokenizer())
    assert [example.columns["answer"] for example in examples] == list(ANSWERS.values())
    assert [type(example.columns["answer"]) for example in examples] == [type(v) for v in ANSWERS.values()]
    RECORDED.clear()
    flags = (
        "--reward_funcs",
        f"{__name__}:record_answers",
        "--num_generations",
        "2",
        "--max_completion_length",
        "2",
    )
    assert (
        main(train_args("grpo", data, tmp_path / "run", *flags, "--per_device_train_batch_size", "12")) == 0
    )
    assert {prompt for prompt, _ in RECORDED} == set(ANSWERS)  # one micro-batch of all six prompts
    assert all(
        answer == ANSWERS[prompt] and type(answer) is type(ANSWERS[prompt]) for prompt, answer in RECORDED
    ), RECORDED


def test_rows_keep_their_file_and_line_and_lists_their_index(tmp_path):
    """Errors name a file's row by its 1-based line; an in-memory list's (and a Hub dataset's) row by its
    0-based index, as ``rows[i]`` is written."""
    path = tmp_path / "kto.jsonl"
    path.write_text(jsonl(UNPAIRED) + "\n" + jsonl({**UNPAIRED, "label": "false"}))
    rows = load_rows(path)
    assert rows[1]["label"] == "false" and rows.origins == [f"{path} line 1", f"{path} line 3"]
    with pytest.raises(ValueError) as error:
        tokenize_kto_dataset(rows, tiny_tokenizer())
    assert_one_line_error(
        error.value, "kto.jsonl line 3: 'label' must be a bool (True: desirable), got 'false'"
    )
    with pytest.raises(ValueError) as error:
        tokenize_sft_dataset([TEXT, {"text": 12}], tiny_tokenizer())
    assert_one_line_error(error.value, "row 1: 'text' must be text, got int")


# --- model directories without a usable tokenizer -----------------------------------------------------------


def model_dir(root: Path, family: str = "qwen2") -> Path:
    """A tiny model's saved weights and config, and no tokenizer (for qwen2 transformers then built a
    one-token tokenizer: every text became EOS, the loss 0.0, and the run 'succeeded')."""
    directory = root / f"tiny-{family}"
    tiny_model(family).save_pretrained(directory)
    return directory


def truncated_tokenizer(directory: Path) -> None:
    tiny_tokenizer().save_pretrained(directory)
    tokenizer_json = directory / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text()[:5000])


@pytest.mark.parametrize(
    ("family", "damage", "culprit"),
    [
        ("qwen2", None, "has no tokenizer files"),  # was: a one-token tokenizer, loss 0.0, exit 0
        ("llama", None, "has no tokenizer files"),  # was: transformers' 5-line ValueError
        ("llama", truncated_tokenizer, "(tokenizer.json) cannot be loaded"),
    ],
    ids=["qwen2-no-tokenizer", "llama-no-tokenizer", "truncated-tokenizer-json"],
)
def test_a_model_directory_without_a_usable_tokenizer_is_refused(
    family, damage, culprit, bad_input, earlier_run, tmp_path
):
    directory = model_dir(tmp_path, family)
    if damage is not None:
        damage(directory)
    before = snapshot(earlier_run)
    args = train_args("sft", "tiny-sft", earlier_run, *OVER_EARLIER)
    args[args.index("tiny-llama")] = str(directory)
    outcome = bad_input(*args, culprit=culprit)
    assert str(directory) in outcome.message
    assert snapshot(earlier_run) == before


def test_a_tokenizer_with_an_empty_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    directory = model_dir(tmp_path, "llama")
    empty = Tokenizer(models.BPE(unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=empty, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        directory
    )
    with pytest.raises(ValueError) as error:
        load_model_and_tokenizer(str(directory))
    assert_one_line_error(
        error.value, f"the tokenizer in model directory {directory} (tokenizer.json) is empty"
    )
    shutil.rmtree(directory)
