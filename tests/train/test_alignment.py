"""DPO family, KTO and GRPO on the engine, end to end on a tiny model: each objective trains in one
process and under 2-process FSDP2 with the same losses; DPO and GRPO measurably learn; the three
reference set-ups agree; bad input fails with errors naming the row, function or key."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import peft
import pytest
import torch

import fastalign
from fastalign.builtin import tiny_model, tiny_preference_rows, tiny_tokenizer
from fastalign.cli.main import main
from fastalign.data.preference import PreferenceCollator, tokenize_preference_dataset
from fastalign.train.config import TrainConfig
from fastalign.train.engine import Callback, Engine
from fastalign.train.reference import AdapterDisabledReference, FrozenReference, SyncReference
from fastalign.train.run import run_training
from tests import torchrun

WORKER = Path(__file__).with_name("train_worker.py")
DIGITS = "fastalign.builtin:digit_ratio"
#: Per objective: what differs from the common tiny config (GRPO: short completions, 2 prompts × 4, and no
#: max_length, which grpo and rloo refuse).
OBJECTIVE_OPTIONS = {
    "dpo": {"max_length": 64},
    "orpo": {"max_length": 64},
    "simpo": {"max_length": 64},
    "cpo": {"max_length": 64},
    "kto": {"max_length": 64},
    "grpo": {"reward_funcs": [DIGITS], "num_generations": 4, "max_completion_length": 8, "beta": 0.04},
    "rloo": {"reward_funcs": [DIGITS], "num_generations": 4, "max_completion_length": 8},
}
#: Runs of the 1-vs-2-process test: label → (objective, options); GRPO with LoRA generates through
#: peft's wrapper, which must still unshard FSDP2's root around generate().
TWO_PROCESS_RUNS = {name: (name, {}) for name in OBJECTIVE_OPTIONS} | {
    "grpo-lora": ("grpo", {"use_peft": True, "lora_r": 4, "lora_dropout": 0.0, "learning_rate": 1e-2}),
}


def config(output_dir: Path, objective: str, **overrides) -> TrainConfig:
    options = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        loss_curve_png=False,
        **OBJECTIVE_OPTIONS[objective],
    )
    return TrainConfig(**{**options, **overrides})


def logged(output_dir) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run_two_processes(runs: list[tuple[str, TrainConfig]]) -> None:
    payload = json.dumps([[objective, asdict(cfg)] for objective, cfg in runs])
    torchrun.run_two_processes(WORKER, payload, timeout=900)


@pytest.mark.slow
def test_every_objective_trains_alike_in_one_and_two_processes(tmp_path):
    """2 ranks × half the batch (gloo, FSDP2) = one process with the whole batch: the same losses and
    metrics, for every objective (GRPO samples the same completions: its seeds follow the prompts)."""
    halves = []
    for label, (objective, options) in TWO_PROCESS_RUNS.items():
        # GRPO samples each prompt micro-batch as a whole: one process accumulates the ranks' micro-batches
        sampled = objective in ("grpo", "rloo")
        whole = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4} if sampled else {}
        # the one-process run is only read for its losses and metrics: it saves no checkpoint (the
        # 2-process run still saves its own, under FSDP2)
        whole["save_strategy"] = "no"
        run_training(config(tmp_path / f"{label}-1", objective, **{**options, **whole}), objective)
        half = config(tmp_path / f"{label}-2", objective, **{**options, "per_device_train_batch_size": 4})
        halves.append((label, objective, half))
    run_two_processes([(objective, half) for _, objective, half in halves])
    for label, _, two in halves:
        one_logs, two_logs = logged(tmp_path / f"{label}-1"), logged(two.output_dir)
        assert len(one_logs) == len(two_logs) == 2, label
        for one_row, two_row in zip(one_logs, two_logs, strict=True):
            assert torch.isfinite(torch.tensor(one_row["loss"]))
            for key in ("loss", "rewards/margins", "reward", "kl", "entropy"):
                if key in one_row:
                    assert two_row[key] == pytest.approx(one_row[key], rel=1e-4, abs=1e-6), (label, key)
        saved = "adapter_model.safetensors" if two.use_peft else "model.safetensors"
        assert (Path(two.output_dir) / saved).is_file()


@pytest.mark.slow
def test_dpo_learns_the_preferred_completion(tmp_path):
    """Chosen completions answer, rejected ones evade: accuracy and margins rise within 12 steps."""
    run_training(config(tmp_path, "dpo", max_steps=12, warmup_ratio=0.1), "dpo")
    rows = logged(tmp_path)
    early, late = rows[1], rows[-3:]  # step 1's rewards are exactly 0 (policy = reference)
    assert all(row["rewards/accuracies"] >= 0.9 for row in late), rows
    assert min(row["rewards/margins"] for row in late) > early["rewards/margins"] + 0.3
    assert late[-1]["loss"] < 0.5 < rows[0]["loss"]


@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo"])
def test_bf16_single_process_runs_every_head(tmp_path, objective):
    """``bf16: true`` in one process is autocast over fp32 weights: the preference heads (pairs, KTO's
    completions) and GRPO's run in bf16 and train, with the first step's loss that of the fp32 run's
    within bf16's precision (the same policy and batch)."""
    losses = {}
    for precision in ("fp32", "bf16"):
        run_training(config(tmp_path / precision, objective, bf16=precision == "bf16"), objective)
        losses[precision] = [row["loss"] for row in logged(tmp_path / precision) if "loss" in row]
    assert len(losses["bf16"]) == 2 and all(math.isfinite(loss) for loss in losses["bf16"])
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=0.02, abs=0.02)


