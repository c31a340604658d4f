"""Preference objectives: DPO family, SimPO, CPO and ORPO on chosen/rejected pairs, and KTO on unpaired
completions. The losses are ``fastalign.losses``' modules, run inside the patched model's forward
(``head_fn``) so they take hidden states and never build logits.

A loss term is a pair (a completion for KTO): each micro-batch's mean is weighted by its share of the
step's pairs, so the step's loss is the mean over all its pairs, however they are split.
"""

from __future__ import annotations

import torch

from fastalign.losses import KTOLoss, PreferenceLoss
from fastalign.patching.causal_lm import shift_labels
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.reference import Reference, sequence_logprobs_of


class PreferenceObjective:
    """``PreferenceLoss`` on micro-batches of P pairs: rows 0..P-1 chosen, P..2P-1 rejected."""

    def __init__(self, loss: PreferenceLoss, reference: Reference | None = None):
        self.loss, self.reference = loss, reference

    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        pairs = self.loss_tokens(batch)
        targets = shift_labels(batch["labels"])
        references = {} if self.loss.reference_free else self._references(batch, pairs)

        def head(hidden, weight, bias):
            return self.loss(hidden, weight, targets, bias=bias, **references)

        result = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], head_fn=head)
        loss, metrics = result.head_output
        share = pairs / num_items_in_batch
        return loss * share, {key: value * share for key, value in metrics.items()}

    def _references(self, batch: dict, pairs: int) -> dict[str, torch.Tensor]:
        """Precomputed in the batch, or from the reference model (chosen rows, then rejected)."""
        if "ref_chosen_logps" in batch:
            return {name: batch[name] for name in ("ref_chosen_logps", "ref_rejected_logps")}
        if self.reference is None:
            raise ValueError("this loss needs a reference: none was set up and none was precomputed")
        logps = self.reference.sequence_logprobs(batch["input_ids"], batch["attention_mask"], batch["labels"])
        return {"ref_chosen_logps": logps[:pairs], "ref_rejected_logps": logps[pairs:]}


def _rows(batch: dict, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"], batch[f"{prefix}labels"]


class KTOObjective:
    """``KTOLoss`` on micro-batches of completions labelled desirable or not, with their mismatched
    (KL) completions. The reward metrics are means over the step's desirable (``rewards/chosen``) and
    undesirable (``rewards/rejected``) completions, counted over the whole step in ``prepare_step``, so
    every micro-batch on every rank logs the same keys."""

    def __init__(self, loss: KTOLoss, reference: Reference | None, ctx: DistributedContext):
        self.loss, self.reference, self.ctx = loss, reference, ctx
        self._class_counts = torch.ones(2)  # desirable, undesirable completions of the current step

    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        desirable = sum(int(batch["kto_labels"].sum()) for batch in micro_batches)
        total = sum(self.loss_tokens(batch) for batch in micro_batches)
        self._class_counts = all_reduce_sum(torch.tensor([desirable, total - desirable]), self.ctx).cpu()
        return micro_batches, {}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        ref_logps, ref_kl_logps = self._references(batch)
        with torch.no_grad():
            kl_logps = sequence_logprobs_of(model, *_rows(batch, "kl_"))
        labels = batch["kto_labels"].bool()

        def head(hidden, weight, bias):
            return self.loss(
                hidden, weight, shift_labels(batch["labels"]), labels, ref_logps=ref_logps,
                kl_logps=kl_logps, ref_kl_logps=ref_kl_logps, bias=bias,
            )  # fmt: skip

        result = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], head_fn=head)
        loss, metrics = result.head_output
        share = self.loss_tokens(batch) / num_items_in_batch
        step_metrics = {"kl": metrics["kl"] * share}
        for index, name in enumerate(("chosen", "rejected")):
            # a class mean over this batch, weighted by its count over the step's count of that class
            count = int((labels if index == 0 else ~labels).sum())
            weight = count / max(float(self._class_counts[index]), 1.0)
            for key in (f"rewards/{name}", f"logps/{name}"):
                step_metrics[key] = metrics[key] * weight if key in metrics else torch.zeros(())
        step_metrics["rewards/margins"] = step_metrics["rewards/chosen"] - step_metrics["rewards/rejected"]
        return loss * share, step_metrics

    def _references(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs of the completions and of the mismatched (KL) ones."""
        if "ref_logps" in batch and "ref_kl_logps" in batch:
            return batch["ref_logps"], batch["ref_kl_logps"]
        if self.reference is None:
            raise ValueError("KTO needs a reference: none was set up and none was precomputed")
        return self.reference.sequence_logprobs(*_rows(batch)), self.reference.sequence_logprobs(
            *_rows(batch, "kl_")
        )
