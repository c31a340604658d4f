"""What an objective is to the runner (``fastalign.train.run``) and the engine (``fastalign.train.engine``).

An objective is one algorithm's whole story, in its own file: the config keys it reads (its options,
checked once when it is made, before any model work), how dataset rows become examples and
micro-batches, what it needs from a reference model or a rollout (``setup``), and what one micro-batch's
loss and metrics are (``loss_tokens``, ``compute_loss``). The engine owns the loop and calls only the
step methods; everything the objective keeps across steps goes into checkpoints through
``state_dict``/``load_state_dict`` (tensors of fixed shapes, loaded in place) and
``pending_state``/``load_pending_state`` (what its next steps still train on, e.g. a generation sampled
by an earlier step's policy), so every objective resumes exactly, wherever the checkpoint falls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from fastalign.builtin.models import ModelTask
from fastalign.train.batches import BatchPosition, MicroBatches, batch_tokens
from fastalign.train.checkpoint import PendingState
from fastalign.train.config import TrainConfig
from fastalign.train.distributed import DistributedContext

if TYPE_CHECKING:  # the engine imports this module: its Callback only types a field here
    from fastalign.train.engine import Callback


class BatchSource(Protocol):
    """Which micro-batches each optimizer step of this rank trains on, resumable from a position:
    ``MicroBatches`` (the data as it is) or an objective's own (GRPO's generation batches)."""

    steps_per_epoch: int

    def step_batches(self, position: BatchPosition) -> list[dict]: ...
    def advance(self, position: BatchPosition) -> BatchPosition: ...


@dataclass(frozen=True)
class BatchPlan:
    """How the run deals examples into micro-batches (general keys of the config, and the processes)."""

    batch_size: int  # per_device_train_batch_size
    accumulation: int  # gradient_accumulation_steps
    seed: int
    pad_token_id: int
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True  # train_sampling_strategy random; False: sequential

    @classmethod
    def from_config(cls, config: TrainConfig, tokenizer, ctx: DistributedContext) -> BatchPlan:
        return cls(
            config.per_device_train_batch_size,
            config.gradient_accumulation_steps,
            config.seed,
            tokenizer.pad_token_id,
            ctx.rank,
            ctx.world_size,
            config.train_sampling_strategy != "sequential" and config.shuffle_dataset,
        )


@dataclass(frozen=True)
class RunParts:
    """What the runner lends an objective once the policy is loaded and placed."""

    tokenizer: Any
    ctx: DistributedContext
    #: A frozen, patched, placed model: the named checkpoint, or the policy's initial weights for None.
    load_frozen_model: Callable[[str | None], torch.nn.Module]
    use_peft: bool
    autocast_dtype: torch.dtype | None
    eval_batch_size: int


@dataclass
class Prepared:
    """The examples an objective trains and evaluates on once set up (a precomputed reference adds its
    log-probs to them), and the callbacks it needs the engine to run (TR-DPO's reference sync)."""

    train: list
    evaluation: list
    callbacks: list[Callback] = field(default_factory=list)


def pick(options: object, *keys: str) -> dict[str, Any]:
    """Some of an options dataclass's fields by name, to pass on as keyword arguments."""
    return {key: getattr(options, key) for key in keys}


#: TRL's length options, which each objective passes on to its tokenizing function.
LENGTH_KEYS = ("max_length", "max_prompt_length", "truncation")


class Objective(ABC):
    """One algorithm. Subclasses set ``default_dataset`` and implement ``tokenize`` and the step methods;
    the rest has the plain behaviour most objectives want.

    The engine sums ``loss_tokens`` over every micro-batch of a step on every rank and passes that total
    to ``compute_loss``, whose losses therefore add up (over micro-batches and ranks) to the mean over
    the whole accumulated batch: gradient accumulation and data parallelism are exact, whatever the
    lengths."""

    #: The built-in data set when the config names none.
    default_dataset: ClassVar[str]
    #: TRL's ``learning_rate`` for this trainer (its config's default), used when the config leaves it null.
    default_learning_rate: ClassVar[float] = 1e-6
    #: This trainer's TRL defaults of ``SHARED_DEFAULTS``' keys where they differ (online DPO's), used when
    #: the config leaves them null.
    shared_defaults: ClassVar[dict[str, Any]] = {}
    #: TRL's ``train_sampling_strategy`` for this trainer, used when the config leaves it null; None: TRL's
    #: sampler does not read the key (GRPO's, RLOO's and distillation's read ``shuffle_dataset``).
    default_sampling_strategy: ClassVar[str | None] = "random"
    #: Whether the loss runs inside the patched model's forward (``head_fn``): the fused head is needed
    #: even when the other kernels are off (``use_liger_kernel: false``).
    needs_fused_head: ClassVar[bool] = True
    #: What the runner loads the model as: a causal LM, or a sequence classifier with one score (a reward
    #: model, whose new ``score`` head transformers initialises; ``fastalign.train.loading``).
    task: ClassVar[ModelTask] = "causal_lm"
    #: Pack examples into rows of this many tokens (SFT's ``packing``); None: pad each micro-batch.
    packing_length: int | None = None
    #: Rows one training forward takes per example of ``per_device_train_batch_size``: a preference pair's
    #: chosen and rejected completions run as one forward of two rows. Sizes activation offloading.
    rows_per_example: ClassVar[int] = 1

    def __init__(self, ctx: DistributedContext | None = None):
        self.ctx = ctx or DistributedContext(0, 1, 0, torch.device("cpu"))

    @classmethod
    @abstractmethod
    def from_config(cls, name: str, config: TrainConfig, ctx: DistributedContext) -> Objective:
        """The objective ``name`` (a CLI name this class serves) with its options read from ``config``
        and checked: a one-line ``ConfigError`` naming the key."""

    @classmethod
    @abstractmethod
    def config_keys(cls, name: str) -> frozenset[str]:
        """The config keys objective ``name`` reads besides the runner's: a key only other objectives
        read is refused rather than ignored."""

    # --- data --------------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, rows: list[dict], tokenizer) -> list:
        """Dataset rows as this objective's examples (one-line errors name the row)."""

    def collate(self, tokenizer) -> Callable[[Sequence], dict] | None:
        """What batches the examples; None: SFT's padding (or packing) collators."""
        return None

    def batches(self, examples: list, tokenizer, plan: BatchPlan) -> BatchSource:
        """The training micro-batches of every step."""
        return MicroBatches(
            examples,
            batch_size=plan.batch_size,
            accumulation=plan.accumulation,
            pad_token_id=plan.pad_token_id,
            seed=plan.seed,
            rank=plan.rank,
            world_size=plan.world_size,
            shuffle=plan.shuffle,
            packing_length=self.packing_length,
            collate=self.collate(tokenizer),
        )

    def setup(self, model: torch.nn.Module, train: list, evaluation: list, parts: RunParts) -> Prepared:
        """Everything the objective needs besides the policy (a reference, a tokenizer to decode)."""
        return Prepared(train, evaluation)

    def sequence_length(self, config: TrainConfig, train: list) -> int:
        """The length of a training row, for the throughput estimate (MFU's attention term), once the
        training examples ``train`` are tokenized: ``max_length`` (``with_objective_defaults`` filled it)."""
        return config.max_length

    # --- a step ------------------------------------------------------------------------------------
    def prepare_step(
        self, model: torch.nn.Module, micro_batches: list[dict], step: int
    ) -> tuple[list[dict], dict[str, float]]:
        """Called first in every step with the data's micro-batches: returns the training micro-batches
        (GRPO generates and scores completions here) and metrics that are already global (every rank
        returns the same values)."""
        return micro_batches, {}

    def num_tokens(self, micro_batches: list[dict]) -> int:
        """This rank's part of the step's TRL ``num_tokens`` (the engine sums it over ranks and steps and
        logs the running total): the training micro-batches' tokens without padding, prompts included,
        as TRL's trainers count them in each ``compute_loss``. GRPO and RLOO count their generations'."""
        return sum(batch_tokens(batch) for batch in micro_batches)

    @abstractmethod
    def loss_tokens(self, batch: dict) -> int:
        """The number of loss terms (tokens, sequences, ...) in ``batch``."""

    @abstractmethod
    def compute_loss(
        self, model: torch.nn.Module, batch: dict, num_items_in_batch: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """This micro-batch's share of the step's loss (its sum over ``num_items_in_batch``), and
        metrics to log, normalised the same way (a mean over the micro-batch's loss terms, times their
        count over ``num_items_in_batch``), so that their sum over the step is the step's mean."""

    # --- what a checkpoint keeps -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors the objective carries from step to step (e.g. TR-DPO's synced reference's
        weights, possibly sharded DTensors): saved in every checkpoint, restored on resume."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:  # noqa: B027 (most need nothing)
        """Restore ``state_dict()``: its tensors were loaded in place, so most objectives need nothing;
        one that keeps state elsewhere (a Python number, say) reads it back from ``state`` here."""

    def pending_state(self) -> PendingState | None:
        """This rank's part of what the next steps still train on that no data position makes again (a
        generation sampled by an earlier step's policy that later steps train on): saved with every
        checkpoint (safetensors and JSON, ``fastalign.train.checkpoint``); None where the next step needs
        nothing of the steps before it (most objectives, and a generation's last step)."""
        return None

    def load_pending_state(self, state: PendingState) -> None:
        """On resume: take back what ``pending_state`` gave, so the next steps train on it rather than
        make it again; a ValueError for a state that is not what this objective saves."""
        raise ValueError(f"{type(self).__name__} saves no pending state")
