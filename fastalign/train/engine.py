"""The training loop: one optimizer step at a time, whatever the objective.

A step: this rank's micro-batches (which an objective may first turn into training batches, e.g. by
generating completions); the loss-term count of all of them on all ranks (so each micro-batch's loss is
its share of the accumulated batch's mean: exact gradient accumulation); forward and backward of each
(gradient sync only on the last under FSDP2); a non-finite check; clipping; optimizer and scheduler
step. The objective's metrics are summed like its loss, so they too are means over the whole step.

A run that diverges ends with a one-line ``NonFiniteLossError`` (a ValueError) naming a checkpoint that
trains on: weights that are not finite are never saved, and the checkpoint holding the weights that gave
a non-finite loss is set aside as ``checkpoint-<step>.diverged`` (``resume_from_checkpoint: latest``
would only diverge again). A run that collapses (loss ln V, gradient norm 0) trains on, with a warning.

A checkpoint holds the model, the optimizer, the RNG, the data position and the objective's own state
(``Objective.state_dict``, e.g. TR-DPO's synced reference), so a resumed run continues exactly.
Where metrics go (JSONL, progress bar, TensorBoard, W&B) and anything else users add are callbacks
(``fastalign.train.callbacks``), so behaviour is added without editing the loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastalign.train import checkpoint
from fastalign.train.batches import FILLER_KEY, BatchPosition
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.metrics import peak_memory_gib

if TYPE_CHECKING:  # objectives import the engine's Callback and autocast
    from fastalign.train.objectives.base import BatchSource, Objective


class NonFiniteLossError(RuntimeError, ValueError):
    """A step produced a NaN/inf loss or gradient (no optimizer step was taken), or the weights became
    non-finite (they were not saved). A ValueError too: ``fastalign train`` prints it as one line."""


@dataclass
class TrainerState:
    """Where the run is: everything besides tensors that a checkpoint restores."""

    step: int = 0
    position: BatchPosition = field(default_factory=BatchPosition)
    tokens_seen: int = 0
    scheduler: dict = field(default_factory=dict)
    log_history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainerState:
        known = {f.name for f in fields(cls)}  # a checkpoint also holds the run's config
        return cls(
            **{**{k: v for k, v in data.items() if k in known}, "position": BatchPosition(**data["position"])}
        )


class Callback:
    """Hooks the engine calls; override the ones you need. ``engine.should_stop = True`` ends the
    run after the current step (e.g. early stopping)."""

    def on_train_begin(self, engine: Engine) -> None: ...
    def on_step_end(self, engine: Engine, metrics: dict) -> None: ...
    def on_log(self, engine: Engine, logs: dict) -> None: ...
    def on_evaluate(self, engine: Engine, metrics: dict) -> None: ...
    def on_save(self, engine: Engine, path: Path) -> None: ...
    def on_train_end(self, engine: Engine) -> None: ...
    def on_train_error(self, engine: Engine, error: BaseException) -> None:
        """The run ends with ``error`` (raised on after the callbacks): close what is open."""


@dataclass
class Schedule:
    max_steps: int
    max_grad_norm: float = 1.0
    logging_steps: int = 10
    eval_steps: int = 0
    save_steps: int = 0
    save_total_limit: int = 2


class Engine:
    """Trains ``model`` on ``objective`` over ``batches``; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        batches: BatchSource,
        schedule: Schedule,
        ctx: DistributedContext,
        *,
        output_dir: str | Path,
        eval_batches: Sequence[dict] = (),
        callbacks: Sequence[Callback] = (),
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        run_config: dict | None = None,
    ):
        self.model, self.objective, self.optimizer, self.scheduler = model, objective, optimizer, scheduler
        self.batches, self.schedule, self.ctx = batches, schedule, ctx
        self.output_dir = Path(output_dir)
        self.eval_batches, self.callbacks = list(eval_batches), list(callbacks)
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.autocast_dtype = autocast_dtype  # single-process bf16: fp32 weights, bf16 matmuls
        self.run_config = run_config  # saved in each checkpoint: what a resume is checked against
        self.state = TrainerState()
        self.should_stop = False
        self._warned_collapse = False
        self._reset_window()

    # ---------------------------------------------------------------------------------------------
    def resume(self, path: str | Path) -> None:
        objective_state = self.objective.state_dict()  # loaded in place
        data = checkpoint.load_checkpoint(path, self.model, self.optimizer, self.ctx, objective_state)
        self.objective.load_state_dict(objective_state)
        self.state = TrainerState.from_dict(data)
        self.scheduler.load_state_dict(self.state.scheduler)

    def save(self) -> Path:
        """``checkpoint-<step>``, unless the weights are not finite (then ``NonFiniteLossError``)."""
        if not self._weights_finite():
            raise NonFiniteLossError(
                f"step {self.state.step}: the weights are not finite after the optimizer step, so they were "
                f"not saved as checkpoint-{self.state.step}; {self._last_good_checkpoint()}"
            )
        self.state.scheduler = self.scheduler.state_dict()
        trainer_state = self.state.to_dict()
        if self.run_config is not None:
            trainer_state[checkpoint.CONFIG_KEY] = self.run_config
        path = checkpoint.save_checkpoint(
            self.output_dir,
            self.state.step,
            self.model,
            self.optimizer,
            trainer_state,
            self.ctx,
            self.schedule.save_total_limit,
            objective_state=self.objective.state_dict(),
        )
        self._call("on_save", path)
        return path

    def train(self) -> TrainerState:
        self.model.train()
        self._call("on_train_begin")
        try:
            while self.state.step < self.schedule.max_steps and not self.should_stop:
                metrics = self.train_step()
                self._call("on_step_end", metrics)
                step = self.state.step
                if step % self.schedule.logging_steps == 0 or step == self.schedule.max_steps:
                    self._log()
                if self.schedule.eval_steps and step % self.schedule.eval_steps == 0 and self.eval_batches:
                    self.evaluate()
                if self.schedule.save_steps and step % self.schedule.save_steps == 0:
                    self.save()
        except BaseException as error:
            for callback in self.callbacks:
                with contextlib.suppress(Exception):  # the error that ended the run is the one to report
                    callback.on_train_error(self, error)
            raise
        if self.schedule.save_steps:  # the run did not diverge: the last save_total_limit are enough
            checkpoint.prune_checkpoints(self.output_dir, self.schedule.save_total_limit, self.ctx)
        self._call("on_train_end")
        return self.state

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics (global over ranks)."""
        start = time.perf_counter()
        micro_batches = self.batches.step_batches(self.state.position)
        with self._autocast():
            micro_batches, step_metrics = self.objective.prepare_step(
                self.model, micro_batches, self.state.step
            )
        local_items = sum(self.objective.loss_tokens(batch) for batch in micro_batches)
        num_items = all_reduce_sum(local_items, self.ctx).clamp_min(1)
        loss_sum = torch.zeros((), dtype=torch.float64)
        objective_sums: dict[str, torch.Tensor] = {}
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            self._set_gradient_sync(last)
            with self._autocast():
                loss, metrics = self.objective.compute_loss(
                    self.model, _to(batch, self.ctx.device), num_items
                )
            # FSDP2 averages gradients over ranks; each rank's loss is its share of the global mean.
            (loss * self.ctx.world_size).backward()
            loss_sum += loss.detach().double().cpu()
            _accumulate(objective_sums, metrics)
        loss_value = float(all_reduce_sum(loss_sum, self.ctx))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trainable(), self.schedule.max_grad_norm))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"step {self.state.step + 1}: loss {loss_value}, gradient norm {grad_norm}: not finite; "
                f"stopped without updating the model; {self._set_aside_diverged()}"
            )
        self._warn_if_collapsed(loss_value, grad_norm)
        learning_rate = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = int(all_reduce_sum(sum(_token_count(batch) for batch in micro_batches), self.ctx))
        self.state.step += 1
        self.state.position = self.batches.advance(self.state.position)
        self.state.tokens_seen += tokens
        objective_metrics = {**self._global_sums(objective_sums), **step_metrics}
        metrics = {
            "loss": loss_value,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "tokens": tokens,
            "seconds": time.perf_counter() - start,
            **objective_metrics,
        }
        for key in ("loss", "tokens", "seconds"):
            self._window[key] += metrics[key]
        self._window["steps"] += 1
        self._window["grad_norm"], self._window["learning_rate"] = grad_norm, learning_rate
        for key, value in objective_metrics.items():
            self._window["objective"][key] = self._window["objective"].get(key, 0.0) + value
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Token-mean objective loss over the held-out batches (all ranks together)."""
        self.model.eval()
        total, items = torch.zeros((), dtype=torch.float64), 0
        sums: dict[str, torch.Tensor] = {}
        for batch in self.eval_batches:
            batch = dict(batch)
            # Ranks run the same number of forwards (FSDP2 gathers collectively); fillers count 0.
            count = 0 if batch.pop(FILLER_KEY, False) else self.objective.loss_tokens(batch)
            with self._autocast():
                loss, batch_metrics = self.objective.compute_loss(
                    self.model, _to(batch, self.ctx.device), torch.tensor(max(count, 1))
                )
            total += loss.double().cpu() * count
            _accumulate(sums, {key: value * count for key, value in batch_metrics.items()})
            items += count
        self.model.train()
        total, items = all_reduce_sum(total, self.ctx), all_reduce_sum(items, self.ctx).clamp_min(1)
        metrics = {"step": self.state.step, "eval_loss": float(total / items)}
        metrics |= {f"eval_{key}": value / float(items) for key, value in self._global_sums(sums).items()}
        self.state.log_history.append(metrics)
        self._call("on_evaluate", metrics)
        return metrics

    # ---------------------------------------------------------------------------------------------
    def _log(self) -> None:
        window = self._window
        seconds = max(window["seconds"], 1e-9)
        logs = {
            "step": self.state.step,
            "epoch": round(
                self.state.position.epoch + self.state.position.step_in_epoch / self.batches.steps_per_epoch,
                4,
            ),
            "loss": window["loss"] / window["steps"],
            "grad_norm": window["grad_norm"],
            "learning_rate": window["learning_rate"],
            "tokens_per_second": window["tokens"] / seconds,
            "step_seconds": seconds / window["steps"],
            "peak_memory_gib": round(peak_memory_gib(self.ctx.device), 3),
        }
        if self.flops_per_token and self.peak_flops:
            logs["mfu"] = (
                logs["tokens_per_second"] * self.flops_per_token / (self.peak_flops * self.ctx.world_size)
            )
        logs |= {key: value / window["steps"] for key, value in window["objective"].items()}
        self.state.log_history.append(logs)
        self._call("on_log", logs)
        self._reset_window()

    def _reset_window(self) -> None:
        self._window = {"loss": 0.0, "tokens": 0.0, "seconds": 0.0, "steps": 0, "objective": {}}

    def _global_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per-rank metric sums summed over ranks (one collective; every rank has the same keys)."""
        if not sums:
            return {}
        keys = sorted(sums)
        totals = all_reduce_sum(torch.stack([sums[key].double() for key in keys]), self.ctx)
        return dict(zip(keys, totals.tolist(), strict=True))

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _autocast(self):
        return autocast(self.ctx.device, self.autocast_dtype)

    def _set_gradient_sync(self, enabled: bool) -> None:
        """FSDP2 reduce-scatters gradients only after the last micro-batch of a step."""
        if self.ctx.enabled and hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(enabled)

    def _last_good_checkpoint(self) -> str:
        """The newest checkpoint before this step's weights, in words: its weights gave finite steps."""
        found = [
            p
            for p in checkpoint.list_checkpoints(self.output_dir)
            if (checkpoint.checkpoint_step(p) or 0) < self.state.step
        ]
        if found:
            return f"the last good checkpoint is {found[-1]} (resume_from_checkpoint: latest picks it)"
        return (
            f"no checkpoint from before step {self.state.step + 1} is left to resume from: start again, e.g. "
            "with a lower learning_rate"
        )

    def _set_aside_diverged(self) -> str:
        """A checkpoint of the current weights (saved after the last step) holds the weights that just gave
        a non-finite loss: renamed ``checkpoint-<step>.diverged``, so that ``latest`` never resumes it.
        Returns the sentence that names it and the last good checkpoint."""
        diverged = self.output_dir / f"checkpoint-{self.state.step}"
        said = ""
        if self.state.step > 0 and (diverged / checkpoint.TRAINER_STATE).is_file():
            aside = diverged.with_name(f"{diverged.name}.diverged")
            if self.ctx.is_main:
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(diverged, aside)
            said = f"{diverged.name} holds the weights that gave it (set aside as {aside.name}); "
        return said + self._last_good_checkpoint()

    def _weights_finite(self) -> bool:
        """Whether every trainable weight is finite, on every rank (each checks its own shards)."""
        bad = 0
        with torch.no_grad():
            for parameter in self._trainable():
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                if not bool(torch.isfinite(local).all()):
                    bad = 1
                    break
        return int(all_reduce_sum(bad, self.ctx)) == 0

    def _warn_if_collapsed(self, loss: float, grad_norm: float) -> None:
        """Once per run: a zero gradient at loss ln V (V the vocabulary) is a model that predicts the
        uniform distribution and no longer learns (e.g. weights decayed or driven to zero)."""
        if self._warned_collapse or grad_norm != 0.0:
            return
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 2 or abs(loss - math.log(vocab)) > 1e-3 * math.log(vocab):
            return
        self._warned_collapse = True
        if self.ctx.is_main:
            warnings.warn(
                f"step {self.state.step + 1}: loss {loss:.4f} = ln {vocab} (uniform over the vocabulary) and "
                f"gradient norm 0: the run has collapsed and no longer learns; check learning_rate, "
                f"weight_decay and the data",
                UserWarning,
                stacklevel=3,
            )


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type, or nothing when ``dtype`` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _to(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def _accumulate(sums: dict[str, torch.Tensor], metrics: dict) -> None:
    for key, value in metrics.items():
        value = torch.as_tensor(value).detach().double().cpu()
        sums[key] = sums[key] + value if key in sums else value


def _token_count(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()
