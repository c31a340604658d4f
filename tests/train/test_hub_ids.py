"""Hugging Face Hub ids for models, reference models and data sets, fully offline: each test gets an
empty Hugging Face cache in its tmp_path, fills it in the hub cache layout every Hugging Face tool
shares (``<repo type>s--ORG--NAME/snapshots/<commit>/…`` and ``refs/<branch>`` holding the commit) and
sets ``HF_HUB_OFFLINE``, so the loaders must find everything there and download nothing.

huggingface_hub and datasets read ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_DATASETS_CACHE`` and
``HF_HUB_OFFLINE`` into module constants when imported, long before a test runs: the ``hub`` fixture sets
the environment (for anything that reads it later) and patches those constants.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastalign.builtin import tiny_model, tiny_sft_rows, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.train.config import ConfigError, TrainConfig, load_config
from fastalign.train.distributed import DistributedContext
from fastalign.train.loading import (
    load_dataset_rows,
    load_model_and_tokenizer,
    materialize_model,
    resolve_model,
)
from fastalign.train.policy import load_frozen_model
from fastalign.train.run import run_training
from tests.real.model import HUB_ID

CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
MODEL_ID = "fastalign-tests/tiny-llama"
DATA_ID = "fastalign-tests/tiny-sft"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face cache under tmp_path; returns the hub cache directory."""
    home = tmp_path / "hf"
    cache = home / "hub"
    for name, value in (
        ("HF_HOME", home),
        ("HF_HUB_CACHE", cache),
        ("HF_DATASETS_CACHE", home / "datasets"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_CACHE_HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    return cache


def snapshot_dir(
    cache: Path, repo_id: str, *, repo_type: str = "model", tag: str = "", ref: str = "main"
) -> Path:
    """A new snapshot folder of ``repo_id`` (commit: a hash of ``tag``), named by ``refs/<ref>``."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{tag}".encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


def cache_tiny_model(cache: Path, repo_id: str = MODEL_ID, *, ref: str = "main", **model_options) -> Path:
    snapshot = snapshot_dir(cache, repo_id, tag=repr(sorted(model_options.items())), ref=ref)
    tiny_model("llama", **model_options).save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    return snapshot


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def cache_tiny_dataset(cache: Path, repo_id: str = DATA_ID, *, ref: str = "main", seed: int = 0) -> Path:
    """A dataset repo as the Hub has them: a card whose YAML declares two configurations, ``default``
    (train and test splits) and ``short`` (train only), of ``tiny_sft_rows(24, seed)``."""
    snapshot = snapshot_dir(cache, repo_id, repo_type="dataset", tag=str(seed), ref=ref)
    rows = tiny_sft_rows(24, seed)
    write_jsonl(snapshot / "default" / "train.jsonl", rows[:16])
    write_jsonl(snapshot / "default" / "test.jsonl", rows[16:])
    write_jsonl(snapshot / "short" / "train.jsonl", rows[:3])
    configs = [
        {
            "config_name": "default",
            "data_files": [
                {"split": "train", "path": "default/train.jsonl"},
                {"split": "test", "path": "default/test.jsonl"},
            ],
        },
        {"config_name": "short", "data_files": [{"split": "train", "path": "short/train.jsonl"}]},
    ]
    (snapshot / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n# tiny sft\n")
    return snapshot


def sft_config(tmp_path: Path, **overrides) -> TrainConfig:
    defaults = dict(
        model_name_or_path=MODEL_ID,
        dataset_name=DATA_ID,
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        max_length=64,
        loss_curve_png=False,
    )
    return TrainConfig(**{**defaults, **overrides})


def same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    got, want = model.state_dict(), reference.state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.real
def test_a_hub_id_loads_the_cached_real_model_as_from_pretrained(hub, smollm2):
    """SmolLM2-135M-Instruct under its Hub id: both loaders (whole, and the training path's meta skeleton
    filled from the snapshot's safetensors) give ``from_pretrained``'s weights, the head tied to the
    embeddings, and its tokenizer."""
    snapshot = snapshot_dir(hub, HUB_ID)
    for file in Path(smollm2).iterdir():  # the hub cache links snapshot files to blobs the same way
        (snapshot / file.name).symlink_to(file)
    assert resolve_model(HUB_ID) == snapshot
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)

    model, tokenizer = load_model_and_tokenizer(HUB_ID)
    assert same_weights(model, reference)
    skeleton, _ = load_model_and_tokenizer(HUB_ID, materialize=False)
    filled = materialize_model(skeleton, HUB_ID, None, torch.device("cpu"), seed=0)
    assert same_weights(filled, reference)
    for loaded in (model, filled):
        assert loaded.config.tie_word_embeddings
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    text = "The capital of France is Paris."
    assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(smollm2)(text).input_ids
    assert tokenizer.chat_template


def test_sft_trains_a_hub_model_on_a_hub_dataset_offline(hub, tmp_path):
    """``run_training`` from Hub ids alone: the model's snapshot, the dataset's train split, and its test
    split for evaluation (``eval_dataset_name`` naming the same dataset, TRL's evaluation)."""
    snapshot = cache_tiny_model(hub)
    cache_tiny_dataset(hub)
    config = sft_config(tmp_path, eval_dataset_name=DATA_ID, eval_strategy="steps")
    out = run_training(config, "sft")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval_loss" in r for r in records)
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert trained.config.num_hidden_layers == 2 and not same_weights(
        trained, AutoModelForCausalLM.from_pretrained(snapshot)
    )
    saved = load_config(
        out / "fastalign_config.yaml"
    )  # the names as given: merge_adapter resolves them again
    assert (saved.model_name_or_path, saved.dataset_name) == (MODEL_ID, DATA_ID)


def test_dataset_splits_configs_and_revisions_pick_rows(hub):
    cache_tiny_dataset(hub)
    v2 = cache_tiny_dataset(hub, ref="v2", seed=1)
    rows, rows_v2 = tiny_sft_rows(24), tiny_sft_rows(24, seed=1)
    assert rows != rows_v2
    assert load_dataset_rows(DATA_ID) == rows[:16]  # the train split of the default configuration
    assert load_dataset_rows(DATA_ID, "test") == rows[16:]
    assert load_dataset_rows(DATA_ID, "train", "short") == rows[:3]
    assert load_dataset_rows(DATA_ID, "train", "short", "v2") == rows_v2[:3]
    assert load_dataset_rows(DATA_ID, "test", None, v2.name) == rows_v2[16:]  # a commit hash
    with pytest.raises(ValueError) as error:
        load_dataset_rows(DATA_ID, "test", "short")
    assert "'test'" in one_line(error) and "dataset_config 'short'" in one_line(error)
    with pytest.raises(ValueError) as error:
        load_dataset_rows(DATA_ID, "train", "nope")
    assert "dataset_config 'nope'" in one_line(error)
    with pytest.raises(ValueError) as error:
        load_dataset_rows(DATA_ID, revision="v9")
    assert "dataset_revision 'v9'" in one_line(error) and "HF_HUB_OFFLINE is set" in one_line(error)


def test_model_revision_picks_the_snapshot(hub, tmp_path):
    """A branch, a tag or a commit hash, through ``resolve_model``, the loader and a training run (the
    snapshots differ in depth, so the exported model tells which one was trained)."""
    main_snapshot = cache_tiny_model(hub)
    deeper = cache_tiny_model(hub, ref="v2", num_hidden_layers=3)
    assert resolve_model(MODEL_ID) == main_snapshot
    assert resolve_model(MODEL_ID, "main") == main_snapshot
    assert resolve_model(MODEL_ID, "v2") == deeper
    assert resolve_model(MODEL_ID, deeper.name) == deeper  # the commit hash itself
    model, _ = load_model_and_tokenizer(MODEL_ID, revision=deeper.name)
    assert same_weights(model, AutoModelForCausalLM.from_pretrained(deeper))
    cache_tiny_dataset(hub)
    out = run_training(sft_config(tmp_path, model_revision="v2"), "sft")
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 3
    assert load_config(out / "fastalign_config.yaml").model_revision == "v2"


def test_a_reference_model_from_a_hub_id(hub):
    """``ref_model_name_or_path`` as a Hub id (read at main); the policy's own id at ``model_revision``."""
    main_snapshot = cache_tiny_model(hub)
    deeper = cache_tiny_model(hub, ref="v2", num_hidden_layers=3)
    config = TrainConfig(model_name_or_path=MODEL_ID, model_revision="v2", ref_model_name_or_path=MODEL_ID)
    frozen = load_frozen_model(MODEL_ID, config, CPU)
    assert same_weights(frozen, AutoModelForCausalLM.from_pretrained(deeper))
    other = TrainConfig(model_name_or_path="tiny-llama", ref_model_name_or_path=MODEL_ID)
    frozen = load_frozen_model(MODEL_ID, other, CPU)
    assert not any(p.requires_grad for p in frozen.parameters())
    assert same_weights(frozen, AutoModelForCausalLM.from_pretrained(main_snapshot))
    with pytest.raises(ValueError) as error:
        load_frozen_model("nobody/reference", TrainConfig(ref_model_name_or_path="nobody/reference"), CPU)
    assert one_line(error).startswith("ref_model_name_or_path 'nobody/reference' is not a local model")


def test_an_uncached_id_offline_fails_in_one_line_naming_it(hub, tmp_path, capsys):
    with pytest.raises(ValueError) as error:
        load_model_and_tokenizer("nobody/missing-model")
    message = one_line(error)
    assert message.startswith("model_name_or_path 'nobody/missing-model' is not a local model directory")
    assert str(hub) in message and "HF_HUB_OFFLINE is set" in message
    with pytest.raises(ValueError) as error:
        load_dataset_rows("nobody/missing-data", key="eval_dataset_name")
    assert one_line(error).startswith("eval_dataset_name 'nobody/missing-data' is not a local file")
    assert "HF_HUB_OFFLINE is set" in one_line(error)

    cache_tiny_model(hub)
    with pytest.raises(ValueError) as error:
        resolve_model(MODEL_ID, "v9")
    assert "model_revision 'v9'" in one_line(error) and "HF_HUB_OFFLINE is set" in one_line(error)
    # the CLI prints it as one line and exits 2, for the model and for the data set
    capsys.readouterr()  # what saving the cached model printed
    for flags in (
        ["--model_name_or_path", "nobody/missing-model"],
        ["--dataset_name", "nobody/missing-data"],
    ):
        assert main(["train", "sft", "--output_dir", str(tmp_path / "run"), *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and flags[1] in err and "HF_HUB_OFFLINE" in err, err


def test_a_repo_with_only_pickle_weights_is_refused_unread(hub):
    snapshot = snapshot_dir(hub, "fastalign-tests/pickled")
    tiny_model("llama").config.save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (snapshot / "pytorch_model.bin").write_bytes(b"not a pickle: never read")
    with pytest.raises(ValueError) as error:
        load_model_and_tokenizer("fastalign-tests/pickled", materialize=False)
    message = one_line(error)
    assert message.startswith("model_name_or_path 'fastalign-tests/pickled' has no safetensors weights")
    assert ".bin" in message


def test_local_paths_and_builtins_are_not_hub_ids(hub, tmp_path, monkeypatch):
    """A local directory wins over a Hub id of the same name (as in ``from_pretrained``); a built-in
    name stays built in; an absolute path that does not exist is never looked up on the Hub."""
    cache_tiny_model(hub)
    local = tmp_path / MODEL_ID
    tiny_model("llama", num_hidden_layers=1).save_pretrained(local)
    tiny_tokenizer().save_pretrained(local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(MODEL_ID) == Path(MODEL_ID)
    assert resolve_model("tiny-llama") == "tiny-llama"
    with pytest.raises(ValueError) as error:
        resolve_model(str(tmp_path / "nowhere"))
    assert "nor a Hugging Face Hub id" in one_line(error)
    with pytest.raises(ValueError) as error:
        resolve_model("tiny-llama", "v2")
    assert one_line(error).startswith("model_revision 'v2' picks a version of a Hub model")
    assert len(load_dataset_rows("tiny-sft")) > 0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"dataset_name": "tiny-sft", "dataset_train_split": "train_sft"}, "dataset_train_split"),
        ({"dataset_name": DATA_ID, "dataset_test_split": "validation"}, "dataset_test_split"),
        ({"dataset_name": "tiny-sft", "dataset_config": "short"}, "dataset_config"),
        (
            {
                "dataset_name": "tiny-sft",
                "eval_dataset_name": "tiny-sft",
                "eval_strategy": "steps",
                "dataset_revision": "v2",
            },
            "dataset_revision",
        ),
        ({"model_name_or_path": "tiny-llama", "model_revision": "v2"}, "model_revision"),
    ],
)
def test_a_hub_key_that_would_be_ignored_is_an_error(hub, tmp_path, overrides, key):
    """Options that pick within a Hub model or dataset, set where there is none to pick within (for
    ``dataset_test_split``: no ``eval_dataset_name``), fail in one line naming the key, before loading."""
    with pytest.raises(ValueError) as error:
        run_training(sft_config(tmp_path, **overrides), "sft")
    assert key in one_line(error).split(" picks ")[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"dataset_train_split": "validation"}, '"validation"'),
        (
            {"eval_dataset_name": DATA_ID, "eval_strategy": "steps", "dataset_test_split": "validation"},
            '"validation"',
        ),
        ({"dataset_config": "nope"}, "dataset_config 'nope'"),
        ({"dataset_revision": "v9"}, "dataset_revision 'v9'"),
    ],
)
def test_hub_dataset_keys_reach_the_loader(hub, tmp_path, overrides, named):
    """Each key is used by a training run: a split, configuration or revision the cached dataset lacks
    fails there, in one line naming it."""
    cache_tiny_model(hub)
    cache_tiny_dataset(hub)
    with pytest.raises(ValueError) as error:
        run_training(sft_config(tmp_path, **overrides), "sft")
    assert named in one_line(error)


@pytest.mark.parametrize(
    "key",
    ["model_revision", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_revision"],
)
def test_blank_hub_keys_are_config_errors(key):
    with pytest.raises(ConfigError, match=f"config key '{key}' .*must be a non-empty string"):
        load_config(overrides=[f"--{key}", " "])
