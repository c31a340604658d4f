"""``fastalign train reward`` end to end on a tiny model: a reward model loaded from a causal-LM checkpoint
(its body, a new score head), full and LoRA (the head trains in full, saved with the adapter) and QLoRA
runs that export what transformers and peft load back, exact resume, the same run in 1 and 2 processes
(FSDP2), the body's kernels patched, and the errors that name the key or row."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import peft
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification

from fastalign.builtin import tiny_model, tiny_preference_rows, tiny_tokenizer
from fastalign.data.reward import RewardCollator, tokenize_reward_dataset
from fastalign.patching.patch import patched_pieces
from fastalign.train.config import ConfigError, TrainConfig
from fastalign.train.distributed import DistributedContext
from fastalign.train.engine import Callback
from fastalign.train.loading import load_model_and_tokenizer
from fastalign.train.objectives import make_objective
from fastalign.train.policy import prepare_policy
from fastalign.train.run import run_training
from tests import torchrun

WORKER = Path(__file__).with_name("train_worker.py")
CPU = DistributedContext(0, 1, 0, torch.device("cpu"))


def config(output_dir: Path, **overrides) -> TrainConfig:
    options = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        loss_curve_png=False,
    )
    return TrainConfig(**{**options, **overrides})


def logged(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def scores(model, rows: list[dict]) -> torch.Tensor:
    tokenizer = tiny_tokenizer()
    batch = RewardCollator(tokenizer.pad_token_id)(tokenize_reward_dataset(rows, tokenizer, max_length=None))
    with torch.no_grad():
        return model(**batch).logits.squeeze(-1)


def test_a_causal_lm_checkpoint_loads_as_its_body_under_a_new_score_head(tmp_path):
    causal = tiny_model("llama")
    causal.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tmp_path, task="sequence_classification")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.score.weight.shape == (1, causal.config.hidden_size) and model.score.weight.abs().sum() > 0
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, causal.model.layers[0].mlp.up_proj.weight)
    torch.manual_seed(0)  # the head is drawn from the torch seed: the same seed, the same head
    again, _ = load_model_and_tokenizer(tmp_path, task="sequence_classification")
    assert torch.equal(again.score.weight, model.score.weight)


def test_kernels_patch_the_body_of_a_reward_model():
    """No LM head to fuse; the body's RMSNorm, RoPE, gated MLP and linear layers are patched all the
    same (the score head is the model's own), and no score changes."""
    model = tiny_model("llama", task="sequence_classification")
    rows = tiny_preference_rows(4, seed=1)
    expected = scores(model, rows)
    cfg = with_defaults(TrainConfig(use_liger_kernel=True))
    model = prepare_policy(model, cfg, CPU, needs_fused_head=False, task="sequence_classification")
    assert patched_pieces(model) == {"rms_norm": 5, "rope": 2, "mlp": 2, "linear": 14}
    torch.testing.assert_close(scores(model, rows), expected, rtol=1e-4, atol=1e-5)


def with_defaults(cfg: TrainConfig) -> TrainConfig:
    from fastalign.train.objectives import with_objective_defaults

    return with_objective_defaults("reward", cfg)


def test_a_full_run_learns_and_exports_a_sequence_classifier(tmp_path):
    rows = tiny_preference_rows(8, seed=0)
    output = run_training(config(tmp_path, max_steps=6, learning_rate=1e-3), "reward")
    logs = logged(output)
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= set(logs[0])
    model = AutoModelForSequenceClassification.from_pretrained(output)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tiny_tokenizer().pad_token_id
    chosen, rejected = scores(model, rows).chunk(2)
    assert (chosen > rejected).float().mean() >= logs[0]["accuracy"]


def test_lora_trains_the_score_head_in_full_and_saves_it_with_the_adapter(tmp_path):
    options = dict(use_peft=True, lora_r=4, lora_dropout=0.0, max_steps=3, learning_rate=1e-2)
    output = run_training(config(tmp_path, **options), "reward")
    with safe_open(str(output / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
        head = next(saved.get_tensor(key) for key in keys if "score" in key)
    assert any("lora_A" in key for key in keys)
    initial = tiny_model("llama", task="sequence_classification")
    assert head.shape == initial.score.weight.shape and not torch.equal(head, initial.score.weight)
    assert json.loads((output / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    # the adapter loads back onto the base as peft loads any: the trained head included
    loaded = peft.PeftModel.from_pretrained(initial, output)
    assert torch.equal(loaded.base_model.model.score.modules_to_save["default"].weight, head)


def test_qlora_trains_a_reward_model(tmp_path):
    options = dict(use_peft=True, quantization="nf4", lora_r=4, lora_dropout=0.0, learning_rate=1e-2)
    output = run_training(config(tmp_path, **options), "reward")
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in logged(output))
    assert (output / "adapter_model.safetensors").is_file()


class _Crash(Callback):
    def on_step_end(self, engine, metrics):
        if engine.state.step == 3:
            raise KeyboardInterrupt


def test_a_killed_run_resumes_exactly(tmp_path):
    options = dict(max_steps=4, save_steps=2, per_device_train_batch_size=4, center_rewards_coefficient=0.1)
    run_training(config(tmp_path / "a", **options), "reward")
    cfg = config(tmp_path / "b", **options)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "reward", callbacks=[_Crash()])
    cfg.resume_from_checkpoint = "latest"
    run_training(cfg, "reward")
    expected = {row["step"]: row for row in logged(tmp_path / "a")}
    got = {row["step"]: row for row in logged(tmp_path / "b")}
    for step in (3, 4):
        for key in ("loss", "accuracy", "margin", "min_reward", "max_reward"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path):
    """2 ranks × 4 pairs (gloo, FSDP2: the score head in the root unit) = one process with 8: the same
    loss, gradient norm and metrics, the extremes taken over both ranks' scores; full and LoRA."""
    runs = {"full": {}, "lora": {"use_peft": True, "lora_r": 4, "lora_dropout": 0.0, "learning_rate": 1e-2}}
    halves = []
    for label, options in runs.items():
        run_training(config(tmp_path / f"{label}-1", **options), "reward")
        halves.append(config(tmp_path / f"{label}-2", **options, per_device_train_batch_size=4))
    torchrun.run_two_processes(WORKER, json.dumps([["reward", asdict(half)] for half in halves]), timeout=900)
    for label in runs:
        one, two = logged(tmp_path / f"{label}-1"), logged(tmp_path / f"{label}-2")
        assert len(one) == len(two) == 2
        for one_row, two_row in zip(one, two, strict=True):
            for key in ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
                assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), (label, key)
    assert (tmp_path / "full-2" / "model.safetensors").is_file()
    assert (tmp_path / "lora-2" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"truncation": True}, "truncation"),  # TRL's RewardConfig filters long pairs: nothing to truncate
        ({"max_prompt_length": 8}, "max_prompt_length"),
        ({"beta": 0.2}, "beta"),
        ({"center_rewards_coefficient": -0.1}, "center_rewards_coefficient"),
    ],
)
def test_keys_reward_modelling_cannot_honour_are_refused(overrides, key):
    from fastalign.train.config import check_config

    with pytest.raises(ConfigError, match=key):
        cfg = TrainConfig(**overrides)
        check_config(cfg)
        make_objective("reward", cfg, CPU)


