"""A normal start says nothing a user cannot act on: no bitsandbytes (imported only for 4-bit weights or
an 8-bit optimizer: importing it takes seconds and, on some CPUs, logs a warning about a missing package),
no deprecation warnings from the libraries fastalign drives."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import pytest

from fastalign.quant.bitsandbytes_import import bitsandbytes_hidden
from fastalign.train.config import TrainConfig
from fastalign.train.policy import _trains_tied_embedding

_RUN = """
import json, sys, warnings
import fastalign
imported_by_fastalign = "bitsandbytes" in sys.modules
from fastalign.train.config import load_config
from fastalign.train.merge import merge_adapter
from fastalign.train.run import run_training
out = sys.argv[1]
flags = ["--max_steps", "1", "--use_peft", "true", "--output_dir", out, "--loss_curve_png", "false",
         "--per_device_train_batch_size", "2"]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run_training(load_config(None, flags), "sft")
    merge_adapter(out)
print(json.dumps({"by_import": imported_by_fastalign, "after": "bitsandbytes" in sys.modules,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


@pytest.mark.slow  # about 25 s on a 2-core CPU: a fresh process's imports, a LoRA step and a merge
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes installed")
def test_import_and_a_tiny_lora_train_and_merge_import_no_bitsandbytes_and_warn_nothing(tmp_path):
    """Before: peft imported bitsandbytes with every train and merge, and each LoRA run warned that
    ``is_gradient_checkpointing`` is deprecated (peft reads it), merge that ``torch_dtype`` is."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(tmp_path / "run")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"by_import": False, "after": False, "warnings": []}, result
    said = [line for line in done.stderr.splitlines() if "warn" in line.lower() or "deprecat" in line.lower()]
    assert said == [], said


_SCORE = """
import json, sys, warnings
from fastalign.train.config import load_config
from fastalign.train.teacher_logprobs import SCORING_KEYS, score_teacher
out = sys.argv[1]
with open(out + "-rows.jsonl", "w") as rows:
    rows.write(json.dumps({"prompt": "a", "completion": "b"}) + "\\n")
scoring = ["--dataset_name", out + "-rows.jsonl", "--output_dir", out, "--top_k", "4"]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    score_teacher(load_config(None, scoring, reads=SCORING_KEYS))
print(json.dumps({"after": "bitsandbytes" in sys.modules, "warnings": [str(w.message) for w in caught]}))
"""


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes installed")
def test_teacher_scoring_imports_no_bitsandbytes_and_warns_nothing(tmp_path):
    """Before: ``fastalign teacher-logprobs`` imported bitsandbytes, which on a CPU logs that a package
    of 4-bit kernels (``kernels``) is missing: nothing a user of a 16-bit teacher can act on."""
    done = subprocess.run(
        [sys.executable, "-c", _SCORE, str(tmp_path / "teacher")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"after": False, "warnings": []}
    said = [line for line in done.stderr.splitlines() if "warn" in line.lower() or "kernels" in line.lower()]
    assert said == [], said


def test_bitsandbytes_hidden_is_as_if_not_installed_and_restored(monkeypatch):
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    with bitsandbytes_hidden():
        assert importlib.util.find_spec("bitsandbytes") is None
        with pytest.raises(ImportError):
            import bitsandbytes  # noqa: F401
    assert "bitsandbytes" not in sys.modules
    with bitsandbytes_hidden(hidden=False):
        assert "bitsandbytes" not in sys.modules
    imported = types.ModuleType("bitsandbytes")
    monkeypatch.setitem(sys.modules, "bitsandbytes", imported)
    with bitsandbytes_hidden():  # imported already: left as it is
        assert sys.modules["bitsandbytes"] is imported


@pytest.mark.parametrize(
    ("tied", "options", "asked"),
    [
        (True, {}, False),  # all-linear: the head and embedding stay frozen, nothing to tie (peft warned)
        (True, {"lora_modules_to_save": ["lm_head"]}, True),
        (True, {"lora_target_modules": ["q_proj", "embed_tokens"]}, True),
        (False, {"lora_modules_to_save": ["lm_head"]}, False),
    ],
)
def test_weight_tying_is_asked_of_peft_only_when_a_tied_module_trains(tied, options, asked):
    model = types.SimpleNamespace(config=types.SimpleNamespace(tie_word_embeddings=tied))
    assert _trains_tied_embedding(model, TrainConfig(use_peft=True, **options)) is asked