@pytest.mark.slow
def test_grpo_raises_the_mean_reward(tmp_path):
    """A verifiable toy reward (the share of digits in the completion): the mean reward climbs."""
    cfg = config(
        tmp_path,
        "grpo",
        max_steps=16,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=12,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        beta=0.0,
    )
    run_training(cfg, "grpo")
    rewards = [row["reward"] for row in logged(tmp_path)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


def test_adapter_disabled_reference_equals_a_frozen_copy():
    tokenizer = tiny_tokenizer()
    examples = tokenize_preference_dataset(tiny_preference_rows(4), tokenizer)
    batch = PreferenceCollator(tokenizer.pad_token_id)(examples)
    rows = (batch["input_ids"], batch["attention_mask"], batch["labels"])

    frozen = FrozenReference(fastalign.patch_model(tiny_model("llama"))).sequence_logprobs(*rows)
    policy = peft.get_peft_model(
        fastalign.patch_model(tiny_model("llama")), peft.LoraConfig(r=4, target_modules="all-linear")
    )
    with torch.no_grad():  # a trained adapter: the policy now differs from its base
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    disabled = AdapterDisabledReference(policy).sequence_logprobs(*rows)
    enabled = FrozenReference(policy).sequence_logprobs(*rows)
    torch.testing.assert_close(disabled, frozen, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(enabled, frozen, atol=1e-3)


@pytest.mark.slow
def test_precomputed_reference_gives_the_same_run(tmp_path):
    run_training(config(tmp_path / "live", "dpo", max_steps=3), "dpo")
    run_training(config(tmp_path / "pre", "dpo", max_steps=3, precompute_ref_log_probs=True), "dpo")
    live, pre = logged(tmp_path / "live"), logged(tmp_path / "pre")
    for a, b in zip(live, pre, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_lora_dpo_uses_the_adapter_disabled_reference_and_saves_an_adapter(tmp_path):
    out = run_training(config(tmp_path, "dpo", use_peft=True, lora_r=4, learning_rate=1e-2), "dpo")
    assert (out / "adapter_config.json").is_file()
    assert logged(tmp_path)[-1]["rewards/margins"] != 0.0  # the adapter moved away from the reference


def test_tr_dpo_sync_mixes_the_reference_toward_the_policy():
    policy, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = reference.weight.detach().clone()
    sync = SyncReference(policy, reference, alpha=0.25, steps=2)
    engine = Engine.__new__(Engine)  # only .state.step is read
    engine.state = type("State", (), {"step": 1})()
    sync.on_step_end(engine, {})
    torch.testing.assert_close(reference.weight, before)  # not a sync step
    engine.state.step = 2
    sync.on_step_end(engine, {})
    torch.testing.assert_close(reference.weight, 0.25 * policy.weight + 0.75 * before)


@pytest.mark.slow
@pytest.mark.parametrize(
    "reuse",
    [{"num_iterations": 2}, {"steps_per_generation": 2}],
    ids=["num_iterations", "steps_per_generation"],
)
def test_grpo_reuses_a_generation_with_old_log_probs(tmp_path, reuse):
    """Two optimizer steps per generation: both log the same generation's rewards, and train with
    importance ratios against the log-probs kept at sampling time (num_iterations: the same completions
    twice; steps_per_generation: each step on its own half of them)."""
    cfg = config(tmp_path, "grpo", max_steps=4, learning_rate=1e-2, **reuse)
    run_training(cfg, "grpo")
    rows = logged(tmp_path)
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["reward"] == rows[3]["reward"]
    assert rows[1]["reward"] != rows[2]["reward"]  # a new generation every second step
    assert all("clip_ratio/region_mean" in row for row in rows)
    # TRL's num_tokens counts a generation's tokens once, when it is sampled
    assert 0 < rows[0]["num_tokens"] == rows[1]["num_tokens"] < rows[2]["num_tokens"] == rows[3]["num_tokens"]


def test_masking_truncated_completions_leaves_nothing_to_learn(tmp_path):
    """Two-token completions never reach EOS: every completion is truncated, so every token is masked."""
    cfg = config(tmp_path, "grpo", max_steps=1, max_completion_length=2, mask_truncated_completions=True)
    run_training(cfg, "grpo")
    (row,) = logged(tmp_path)
    assert row["completions/clipped_ratio"] == 1.0
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0


def assistant_reply_length(prompts, completions, completion_ids, **columns):
    """Conversational GRPO: prompts and completions are message lists, as in TRL."""
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    assert all(c[0]["role"] == "assistant" for c in completions)
    return [float(len(c[0]["content"])) for c in completions]


def test_grpo_on_conversational_prompts(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}]} for i in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = config(
        tmp_path / "out",
        "grpo",
        max_steps=1,
        dataset_name=str(data),
        reward_funcs=[f"{__name__}:assistant_reply_length"],
    )
    run_training(cfg, "grpo")
    assert logged(tmp_path / "out")[0]["rewards/assistant_reply_length/mean"] > 0


@pytest.mark.slow
def test_tr_dpo_run_with_a_separate_reference_model(tmp_path):
    """sync_ref_model on a saved reference model (ref_model_name_or_path): trains and syncs every step."""
    reference_dir = tmp_path / "reference"
    tiny_model("llama", seed=1).save_pretrained(reference_dir)
    tiny_tokenizer().save_pretrained(reference_dir)
    cfg = config(
        tmp_path / "out",
        "dpo",
        max_steps=3,
        ref_model_name_or_path=str(reference_dir),
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
    )
    run_training(cfg, "dpo")
    rows = logged(tmp_path / "out")
    assert len(rows) == 3 and rows[0]["rewards/margins"] != 0.0  # policy ≠ this reference from the start


def run_cli(tmp_path, capsys, objective: str, *flags: str) -> str:
    code = main(["train", objective, "--output_dir", str(tmp_path / "out"), "--max_steps", "1", *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error: " in line]
    assert code == 2 and len(errors) == 1, err  # one line, however far the run got (a progress bar may show)
    return errors[0]


def test_a_preference_row_without_rejected_is_named(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": "a", "chosen": " b"}\n')
    assert "pairs.jsonl line 2: missing 'rejected'" in run_cli(
        tmp_path, capsys, "dpo", "--dataset_name", str(data)
    )


def test_a_kto_label_that_is_not_a_boolean_is_named(tmp_path, capsys):
    data = tmp_path / "kto.jsonl"
    data.write_text('{"prompt": "a", "completion": " b", "label": "yes"}\n')
    assert "kto.jsonl line 1: 'label' must be a bool" in run_cli(
        tmp_path, capsys, "kto", "--dataset_name", str(data)
    )


def test_a_missing_reward_function_is_named(tmp_path, capsys):
    err = run_cli(tmp_path, capsys, "grpo", "--reward_funcs", "no_such_module:reward")
    assert "reward_funcs" in err and "no_such_module" in err


def test_grpo_without_reward_functions_names_the_key(tmp_path, capsys):
    assert "'reward_funcs'" in run_cli(tmp_path, capsys, "grpo")


def wrong_count(prompts, completions, completion_ids, **columns):
    return [1.0]


def test_a_reward_function_returning_the_wrong_count_is_named(tmp_path, capsys):
    err = run_cli(
        tmp_path,
        capsys,
        "grpo",
        "--reward_funcs",
        f"{__name__}:wrong_count",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--max_completion_length",
        "2",
    )
    assert "wrong_count" in err and "1 value" in err


def test_a_prompt_longer_than_the_limit_is_named(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "' + "what is " * 40 + '", "chosen": " b", "rejected": " c"}\n')
    err = run_cli(tmp_path, capsys, "dpo", "--dataset_name", str(data), "--max_prompt_length", "8")
    assert "pairs.jsonl line 1" in err and "max_prompt_length" in err


def test_grpo_batch_size_must_hold_whole_groups(tmp_path, capsys):
    err = run_cli(tmp_path, capsys, "grpo", "--reward_funcs", DIGITS, "--per_device_train_batch_size", "6")
    assert "per_device_train_batch_size" in err and "num_generations" in err


class _Crash(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, engine, metrics):
        if engine.state.step == self.at:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_grpo_kill_and_resume_regenerates_the_same_completions(tmp_path):
    """Sampling seeds follow the data position, so a resumed GRPO run continues exactly."""
    options = dict(max_steps=4, save_steps=2, num_iterations=2, learning_rate=1e-2)
    run_training(config(tmp_path / "a", "grpo", **options), "grpo")
    cfg = config(tmp_path / "b", "grpo", **options)
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, "grpo", callbacks=[_Crash(at=3)])
    cfg.resume_from_checkpoint = "latest"
    run_training(cfg, "grpo")
    expected = {row["step"]: row for row in logged(tmp_path / "a")}
    got = {row["step"]: row for row in logged(tmp_path / "b")}
    for step in (3, 4):
        assert got[step]["reward"] == expected[step]["reward"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-7)
