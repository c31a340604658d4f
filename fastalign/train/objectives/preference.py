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


def _chosen_tokens(batch: dict) -> int:
    """Target tokens of the chosen rows (the first half; labels are unshifted, so the first is none)."""
    return int((batch["labels"][: batch["labels"].shape[0] // 2, 1:] != -100).sum())


class PreferenceObjective:
    """``PreferenceLoss`` on micro-batches of P pairs: rows 0..P-1 chosen, P..2P-1 rejected.

    The chosen NLL (CPO, ORPO, 'sft') is a token mean over the whole step: ``prepare_step`` counts the
    step's chosen tokens on all ranks. (In evaluation, each batch's own mean.)"""

    def __init__(self, loss: PreferenceLoss, ctx: DistributedContext, reference: Reference | None = None):
        self.loss, self.reference, self.ctx = loss, reference, ctx
        self._step_chosen_tokens = torch.ones(())

    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        local = sum(_chosen_tokens(batch) for batch in micro_batches)
        self._step_chosen_tokens = all_reduce_sum(local, self.ctx).cpu().clamp_min(1)
        return micro_batches, {}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        pairs = self.loss_tokens(batch)
        targets = shift_labels(batch["labels"])
        references = {} if self.loss.reference_free else self._references(batch, pairs)
        # the loss is scaled by this batch's share below: pre-divide so the NLL ends as the step's mean
        nll_tokens = self._step_chosen_tokens * pairs / num_items_in_batch.cpu() if model.training else None

        def head(hidden, weight, bias):
            return self.loss(hidden, weight, targets, bias=bias, nll_tokens=nll_tokens, **references)

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
    (KL) completions.

    Its reference point, the KL estimate (mean policy − reference log-ratio of the mismatched pairs,
    clamped at 0), and the counts of desirable and undesirable completions are taken over the whole
    step on all ranks in ``prepare_step``: the loss does not depend on how the step is split, and
    every micro-batch logs ``rewards/chosen``/``rewards/rejected`` as its part of the step's class
    means. (In evaluation, each batch's own.)"""

    def __init__(self, loss: KTOLoss, reference: Reference | None, ctx: DistributedContext):
        self.loss, self.reference, self.ctx = loss, reference, ctx
        self._class_counts = torch.ones(2)  # desirable, undesirable completions of the current step
        self._kl = torch.zeros(1)

    def loss_tokens(self, batch: dict) -> int:
        return batch["input_ids"].shape[0]

    def prepare_step(self, model, micro_batches: list[dict], step: int) -> tuple[list[dict], dict]:
        sums = torch.zeros(4, dtype=torch.float64)  # desirable, undesirable, KL log-ratio sum, KL rows
        for batch in micro_batches:
            desirable = int(batch["kto_labels"].sum())
            batch_on_device = {k: v.to(self.ctx.device) for k, v in batch.items()}
            kl_ratio = self._kl_log_ratios(model, batch_on_device)
            sums += torch.tensor([desirable, len(kl_ratio) - desirable, float(kl_ratio.sum()), len(kl_ratio)])
        sums = all_reduce_sum(sums, self.ctx).cpu()
        self._class_counts = sums[:2]
        self._kl = (sums[2] / sums[3].clamp_min(1)).clamp(min=0).float().reshape(1)
        return micro_batches, {}

    def compute_loss(self, model, batch: dict, num_items_in_batch: torch.Tensor):
        ref_logps = self._reference_logps(batch, "")
        # KTOLoss takes the mean of (kl − ref_kl): the step's estimate as one term, or this batch's
        kl = self._kl.to(ref_logps.device) if model.training else self._kl_log_ratios(model, batch)
        labels = batch["kto_labels"].bool()

        def head(hidden, weight, bias):
            return self.loss(
                hidden, weight, shift_labels(batch["labels"]), labels, ref_logps=ref_logps,
                kl_logps=kl, ref_kl_logps=torch.zeros_like(kl), bias=bias,
            )  # fmt: skip

        result = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], head_fn=head)
        loss, metrics = result.head_output
        share = self.loss_tokens(batch) / num_items_in_batch
        step_metrics = {"kl": metrics["kl"] * share}
        for index, name in enumerate(("chosen", "rejected")):
            # a class mean over this batch, weighted by its count over the step's count of that class
            # (in evaluation, by this batch's share: the engine weighs batches by their size)
            count = int((labels if index == 0 else ~labels).sum())
            weight = count / max(float(self._class_counts[index]), 1.0) if model.training else share
            for key in (f"rewards/{name}", f"logps/{name}"):
                step_metrics[key] = metrics[key] * weight if key in metrics else torch.zeros(())
        step_metrics["rewards/margins"] = step_metrics["rewards/chosen"] - step_metrics["rewards/rejected"]
        return loss * share, step_metrics

    @torch.no_grad()
    def _kl_log_ratios(self, model, batch: dict) -> torch.Tensor:
        """Policy − reference log-probs of the batch's mismatched (KL) completions."""
        return sequence_logprobs_of(model, *_rows(batch, "kl_")) - self._reference_logps(batch, "kl_")

    def _reference_logps(self, batch: dict, prefix: str) -> torch.Tensor:
        """Reference log-probs of the completions (or, with prefix "kl_", the mismatched ones)."""
        if f"ref_{prefix}logps" in batch:
            return batch[f"ref_{prefix}logps"]
        if self.reference is None:
            raise ValueError("KTO needs a reference: none was set up and none was precomputed")
        return self.reference.sequence_logprobs(*_rows(batch, prefix))
