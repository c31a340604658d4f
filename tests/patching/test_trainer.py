"""A patched model inside transformers.Trainer: same losses as the original, with gradient accumulation."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

import fastalign
from fastalign.builtin import tiny_model, tiny_tokenizer


def _train(patch: bool, output_dir) -> list[float]:
    tokenizer = tiny_tokenizer()
    texts = [
        f"What is {a} plus {b}? The answer is {a + b}." + " the model" * (a % 3)
        for a in range(8)
        for b in (1, 2)
    ]
    dataset = [tokenizer(text) for text in texts]  # uneven lengths: token counts differ per micro-batch
    model = tiny_model("llama", vocab_size=len(tokenizer))
    if patch:
        fastalign.patch_model(model)
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_trainer_losses_match_with_gradient_accumulation(tmp_path):
    original = _train(False, tmp_path / "original")
    patched = _train(True, tmp_path / "patched")
    assert len(original) == 4
    torch.testing.assert_close(torch.tensor(patched), torch.tensor(original), rtol=1e-4, atol=1e-4)


def _evaluate(patch: bool, output_dir) -> dict:
    tokenizer = tiny_tokenizer()
    dataset = [tokenizer(f"What is {a} plus {b}? The answer is {a + b}.") for a in range(4) for b in (1, 2)]
    model = tiny_model("llama", vocab_size=len(tokenizer))
    if patch:
        fastalign.patch_model(model)
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_eval_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )

    def accuracy(prediction) -> dict:
        hits = prediction.predictions.argmax(-1)[:, :-1] == prediction.label_ids[:, 1:]
        return {"accuracy": float(hits[prediction.label_ids[:, 1:] != -100].mean())}

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(
        model=model, args=args, eval_dataset=dataset, data_collator=collator, compute_metrics=accuracy
    )
    return trainer.evaluate()


def test_evaluate_with_compute_metrics_gets_the_logits(tmp_path):
    """Trainer.evaluate runs the model in eval mode without gradients: the patched forward builds the
    logits there (compute_metrics needs them), with the same eval_loss."""
    expected, got = _evaluate(False, tmp_path / "a"), _evaluate(True, tmp_path / "b")
    assert got["eval_accuracy"] == expected["eval_accuracy"]
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
