"""The model and tokenizer a run trains, and its data: a local checkpoint directory or data files, a
built-in tiny model or data set, or a Hugging Face Hub id read through the Hugging Face cache."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from fastalign.builtin import BUILTIN_DATASETS, TINY_MODEL_TYPES, tiny_model, tiny_tokenizer
from fastalign.builtin.models import AUTO_CLASSES, ModelTask
from fastalign.errors import one_line
from fastalign.models.streaming import checkpoint_tensors, empty_model, fill_model
from fastalign.quant import QuantOptions, empty_4bit_model, fill_4bit_model, load_4bit_model, quantize_model

#: Built-in model names: ``tiny-<family>``, random weights, the offline tokenizer (no download).
BUILTIN_MODELS = tuple(f"tiny-{family}" for family in TINY_MODEL_TYPES)
#: The files of a Hub model that training reads: config, weights, tokenizer, chat template. Weights only
#: as safetensors: unpickling a ``.bin`` checkpoint can run arbitrary code, so none is ever fetched.
HUB_MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
]


def resolve_model(
    name_or_path: str | Path, revision: str | None = None, *, key: str = "model_name_or_path"
) -> Path | str:
    """Where a model's files are: a built-in name as it is, a local directory as its path, a Hub id
    ("org/name") as its snapshot directory in the Hugging Face cache at ``revision`` (``model_revision``:
    a branch, tag or commit; None: main).

    A Hub model is fetched as every Hugging Face tool fetches it (``snapshot_download``: once, into the
    shared cache, which ``HF_HOME`` / ``HF_HUB_CACHE`` place; with ``HF_HUB_OFFLINE=1`` only the cache is
    read), only ``HUB_MODEL_FILES``, so a repo without safetensors weights is an error rather than a pickle
    load. A local directory wins over a Hub id of the same name, as in ``from_pretrained``. Every failure
    is one line naming ``key`` and what was tried."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS or Path(name).exists() or not _is_repo_id(name):
        if revision is not None:  # it would be ignored: say so rather than train on something else
            raise ValueError(
                f"model_revision {revision!r} picks a version of a Hub model, but {key} {name!r} is not one"
            )
        if name in BUILTIN_MODELS:
            return name
        if not (Path(name) / "config.json").is_file():
            raise ValueError(
                f"{key} {name!r} is neither a local model directory (with a config.json), a built-in model "
                f"({', '.join(BUILTIN_MODELS)}) nor a Hugging Face Hub id (org/name)"
            )
        return Path(name)
    snapshot = _hub_snapshot(
        name,
        "model",
        revision,
        HUB_MODEL_FILES,
        key=key,
        revision_key="model_revision",
        tried="not a local model directory or a built-in model",
    )
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"{key} {name!r}: its Hub snapshot {snapshot} has no config.json")
    if not any(snapshot.glob("model*.safetensors")):
        raise ValueError(
            f"{key} {name!r} has no safetensors weights (model.safetensors or its shards) in {snapshot}: "
            "only safetensors checkpoints are loaded, never pickle .bin files (unpickling can run code)"
        )
    return snapshot


