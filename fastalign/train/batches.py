"""Which micro-batches each rank trains on, step by step, in an order that a checkpoint can resume.

The order is a pure function of (seed, epoch): every epoch shuffles the training units (examples, or
packed bins of examples) with its own generator (or, sequential, keeps the data's order), groups them
into micro-batches, and deals the micro-batches of each optimizer step to the ranks in turn (as
accelerate deals a data loader's batches). The position is (epoch, step in epoch),
so resuming needs two integers, not a pickled data loader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastalign.data.collate import PackedCollator, PaddingCollator
from fastalign.data.packing import pack_best_fit_decreasing

logger = logging.getLogger(__name__)


@dataclass
class BatchPosition:
    epoch: int = 0
    step_in_epoch: int = 0


class MicroBatches:
    """The micro-batches of every optimizer step for one rank.

    Each step takes ``accumulation × world_size`` micro-batches of ``batch_size`` units; rank r gets
    micro-batches r, r + world_size, ... of them. An epoch's remainder that cannot fill a whole step is
    dropped (as ``drop_last``), so every step has the same number of micro-batches on every rank.
    """

    def __init__(
        self,
        examples: Sequence,
        *,
        batch_size: int,
        accumulation: int,
        pad_token_id: int,
        seed: int,
        packing_length: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        collate: Callable[[Sequence], dict] | None = None,
    ):
        """``examples``: ``TokenizedExample``s (SFT, padded or packed), or any examples with the
        ``collate`` that batches them (preference pairs, prompts). ``shuffle`` False: every epoch reads
        the units in their order (``train_sampling_strategy: sequential``)."""
        if not examples:
            raise ValueError("the training set is empty")
        self.examples = list(examples)
        self.units = (
            pack_best_fit_decreasing([len(e) for e in self.examples], packing_length)
            if packing_length
            else [[i] for i in range(len(self.examples))]
        )
        self.batch_size, self.accumulation = batch_size, accumulation
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self._epoch_order: tuple[int, list[int]] = (-1, [])  # (epoch, its order): one shuffle an epoch
        self.collate: Callable[[Sequence], dict] = collate or (
            PackedCollator() if packing_length else PaddingCollator(pad_token_id)
        )
        per_step = batch_size * accumulation * world_size
        unit = "packed sequence" if packing_length else "example"
        self.steps_per_epoch = len(self.units) // per_step
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(self.units)} {unit}s, fewer than one step needs: "
                f"per_device_train_batch_size={batch_size} × "
                f"gradient_accumulation_steps={accumulation} × {world_size} process(es) = {per_step}"
            )
        left_out = len(self.units) % per_step
        if left_out and rank == 0:
            logger.warning(
                f"fastalign: each epoch trains {len(self.units) - left_out} of the {len(self.units)} "
                f"{unit}s: the {left_out} that do not fill a step of {per_step} are left out ("
                + ("others each epoch, the order being reshuffled" if shuffle else "the last, each epoch")
                + "); a batch size that divides the data trains them all"
            )

    def _order(self, epoch: int) -> Sequence[int]:
        if not self.shuffle:
            return range(len(self.units))
        if self._epoch_order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self.units), generator=generator).tolist())
        return self._epoch_order[1]

    def step_batches(self, position: BatchPosition) -> list[dict]:
        """This rank's micro-batches of the step at ``position``."""
        order = self._order(position.epoch)
        first = position.step_in_epoch * self.accumulation * self.world_size
        batches = []
        for k in range(self.accumulation):
            micro = first + k * self.world_size + self.rank
            units = order[micro * self.batch_size : (micro + 1) * self.batch_size]
            batches.append(self.collate([self.examples[i] for u in units for i in self.units[u]]))
        return batches

    def advance(self, position: BatchPosition) -> BatchPosition:
        step = position.step_in_epoch + 1
        if step == self.steps_per_epoch:
            return BatchPosition(position.epoch + 1, 0)
        return BatchPosition(position.epoch, step)


#: Marks an evaluation batch that a rank runs only to keep collectives in step; it is not counted.
FILLER_KEY = "fastalign_filler"


class EvaluationBatches(Sequence):
    """Every held-out example once: micro-batches of ``batch_size`` examples dealt to the ranks in turn,
    every rank getting the same number (a short rank repeats the first, marked with ``FILLER_KEY``).

    Collated when read, at each evaluation: a rank collates only its own micro-batches, and holds none
    between evaluations (an offline distillation's stored teacher scores stay in their files till then).
    The collators are deterministic, so every evaluation reads the same batches."""

    def __init__(
        self,
        examples: Sequence,
        batch_size: int,
        pad_token_id: int,
        rank: int = 0,
        world_size: int = 1,
        collate: Callable[[Sequence], dict] | None = None,
    ):
        self.examples, self.collate = examples, collate or PaddingCollator(pad_token_id)
        starts = range(0, len(examples), batch_size)
        self.mine = [slice(start, start + batch_size) for start in starts][rank::world_size]
        self.fillers = -(-len(starts) // world_size) - len(self.mine)
        self.first = slice(0, batch_size)

    def __len__(self) -> int:
        return len(self.mine) + self.fillers

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"evaluation micro-batch {index} of {len(self)}")
        index %= len(self)
        if index < len(self.mine):
            return self.collate(self.examples[self.mine[index]])
        return {**self.collate(self.examples[self.first]), FILLER_KEY: True}


def batch_tokens(batch: dict) -> int:
    """The tokens of a micro-batch, padding left out: its attention mask's, or every position of a packed
    row (which has no padding, only ``position_ids``). TRL's trainers count ``num_tokens`` so."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()
