"""A causal LM whose model type fastalign's kernels are not patched into (GPT-2: its decoder body is
``transformer``, its MLP not gated) trains with ``use_liger_kernel: false``: its own layers, and the fused
loss head found by the head's structure and proven equal on its weights. Before, ``use_liger_kernel:
false`` still refused the model type, pointing at ``patch_model(generic=True)``, which no config key
reaches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from fastalign.builtin import tiny_tokenizer
from fastalign.cli.main import main
from tests.reliability.conftest import bad_input  # noqa: F401 (a fixture)

STEPS = (
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "2",
    "--max_length",
    "48",
    "--logging_steps",
    "1",
)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    tokenizer = tiny_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def losses(output_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_an_unsupported_model_type_trains_with_its_own_layers(gpt2, tmp_path, objective):
    out = tmp_path / objective
    flags = ("--model_name_or_path", str(gpt2), "--use_liger_kernel", "false", "--output_dir", str(out))
    assert main(["train", objective, *flags, *STEPS]) == 0
    assert len(losses(out)) == 2 and all(torch.isfinite(torch.tensor(losses(out))))
    assert (out / "model.safetensors").is_file()


def test_the_head_the_run_patches_gives_the_models_own_loss_and_gradients(gpt2):
    """What the run does to it (``policy._patch``): the fused head alone, found by the generic probe."""
    import copy

    import fastalign
    from fastalign.patching import patched_pieces

    original = GPT2LMHeadModel.from_pretrained(gpt2)
    patched = fastalign.patch_model(
        copy.deepcopy(original), rms_norm=False, rope=False, mlp=False, linear=False, generic=True
    )
    assert patched_pieces(patched) == {"loss": 1}
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    expected, got = original(input_ids=ids, labels=ids), patched(input_ids=ids, labels=ids)
    assert got.logits is None
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=0)
    expected.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(original.named_parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_kernels_on_it_are_refused_in_one_line(bad_input, gpt2, tmp_path):  # noqa: F811
    flags = ("--model_name_or_path", str(gpt2), "--output_dir", str(tmp_path / "run"), *STEPS)
    outcome = bad_input("train", "sft", *flags, culprit="use_liger_kernel: false")
    assert "gpt2" in outcome.message


def test_its_teacher_log_probs_are_scored_with_its_own_layers(gpt2, tmp_path):
    """``fastalign teacher-logprobs --use_liger_kernel false`` on it: before, the head-only patch refused
    the model type there, naming a Python-only option."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a b", "completion": " c d"}) + "\n")
    flags = ("--model_name_or_path", str(gpt2), "--use_liger_kernel", "false", "--top_k", "4")
    assert (
        main(["teacher-logprobs", *flags, "--dataset_name", str(rows), "--output_dir", str(tmp_path / "t")])
        == 0
    )
    assert any((tmp_path / "t").iterdir())