def load_model_and_tokenizer(
    name_or_path: str | Path,
    quantization: QuantOptions | None = None,
    device: torch.device | str = "cpu",
    *,
    materialize: bool = True,
    revision: str | None = None,
    task: ModelTask = "causal_lm",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """fp32 weights, transformers' default attention, ``use_cache`` off for training (a run's ``dtype``
    and ``attn_implementation`` are set on the result: ``fastalign.train.policy.set_model_options``).

    ``task`` sequence_classification loads a reward model, as TRL's ``RewardTrainer`` does: the
    checkpoint's body under transformers' ``AutoModelForSequenceClassification`` with ``num_labels=1``,
    whose ``score`` head (new for a causal LM checkpoint, whose ``lm_head`` is left out) transformers draws
    at random from the torch seed. Such a model is always loaded whole (``materialize`` is not
    honoured: the streaming fill knows no head that the checkpoint lacks), then quantized when asked
    (its ``score``, like the rest outside the decoder layers, in ``quantization.dtype``: fp32 unless bf16,
    as TRL casts QLoRA's trainable weights to bf16), and sharded afterwards.

    ``name_or_path`` is anything ``resolve_model`` resolves (a Hub id at ``revision``): a checkpoint is
    then read from the local directory it resolves to.
    With ``quantization`` the decoder layers' linear layers are 4-bit: a local checkpoint is loaded
    layer by layer straight onto ``device`` (``fastalign.quant.load_4bit_model``), so neither host nor
    device ever holds the full-precision model; the rest (frozen too) is in ``quantization.dtype``.
    ``materialize=False`` returns a local checkpoint (4-bit or not) as a meta-device skeleton instead,
    for ``materialize_model`` to fill after LoRA and sharding: each rank then only ever holds its shard
    (a model bigger than one GPU never has to fit on one)."""
    resolved = resolve_model(name_or_path, revision)
    if isinstance(resolved, str):  # a built-in model
        model, tokenizer = tiny_model(resolved.removeprefix("tiny-"), task=task), tiny_tokenizer()
        if quantization is not None:
            quantize_model(model.to(device), quantization).to(quantization.dtype)
    else:
        path = resolved
        tokenizer = _load_tokenizer(path)
        if task != "causal_lm":
            model = AUTO_CLASSES[task].from_pretrained(
                path, dtype=torch.float32, use_safetensors=True, num_labels=1
            )
            if quantization is not None:
                quantize_model(model.to(device), quantization).to(quantization.dtype)
        elif not materialize:
            config = AutoConfig.from_pretrained(path)
            model = (
                empty_model(config, torch.float32)
                if quantization is None
                else empty_4bit_model(config, quantization)
            )
        elif quantization is not None:
            model = load_4bit_model(path, quantization, device=device)
        else:
            model = AUTO_CLASSES[task].from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model, tokenizer


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's own tokenizer. Where its tokenizer_config.json names transformers 5's generic
    fast tokenizer (``TokenizersBackend``, what ``save_pretrained`` writes for one), that class is used:
    ``AutoTokenizer`` swaps it for the model type's class for some types (qwen2), which pre-tokenizes
    differently and adds tokens past the embedding (a saved run would reload with another tokenizer).

    A directory without a vocabulary is an error, never a stand-in: transformers builds an empty tokenizer
    for some model types (qwen2: one token, every text becomes EOS, and training runs on nothing). So the
    files must be there, and the tokenizer loaded from them must encode a probe text into ordinary tokens;
    each failure is one ValueError line naming the directory."""
    vocabularies = [
        name
        for pattern in _TOKENIZER_FILES
        for name in sorted(file.name for file in path.glob(pattern) if file.is_file())
    ]
    if not vocabularies:
        present = sorted(file.name for file in path.iterdir())
        shown = ", ".join(present[:8]) + (f", ... ({len(present)} files)" if len(present) > 8 else "")
        raise ValueError(
            f"model directory {path} has no tokenizer files: it needs tokenizer.json, or "
            "tokenizer_config.json with the vocabulary (tokenizer.model, vocab.json + merges.txt, "
            f"vocab.txt or *.tiktoken); it holds {shown or 'nothing'}"
        )
    config_file = path / "tokenizer_config.json"
    try:
        declared = (
            json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
        )
        if declared == "TokenizersBackend" and (path / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, AttributeError, KeyError) as error:
        raise ValueError(
            f"the tokenizer in model directory {path} ({', '.join(vocabularies)}) cannot be loaded: "
            f"{one_line(error)}"
        ) from None
    try:  # the tokenizers library raises a bare Exception for a vocabulary it cannot encode with
        probe = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as error:
        probe = f"an error ({one_line(error)})"
    if len(tokenizer) < 2 or isinstance(probe, str) or not set(probe) - set(tokenizer.all_special_ids):
        raise ValueError(
            f"the tokenizer in model directory {path} ({', '.join(vocabularies)}) is empty or broken: "
            f"{len(tokenizer)} tokens, and {_TOKENIZER_PROBE!r} encodes to {probe}, no ordinary token; "
            "its vocabulary files are missing or damaged"
        )
    return tokenizer


#: Files that hold a tokenizer's vocabulary (tokenizer_config.json alone holds none).
_TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")
_TOKENIZER_PROBE = "Hello world, the model learns."


def materialize_model(
    model: torch.nn.Module,
    name_or_path: str | Path,
    quantization: QuantOptions | None,
    device: torch.device,
    seed: int,
    *,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Fill a skeleton from ``load_model_and_tokenizer(..., materialize=False)`` (maybe LoRA-wrapped and
    sharded since) from its checkpoint (``resolve_model(name_or_path, revision)``: pass what the skeleton
    was loaded from, or the directory that resolved to): every rank reads (and quantizes) each layer and
    keeps its own shard, in ``dtype`` (with ``quantization``, its own ``dtype`` is the unquantized rest's).
    A model that is already materialized is returned as it is."""
    if not any(param.is_meta for param in model.parameters()):
        return model
    tensors = checkpoint_tensors(resolve_model(name_or_path, revision))
    source = f"checkpoint {name_or_path}"
    if quantization is None:
        return fill_model(model, tensors, dtype=dtype, device=device, source=source, seed=seed)
    return fill_4bit_model(model, tensors, quantization, device=device, source=source, seed=seed)


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter of ``model`` in ``dtype``, in place, as ``from_pretrained(dtype=...)``
    loads them: each Parameter keeps its identity (tied weights stay one), buffers (RoPE's frequencies)
    stay as the model computed them, and 4-bit bytes are no floats. Free on a meta-device skeleton."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config declares for its weights (``dtype``, or ``torch_dtype`` as older
    configs name it); fp32 where it declares none. An older transformers keeps ``torch_dtype`` as an
    attribute of its own; a newer one only as an alias of ``dtype`` that warns when read."""
    declared = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def is_hub_dataset(name_or_path: str) -> bool:
    """Whether ``load_dataset_rows`` reads ``name_or_path`` from the Hub: neither built-in nor a local
    path, and shaped like a Hub id ("org/name")."""
    return (
        name_or_path not in BUILTIN_DATASETS and not Path(name_or_path).exists() and _is_repo_id(name_or_path)
    )


def load_dataset_rows(
    name_or_path: str,
    split: str | None = None,
    config: str | None = None,
    revision: str | None = None,
    *,
    key: str = "dataset_name",
) -> list[dict]:
    """Rows of a built-in data set, of local JSONL/JSON/Parquet files (``fastalign.data``), or of a
    Hugging Face Hub dataset (``is_hub_dataset``): its ``split`` (None: train) of configuration
    ``config`` (None: the default) at ``revision`` (None: main), as TRL loads it. ``split``, ``config``
    and ``revision`` pick within a Hub dataset: for any other they would be ignored, so they are an
    error. Failures are one line naming ``key``."""
    if is_hub_dataset(name_or_path):
        return _hub_dataset_rows(name_or_path, split or "train", config, revision, key=key)
    if (split, config, revision) != (None, None, None):
        raise ValueError(
            f"a split, config or revision picks within a Hub dataset, but {key} {name_or_path!r} is not one"
        )
    if name_or_path in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name_or_path]()
    if not Path(name_or_path).exists():
        raise ValueError(
            f"{key} {name_or_path!r} is neither a local file or directory, a built-in data set "
            f"({', '.join(BUILTIN_DATASETS)}) nor a Hugging Face Hub dataset id (org/name)"
        )
    from fastalign.data import load_rows

    # ``Rows``: plain dicts as written in the files (JSON parsed as is, Parquet as its schema types it),
    # each row's file and line kept for the tokenizers' error messages.
    return load_rows(name_or_path)


def _hub_dataset_rows(
    repo_id: str, split: str, config: str | None, revision: str | None, *, key: str
) -> list[dict]:
    """``datasets.load_dataset(repo_id, config, split=split, revision=revision)`` as TRL calls it: from the
    Hub, or offline from what ``datasets`` prepared in its own cache (``HF_DATASETS_CACHE``) on an earlier
    load. When neither can be had (offline, or the Hub out of reach), a snapshot of the dataset repo in the
    Hugging Face hub cache (``hf download --repo-type dataset``) is read instead, as models are: offline,
    ``datasets`` alone never looks there."""
    import datasets

    tried = "not a local file or directory or a built-in data set"
    picked = ", ".join(
        f"{option} {value!r}"
        for option, value in (("split", split), ("dataset_config", config), ("dataset_revision", revision))
        if value is not None
    )
    try:
        rows = datasets.load_dataset(repo_id, config, split=split, revision=revision)
    except ConnectionError:  # offline or unreachable, and not in datasets' cache: try the hub cache
        rows = None
    except FileNotFoundError as error:  # no such dataset (or no access), or no data files in it
        raise ValueError(
            f"{key} {repo_id!r} is {tried}, nor a readable Hub dataset: {one_line(error)}"
        ) from None
    except ValueError as error:  # no such config or split
        raise ValueError(f"{key} {repo_id!r} ({picked}): {one_line(error)}") from None
    if rows is None:
        snapshot = _hub_snapshot(
            repo_id,
            "dataset",
            revision,
            None,
            key=key,
            revision_key="dataset_revision",
            tried=f"{tried}, nor in the datasets cache",
        )
        try:
            rows = datasets.load_dataset(str(snapshot), config, split=split)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(
                f"{key} {repo_id!r} ({picked}) in the Hugging Face cache ({snapshot}): {one_line(error)}"
            ) from None
    return list(rows)


def _hub_snapshot(
    repo_id: str,
    repo_type: str,
    revision: str | None,
    allow_patterns: list[str] | None,
    *,
    key: str,
    revision_key: str,
    tried: str,
) -> Path:
    """The snapshot directory of Hub repo ``repo_id`` at ``revision`` in the Hugging Face cache, with the
    files ``allow_patterns`` match (None: all) downloaded into it first unless ``HF_HUB_OFFLINE`` is set.
    huggingface_hub's errors, multi-line and naming no config key, become one ValueError line naming
    ``key`` (``revision_key`` for a revision the Hub does not have), saying what else was ``tried``."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f" at {revision_key} {revision!r}" if revision is not None else ""
    try:
        # local_files_only spelled out: huggingface_hub before 2 (1.33 at least) skips its cache lookup for
        # a commit-hash revision under HF_HUB_OFFLINE and lists the repo's files on the Hub, which fails
        return Path(
            snapshot_download(
                repo_id,
                repo_type=repo_type,
                revision=revision,
                allow_patterns=allow_patterns,
                local_files_only=constants.HF_HUB_OFFLINE,
            )
        )
    except RevisionNotFoundError:
        raise ValueError(
            f"{revision_key} {revision!r} is no branch, tag or commit of Hub {repo_type} {repo_id!r} ({key})"
        ) from None
    except LocalEntryNotFoundError as error:  # not in the cache, and the Hub not asked or not reached
        why = (
            "HF_HUB_OFFLINE is set, so nothing is downloaded"
            if constants.HF_HUB_OFFLINE
            else f"the Hub could not be reached ({type(error.__cause__ or error).__name__})"
        )
        raise ValueError(
            f"{key} {repo_id!r} is {tried}, and no snapshot of Hub {repo_type} {repo_id!r}{at} is in the "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); {why}"
        ) from None
    except RepositoryNotFoundError as error:  # also gated and private repos
        raise ValueError(
            f"{key} {repo_id!r} is {tried}, nor a Hub {repo_type} this machine may read "
            f"({type(error).__name__}: not found, private or gated; `hf auth login` for the latter)"
        ) from None
    except OSError as error:  # any other Hub or disk failure
        raise ValueError(
            f"{key} {repo_id!r}{at}: fetching it from the Hugging Face Hub failed: {one_line(error)}"
        ) from None


def _is_repo_id(name: str) -> bool:
    """Shaped like a Hub repo id: "name" or "org/name" (an absolute or ./ path never is)."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        return False
    return True