def test_center_rewards_coefficient_is_refused_for_other_objectives():
    with pytest.raises(ConfigError, match="center_rewards_coefficient"):
        make_objective("dpo", TrainConfig(center_rewards_coefficient=0.01), CPU)


def test_rows_are_checked_and_named():
    tokenizer = tiny_tokenizer()
    rows = tiny_preference_rows(3, seed=0)
    with pytest.raises(ValueError, match="row 1: missing 'margin'"):
        tokenize_reward_dataset([{**rows[0], "margin": 1.0}, rows[1]], tokenizer, max_length=None)
    with pytest.raises(ValueError, match="'margin' must be a finite number"):
        tokenize_reward_dataset([{**rows[0], "margin": "big"}], tokenizer, max_length=None)
    with pytest.raises(ValueError, match="max_length=2"):
        tokenize_reward_dataset(rows, tokenizer, max_length=2)
    with pytest.raises(ValueError, match="missing 'rejected'"):
        tokenize_reward_dataset([{"prompt": "a", "chosen": "b"}], tokenizer, max_length=None)


def test_standard_rows_end_with_one_eos_as_trl_appends_it():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token
    plain, ended = tokenize_reward_dataset(
        [
            {"prompt": "Q?", "chosen": " yes", "rejected": " no"},
            {"prompt": "Q?", "chosen": " yes" + eos, "rejected": " no"},
        ],
        tokenizer,
        max_length=None,
    )
    assert plain.chosen_ids == ended.chosen_ids == tokenizer("Q? yes" + eos)["input_ids"]
    assert plain.chosen_ids[-1] == tokenizer.eos_token_id and plain.chosen_ids[-2] != tokenizer.eos_token_id
