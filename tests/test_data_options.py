"""The data options of TRL's SFTConfig / GRPOConfig and transformers' TrainingArguments: dataset_text_field,
eos_token, pad_token, chat_template_path, chat_template_kwargs (and the rows' tools and
chat_template_kwargs columns), packing_strategy and neftune_noise_alpha. TRL is the oracle: its SFTTrainer's
prepared data set, its pack_dataset and transformers' NEFTune hook, on the same rows and tensors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fastalign.builtin import tiny_model, tiny_tokenizer
from fastalign.data import (
    pack_best_fit_decreasing,
    split_long_examples,
    tokenize_kto_dataset,
    tokenize_preference_dataset,
    tokenize_prompt_dataset,
    tokenize_sft_dataset,
    wrap_examples,
)
from fastalign.data.sft import TokenizedExample
from fastalign.data.tokenizer_options import override_tokenizer
from fastalign.train.batches import BatchPosition, MicroBatches
from fastalign.train.config import ConfigError, TrainConfig, check_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.neftune import enable_neftune, neftune_noise
from fastalign.train.objectives import make_objective
from fastalign.train.objectives.sft import SFTObjective, SFTOptions
from tests.helpers import require

CPU = DistributedContext(0, 1, 0, torch.device("cpu"))

#: A ChatML template that renders tools and an ``enable_thinking`` switch, as Qwen3-style templates do.
TOOLS_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<|im_start|>system\n/no_think<|im_end|>\n' }}{% endif %}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}{% for tool in tools %}{{ tool['name'] + ';' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = json.dumps([{"name": "add", "parameters": {}}, {"name": "times", "parameters": {}}])


def _labels(example: TokenizedExample) -> list[int]:
    return [token if keep else -100 for token, keep in zip(example.input_ids, example.loss_mask, strict=True)]


def _trl_prepared(rows: list[dict], tokenizer, tmp_path, **options) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row as TRL's SFTTrainer prepares its training set."""
    import datasets

    require("trl")
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], bf16=False, use_cpu=True, max_length=None, **options
    )
    trainer = SFTTrainer(
        model=tiny_model("llama"),
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    return [(row["input_ids"], row["labels"]) for row in trainer.train_dataset]


def _ours(rows: list[dict], tokenizer, **options) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row as ``fastalign train sft`` tokenizes it, after the tokenizer keys."""
    tokenizer_keys = {
        key: options.pop(key) for key in ("eos_token", "pad_token", "chat_template_path") if key in options
    }
    override_tokenizer(tokenizer, tiny_model("llama"), **tokenizer_keys)
    objective = SFTObjective(SFTOptions.from_config(TrainConfig(max_length=4096, **options)))
    return [(example.input_ids, _labels(example)) for example in objective.tokenize(rows, tokenizer)]


# --- TRL's prepared data set, row for row ----------------------------------------------------------------


def _template_file(tmp_path) -> str:
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return str(path)


def _option_cases(tmp_path) -> list[tuple[list[dict], dict]]:
    template = _template_file(tmp_path)
    conversation = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    return [
        # dataset_text_field and an eos_token override: EOS appended once, even after text ending with it
        (
            [{"content": "the model learns"}, {"content": "what is plus<|im_end|>"}],
            {"dataset_text_field": "content", "eos_token": "<|im_end|>"},
        ),
        # standard prompt-completion: the completion ends with the overriding EOS
        (
            [{"prompt": "What is 3 plus 4?", "completion": " The answer is 7."}],
            {"eos_token": "<|im_end|>", "pad_token": "<|im_start|>"},
        ),
        # conversational rows through a .jinja chat_template_path, with per-row tools and template kwargs
        (
            [
                {
                    "messages": conversation,
                    "tools": TOOLS,
                    "chat_template_kwargs": {"enable_thinking": False},
                },
                {"messages": conversation, "tools": None, "chat_template_kwargs": {"enable_thinking": True}},
            ],
            {"chat_template_path": template},
        ),
        (
            [
                {
                    "prompt": conversation[:1],
                    "completion": conversation[1:],
                    "tools": TOOLS,
                    "chat_template_kwargs": {"enable_thinking": False},
                }
            ],
            {"chat_template_path": template},
        ),
    ]


@pytest.mark.parametrize("case", range(4))
def test_tokenized_rows_equal_trls(tmp_path, case):
    rows, options = _option_cases(tmp_path)[case]
    assert _ours(rows, tiny_tokenizer(), **dict(options)) == _trl_prepared(
        rows, tiny_tokenizer(), tmp_path, **options
    )


@pytest.mark.real
def test_tokenized_rows_equal_trls_with_the_real_tokenizer(smollm2, tmp_path):
    from transformers import AutoTokenizer

    for rows, options in _option_cases(tmp_path):
        ours = _ours(rows, AutoTokenizer.from_pretrained(smollm2), **dict(options))
        assert ours == _trl_prepared(rows, AutoTokenizer.from_pretrained(smollm2), tmp_path, **options)


def test_template_arguments_reach_the_rendering(tmp_path):
    tokenizer = tiny_tokenizer()
    override_tokenizer(tokenizer, tiny_model("llama"), chat_template_path=_template_file(tmp_path))
    row = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "tools": TOOLS,
    }
    (example,) = tokenize_sft_dataset([row], tokenizer, chat_template_kwargs={"enable_thinking": False})
    text = tokenizer.decode(example.input_ids)
    assert text.startswith("<|im_start|>system\n/no_think<|im_end|>\n<|im_start|>system\nTools: add;times;")
    # the row's own chat_template_kwargs win over the config's
    prompt = {"prompt": row["messages"][:1], "chat_template_kwargs": {"enable_thinking": True}}
    (config_only,) = tokenize_prompt_dataset(
        [{"prompt": row["messages"][:1]}], tokenizer, chat_template_kwargs={"enable_thinking": False}
    )
    (row_wins,) = tokenize_prompt_dataset(
        [prompt], tokenizer, chat_template_kwargs={"enable_thinking": False}
    )
    assert tokenizer.decode(config_only.prompt_ids).startswith("<|im_start|>system\n/no_think<|im_end|>")
    assert tokenizer.decode(row_wins.prompt_ids).startswith("<|im_start|>user\nhi")
    # the preference and unpaired formats render their prompts the same way
    pair = {"prompt": row["messages"][:1], "chosen": row["messages"][1:], "rejected": row["messages"][1:]}
    (preference,) = tokenize_preference_dataset(
        [pair], tokenizer, chat_template_kwargs={"enable_thinking": False}
    )
    (unpaired,) = tokenize_kto_dataset(
        [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True}],
        tokenizer,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert preference.prompt_ids == unpaired.prompt_ids == config_only.prompt_ids


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("tools", "not json", "'tools' is text but not JSON"),
        ("tools", 3, "'tools' must be a list"),
        ("chat_template_kwargs", "x", "'chat_template_kwargs' must be a mapping"),
    ],
)
def test_bad_template_columns_name_the_row(column, value, message):
    row = {"messages": [{"role": "user", "content": "hi"}], column: value}
    with pytest.raises(ValueError, match=f"row 0: {message}"):
        tokenize_sft_dataset([row], tiny_tokenizer())


def test_template_kwargs_for_text_rows_are_refused():
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(ValueError, match=r"'chat_template_kwargs' .* rows are text"):
        tokenize_sft_dataset([{"text": "the model"}], tiny_tokenizer(), **kwargs)
    with pytest.raises(ValueError, match=r"'chat_template_kwargs' .* rows are text"):
        tokenize_prompt_dataset([{"prompt": "What is 1 plus 2?"}], tiny_tokenizer(), **kwargs)


def test_tool_call_messages_need_no_content():
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add"}}],
    }
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    tokenize_sft_dataset([{"messages": [{"role": "user", "content": "hi"}, call]}], tokenizer)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a message with a string 'content'"):
        tokenize_sft_dataset(
            [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}], tokenizer
        )


def test_dataset_text_field_names_the_missing_column():
    with pytest.raises(ValueError, match="SFT needs 'body' \\(dataset_text_field\\)"):
        tokenize_sft_dataset([{"text": "the model"}], tiny_tokenizer(), dataset_text_field="body")


# --- eos_token, pad_token, chat_template_path on the tokenizer and the model -----------------------------


def test_token_overrides_match_trl(tmp_path):
    ours_tokenizer, ours_model = tiny_tokenizer(), tiny_model("llama")
    override_tokenizer(ours_tokenizer, ours_model, eos_token="<|im_end|>", pad_token="<|bos|>")

    import datasets

    require("trl")
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path),
        report_to=[],
        bf16=False,
        use_cpu=True,
        eos_token="<|im_end|>",
        pad_token="<|bos|>",
    )
    trainer = SFTTrainer(
        model=tiny_model("llama"),
        args=args,
        processing_class=tiny_tokenizer(),
        train_dataset=datasets.Dataset.from_list([{"text": "the model"}]),
    )
    theirs = trainer.model
    assert (ours_tokenizer.eos_token_id, ours_tokenizer.pad_token_id) == (
        trainer.processing_class.eos_token_id,
        trainer.processing_class.pad_token_id,
    )
    for attribute in ("eos_token_id", "pad_token_id"):
        assert getattr(ours_model.config, attribute) == getattr(theirs.config, attribute)
        assert getattr(ours_model.generation_config, attribute) == getattr(
            theirs.generation_config, attribute
        )
    assert ours_model.generation_config.eos_token_id[0] == ours_tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("key", ["eos_token", "pad_token"])
def test_a_token_outside_the_vocabulary_is_refused(key):
    with pytest.raises(ValueError, match=f"config key '{key}' \\('<\\|nope\\|>'\\) is not a token"):
        override_tokenizer(tiny_tokenizer(), tiny_model("llama"), **{key: "<|nope|>"})


def test_chat_template_from_a_tokenizer_directory_matches_trls_clone(tmp_path):
    require("trl")
    from trl import clone_chat_template

    source = tiny_tokenizer()
    source.chat_template, source.eos_token = TOOLS_TEMPLATE, "<|im_end|>"
    source.save_pretrained(tmp_path / "source")
    ours_tokenizer, ours_model = tiny_tokenizer(), tiny_model("llama")
    override_tokenizer(ours_tokenizer, ours_model, chat_template_path=str(tmp_path / "source"))
    theirs_model, theirs_tokenizer, added = clone_chat_template(
        tiny_model("llama"), tiny_tokenizer(), str(tmp_path / "source")
    )
    assert added == []
    assert ours_tokenizer.chat_template == theirs_tokenizer.chat_template == TOOLS_TEMPLATE
    assert ours_tokenizer.eos_token_id == theirs_tokenizer.eos_token_id
    assert ours_model.config.eos_token_id == theirs_model.config.eos_token_id
    assert ours_model.generation_config.eos_token_id == theirs_model.generation_config.eos_token_id
    # an explicit eos_token wins over the directory's
    tokenizer = tiny_tokenizer()
    override_tokenizer(
        tokenizer, tiny_model("llama"), eos_token="<|bos|>", chat_template_path=str(tmp_path / "source")
    )
    assert tokenizer.eos_token == "<|bos|>"


def test_chat_template_path_problems_name_the_key(tmp_path):
    source = tiny_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|think|>"]})
    source.save_pretrained(tmp_path / "more")
    (tmp_path / "template.txt").write_text("{{ messages }}")
    for path, message in [
        (
            tmp_path / "more",
            "its tokenizer has 1 token\\(s\\) the model's tokenizer lacks \\('<\\|think\\|>'\\)",
        ),
        (tmp_path / "template.txt", "is a file but not a chat template"),
        (tmp_path / "missing", "neither a .jinja/.j2 file nor a local tokenizer directory"),
    ]:
        with pytest.raises(ValueError, match=f"config key 'chat_template_path' .*{message}"):
            override_tokenizer(tiny_tokenizer(), tiny_model("llama"), chat_template_path=str(path))


# --- packing_strategy --------------------------------------------------------------------------------------


def _random_examples(seed: int, count: int, longest: int) -> list[TokenizedExample]:
    rng = random.Random(seed)
    examples, token = [], 0
    for _ in range(count):
        length = rng.randrange(1, longest + 1)
        examples.append(
            TokenizedExample(list(range(token, token + length)), [rng.randrange(2) for _ in range(length)])
        )
        token += length
    return examples


def _trl_packed(examples: list[TokenizedExample], max_length: int, strategy: str) -> list[dict]:
    import datasets

    require("trl")
    from trl.data_utils import pack_dataset

    table = datasets.Dataset.from_dict(
        {"input_ids": [e.input_ids for e in examples], "labels": [_labels(e) for e in examples]}
    )
    return list(pack_dataset(table, max_length, strategy))


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_best_fit_decreasing_bins_equal_trls(strategy):
    for seed in range(12):
        max_length = random.Random(seed).randrange(4, 40)
        examples = _random_examples(seed, 40, max_length * (2 if strategy == "bfd_split" else 1))
        pieces = split_long_examples(examples, max_length) if strategy == "bfd_split" else examples
        bins = pack_best_fit_decreasing([len(e) for e in pieces], max_length)
        ours = [
            {
                "input_ids": [t for i in b for t in pieces[i].input_ids],
                "labels": [t for i in b for t in _labels(pieces[i])],
                "seq_lengths": [len(pieces[i]) for i in b],
            }
            for b in bins
        ]
        assert ours == _trl_packed(examples, max_length, strategy), seed


def test_wrapped_blocks_equal_trls():
    examples = _random_examples(0, 30, 25)
    blocks = wrap_examples(examples, 16)
    ours = [{"input_ids": b.input_ids, "labels": _labels(b)} for b in blocks]
    assert ours == _trl_packed(examples, 16, "wrapped")
    assert [len(b) for b in blocks[:-1]] == [16] * (len(blocks) - 1)


def test_packing_strategies_in_the_sft_objective():
    rows = [{"text": "the model learns to answer questions about numbers " * 3}] * 4
    tokenizer = tiny_tokenizer()

    def objective(**options) -> SFTObjective:
        return make_objective("sft", TrainConfig(max_length=16, packing=True, **options), CPU)

    wrapped = objective(packing_strategy="wrapped")
    blocks = wrapped.tokenize(rows, tokenizer)
    assert wrapped.packing_length is None  # blocks batch as padded rows, as TRL's wrapped (not padding-free)
    assert [len(b) for b in blocks[:-1]] == [16] * (len(blocks) - 1)
    batches = MicroBatches(blocks, batch_size=2, accumulation=1, pad_token_id=0, seed=0)
    (batch,) = batches.step_batches(BatchPosition())
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    split = objective(packing_strategy="bfd_split")
    assert split.packing_length == 16 and max(len(e) for e in split.tokenize(rows, tokenizer)) == 16
    with pytest.raises(ValueError, match="exceed max_length=16"):  # bfd keeps refusing over-long rows
        objective().tokenize(rows, tokenizer)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"packing_strategy": "wrapped"}, "'packing_strategy' \\('wrapped'\\) .* needs packing: true"),
        ({"packing": True, "packing_strategy": "wrapped", "truncation": True}, "'truncation' has no effect"),
    ],
)
def test_packing_strategy_combinations_that_cannot_work(options, message):
    with pytest.raises(ConfigError, match=message):
        make_objective("sft", TrainConfig(**options), CPU)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("packing_strategy", "first_fit"),
        ("neftune_noise_alpha", 0.0),
        ("eos_token", ""),
        ("dataset_text_field", " "),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check_config(TrainConfig(**{key: value}))


def test_sft_only_keys_are_refused_elsewhere():
    for key, value in (("dataset_text_field", "body"), ("packing_strategy", "wrapped")):
        with pytest.raises(ConfigError, match=f"config key '{key}' .* is for sft; dpo does not read it"):
            make_objective("dpo", TrainConfig(**{key: value}), CPU)


# --- neftune_noise_alpha ---------------------------------------------------------------------------------


def test_noise_is_transformers_neftune_bit_for_bit():
    from transformers.integrations.neftune import neftune_post_forward_hook

    embedding = torch.nn.Embedding(50, 24).train()
    embedding.neftune_noise_alpha = 5.0
    output = embedding(torch.randint(0, 50, (3, 11)))
    torch.manual_seed(7)
    theirs = neftune_post_forward_hook(embedding, None, output)
    torch.manual_seed(7)
    assert torch.equal(neftune_noise(output, 5.0), theirs)
    assert not torch.equal(theirs, output)


@pytest.mark.parametrize("use_peft", [False, True])
def test_neftune_only_in_training_mode(use_peft):
    model = tiny_model("llama")
    if use_peft:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
        )
    ids = torch.randint(3, 500, (2, 9))
    model.eval()
    clean = model(input_ids=ids).logits
    model.train()
    clean_train = model(
        input_ids=ids
    ).logits  # the tiny model has no dropout: train mode alone changes nothing
    handle = enable_neftune(model, 5.0)
    noisy = model(input_ids=ids).logits
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, clean)  # evaluation and generation run in eval mode
    assert torch.equal(clean, clean_train) and not torch.allclose(noisy, clean)
    handle.remove()
    model.train()
    assert torch.equal(model(input_ids=ids).logits, clean_train)
    assert enable_neftune(model, None) is None


# --- whole runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_wrapped_packing_step_equals_trl(tmp_path):
    """TRL's wrapped packing trains on padded max_length blocks with no position reset: one step of each
    on the same blocks (max_length chosen so the rows make as many blocks as one batch holds)."""
    require("trl")
    from trl import SFTConfig, SFTTrainer

    from fastalign.builtin import tiny_sft_rows
    from tests.parity.steps import fastalign_step, trl_step

    rows = tiny_sft_rows(8, seed=7)
    total = sum(len(e) for e in tokenize_sft_dataset(rows, tiny_tokenizer()))
    max_length = next(length for length in range(total // 8, total) if -(-total // length) == len(rows))
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    options = {"max_length": max_length, "packing": True, "packing_strategy": "wrapped"}
    ours = fastalign_step("sft", rows, tmp_path, model_name_or_path=str(model_dir), **options)
    theirs = trl_step(SFTTrainer, SFTConfig, rows, tmp_path, str(model_dir), **options)
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=2e-4, abs=2e-6), (key, ours[key], theirs[key])


@pytest.mark.slow
def test_a_run_with_every_data_option(tmp_path):
    """sft with neftune, an eos override, a template file with template kwargs, and wrapped packing; the
    noise changes the first step's loss (and nothing else does between the two runs), and the exported
    tokenizer is the one trained with."""
    from tests.parity.steps import fastalign_step

    conversation = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    rows = [{"messages": conversation, "tools": TOOLS}] * 8
    options = {
        "max_length": 32,
        "packing": True,
        "packing_strategy": "wrapped",
        "eos_token": "<|im_end|>",
        "chat_template_path": _template_file(tmp_path),
        "chat_template_kwargs": {"enable_thinking": False},
    }
    (tmp_path / "plain").mkdir()
    (tmp_path / "noisy").mkdir()
    plain = fastalign_step("sft", rows, tmp_path / "plain", **options)
    noisy = fastalign_step("sft", rows, tmp_path / "noisy", neftune_noise_alpha=5.0, **options)
    assert plain["loss"] != noisy["loss"] and abs(plain["loss"] - noisy["loss"]) < 0.5
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(tmp_path / "noisy" / "fastalign")  # the tokenizer trained with
    assert (exported.eos_token, exported.chat_template) == ("<|im_end|>", TOOLS_TEMPLATE)
