"""The training loop: one optimizer step at a time, whatever the objective.

A step: this rank's micro-batches (which an objective may first turn into training batches, e.g. by
generating completions); the loss-term count of all of them on all ranks (so each micro-batch's loss is
its share of the accumulated batch's mean: exact gradient accumulation); forward and backward of each
(gradient sync only on the last under FSDP2); a non-finite check; clipping; optimizer and scheduler
step; on the CPU, the step's freed heap memory handed back to the OS (``host_memory``). The objective's
metrics are summed like its loss, so they too are means over the whole step.

A run that diverges ends with a one-line ``NonFiniteLossError`` (a ValueError) naming a checkpoint that
trains on: weights that are not finite are never saved, and the checkpoint holding the weights that gave
a non-finite loss is set aside as ``checkpoint-<step>.diverged`` (``resume_from_checkpoint: latest``
would only diverge again). A run that collapses (loss ln V, gradient norm 0) trains on, with a warning.

When to log, evaluate and save is transformers' (``Schedule``): each of them "no", every N "steps", or
at each "epoch"'s end, and under "steps" and "epoch" also at the run's last step (an evaluation before the
first step with ``eval_on_start``). With ``load_best_model_at_end`` each checkpoint's evaluation is
compared on ``metric_for_best_model``; the best checkpoint outlives ``save_total_limit``, and its weights
are loaded when the run ends, so that the exported model is the best one.

fp16 autocast trains with a gradient scaler, as transformers: the loss is scaled up before backward and the
gradients unscaled before clipping; a step whose gradients overflow is skipped (no optimizer or scheduler
step) and the scale halves.

A checkpoint holds the model, the optimizer, the RNG, the data position, the gradient scaler and the
objective's own state (``Objective.state_dict``, e.g. TR-DPO's synced reference, and
``Objective.pending_state``, e.g. the generation GRPO's next steps still train on), so a run resumed from
any checkpoint continues exactly.
Where metrics go (JSONL, progress bar, TensorBoard, W&B) and anything else users add are callbacks
(``fastalign.train.callbacks``), so behaviour is added without editing the loop.
"""

from __future__ import annotations

import contextlib
import copy
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

from fastalign.ops import cpu_gemm
from fastalign.ops.cpu_gemm import LOW_PRECISION, cpu_gemms
from fastalign.train import checkpoint, host_memory
from fastalign.train.batches import FILLER_KEY, BatchPosition, batch_tokens
from fastalign.train.config import ConfigError
from fastalign.train.distributed import DistributedContext, all_reduce_sum
from fastalign.train.metrics import peak_memory_gib

if TYPE_CHECKING:  # objectives import the engine's Callback and autocast
    from fastalign.train.config import TrainConfig
    from fastalign.train.objectives.base import BatchSource, Objective


class NonFiniteLossError(RuntimeError, ValueError):
    """A step produced a NaN/inf loss or gradient (no optimizer step was taken), or the weights became
    non-finite (they were not saved). A ValueError too: ``fastalign train`` prints it as one line."""


@dataclass
class TrainerState:
    """Where the run is: everything besides tensors that a checkpoint restores."""

    step: int = 0
    position: BatchPosition = field(default_factory=BatchPosition)
    tokens_seen: int = 0  # trained on (every pass over a reused generation counts): throughput
    num_tokens: int = 0  # TRL's ``num_tokens``, logged as it is: ``Objective.num_tokens`` summed
    scheduler: dict = field(default_factory=dict)
    scaler: dict = field(default_factory=dict)  # fp16's gradient scaler: its scale and growth count
    log_history: list[dict] = field(default_factory=list)
    best_metric: float | None = None  # load_best_model_at_end: the best checkpoint's metric and step
    best_step: int | None = None
    # the steps since the last log line (their summed loss, tokens, seconds and objective metrics): a run
    # resumed between two log lines logs the same means as one that was never stopped
    log_window: dict = field(default_factory=dict)
    # on a CPU under bf16/fp16: whether the run's GEMMs are fp32 ones (``fastalign.ops.cpu_gemm``), decided
    # by timing when it began and kept from then on (the two round differently)
    fp32_gemms: bool | None = None

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
    """When the engine logs, evaluates and saves: transformers' strategies ("no", "steps", "epoch"), with
    the step counts resolved (``from_config``). ``best_metric`` (an evaluation metric, e.g. "eval_loss"):
    the checkpoint best by it is kept and loaded at the end (``load_best_model_at_end``)."""

    max_steps: int
    max_grad_norm: float = 1.0
    logging_strategy: str = "steps"
    logging_steps: int = 10
    eval_strategy: str = "no"
    eval_steps: int = 10
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    eval_on_start: bool = False
    best_metric: str | None = None
    greater_is_better: bool = False

    @classmethod
    def from_config(cls, config: TrainConfig, max_steps: int) -> Schedule:
        """A ratio below 1 is a share of ``max_steps``, rounded up; ``eval_steps`` None is
        ``logging_steps``; ``metric_for_best_model`` gets its "eval_" prefix, and ``greater_is_better``
        its default: false for a metric ending in "loss" (as transformers)."""

        def steps(value: float) -> int:
            return math.ceil(max_steps * value) if value < 1 else int(value)

        metric = config.metric_for_best_model or "loss"
        greater = config.greater_is_better
        return cls(
            max_steps,
            config.max_grad_norm,
            config.logging_strategy,
            steps(config.logging_steps),
            config.eval_strategy,
            steps(config.eval_steps if config.eval_steps is not None else config.logging_steps),
            config.save_strategy,
            steps(config.save_steps),
            config.save_total_limit,
            config.eval_on_start,
            best_metric=(metric if metric.startswith("eval_") else f"eval_{metric}")
            if config.load_best_model_at_end
            else None,
            greater_is_better=greater if greater is not None else not metric.endswith("loss"),
        )

    def due(self, kind: str, step: int, epoch_ended: bool, last: bool) -> bool:
        """Whether ``kind`` ("logging", "eval", "save") acts after ``step``: every ``<kind>_steps`` steps
        or at each epoch's end, and at the run's last step (unless its strategy is "no")."""
        strategy = getattr(self, f"{kind}_strategy")
        if strategy == "steps":
            return last or step % getattr(self, f"{kind}_steps") == 0
        return strategy == "epoch" and (last or epoch_ended)


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
        self.eval_batches, self.callbacks = eval_batches, list(callbacks)  # eval batches: collated when read
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.autocast_dtype = autocast_dtype  # single process: fp32 weights, bf16 or fp16 matmuls
        # the dtype the GEMMs run in: autocast's, else low-precision weights' (dtype: bfloat16)
        self.gemm_dtype = autocast_dtype or next(
            (p.dtype for p in model.parameters() if p.dtype in LOW_PRECISION), None
        )
        # fp16's narrow range underflows small gradients unless the loss is scaled up (bf16 needs none)
        self.scaler = torch.amp.GradScaler(self.ctx.device.type) if autocast_dtype == torch.float16 else None
        self.run_config = run_config  # saved in each checkpoint: what a resume is checked against
        self.state = TrainerState(fp32_gemms=self._fp32_gemms())
        self.should_stop = False
        self._warned_collapse = False
        self._reset_window()

    # ---------------------------------------------------------------------------------------------
    def resume(self, path: str | Path) -> None:
        objective_state = self.objective.state_dict()  # loaded in place
        data = checkpoint.load_checkpoint(path, self.model, self.optimizer, self.ctx, objective_state)
        self.objective.load_state_dict(objective_state)
        checkpoint.load_pending(path, self.ctx, self.objective.load_pending_state)
        measured = self.state.fp32_gemms
        self.state = TrainerState.from_dict(data)
        if self.state.fp32_gemms is None:  # a checkpoint saved before the decision was kept
            self.state.fp32_gemms = measured
        elif self.gemm_dtype in LOW_PRECISION:
            cpu_gemm.pin_low_precision_gemm(self.gemm_dtype, self.state.fp32_gemms)
        self.scheduler.load_state_dict(self.state.scheduler)
        if self.state.log_window:  # a checkpoint saved before log_window was kept has none
            self._window = copy.deepcopy(self.state.log_window)
        if self.scaler is not None and self.state.scaler:
            self.scaler.load_state_dict(self.state.scaler)

    def save(self) -> Path:
        """``checkpoint-<step>``, unless the weights are not finite (then ``NonFiniteLossError``)."""
        if not self._weights_finite():
            raise NonFiniteLossError(
                f"step {self.state.step}: the weights are not finite after the optimizer step, so they were "
                f"not saved as checkpoint-{self.state.step}; {self._last_good_checkpoint()}"
            )
        self._note_best()
        self.state.scheduler = self.scheduler.state_dict()
        self.state.scaler = self.scaler.state_dict() if self.scaler is not None else {}
        self.state.log_window = copy.deepcopy(self._window)
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
            best=self.best_checkpoint(),
            pending=self.objective.pending_state(),
        )
        self._call("on_save", path)
        return path

    def train(self) -> TrainerState:
        """Steps to ``max_steps`` (or a callback's ``should_stop``), logging, evaluating and saving as the
        schedule says; then, with ``load_best_model_at_end``, the best checkpoint's weights."""
        self.model.train()
        self._call("on_train_begin")
        try:
            if self.schedule.eval_on_start and self.state.step == 0:
                self.evaluate()
            while self.state.step < self.schedule.max_steps and not self.should_stop:
                metrics = self.train_step()
                self._call("on_step_end", metrics)
                self._log_evaluate_save()
        except BaseException as error:
            for callback in self.callbacks:
                with contextlib.suppress(Exception):  # the error that ended the run is the one to report
                    callback.on_train_error(self, error)
            raise
        best = self.best_checkpoint()
        if self.schedule.save_strategy != "no":  # the run did not diverge: save_total_limit is enough
            checkpoint.prune_checkpoints(self.output_dir, self.schedule.save_total_limit, self.ctx, best=best)
        if best is not None:
            checkpoint.load_model_weights(best, self.model)
        elif self.state.best_step is not None:
            warnings.warn(
                f"load_best_model_at_end: the best checkpoint, checkpoint-{self.state.best_step}, is not in "
                f"{self.output_dir} (deleted?): the model of the last step is kept",
                UserWarning,
                stacklevel=2,
            )
        self._call("on_train_end")
        return self.state

    def best_checkpoint(self) -> Path | None:
        """The checkpoint best by ``metric_for_best_model`` so far, if it (still) exists."""
        if self.state.best_step is None:
            return None
        path = self.output_dir / f"checkpoint-{self.state.best_step}"
        return path if path.is_dir() else None

    def _log_evaluate_save(self) -> None:
        """After a step: log, evaluate, save, each when its strategy says (a callback that sets
        ``should_stop``, even during the evaluation, makes this the last step)."""
        step, epoch_ended = self.state.step, self.state.position.step_in_epoch == 0

        def due(kind: str) -> bool:
            last = step >= self.schedule.max_steps or self.should_stop
            return self.schedule.due(kind, step, epoch_ended, last)

        if due("logging"):
            self._log()
        if due("eval"):
            self.evaluate()
        if due("save"):
            self.save()

    def _note_best(self) -> None:
        """Before a save: whether this step's evaluation makes its checkpoint the best (a step count or
        ratio that lets a checkpoint go unevaluated is refused by the config checks)."""
        metric = self.schedule.best_metric
        evaluation = next((row for row in reversed(self.state.log_history) if "eval_loss" in row), None)
        if metric is None or evaluation is None or evaluation["step"] != self.state.step:
            return
        value, best = evaluation[metric], self.state.best_metric
        if best is None or (value > best if self.schedule.greater_is_better else value < best):
            self.state.best_metric, self.state.best_step = value, self.state.step

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
            scaled = loss * self.ctx.world_size
            with cpu_gemms(self.ctx.device, self.gemm_dtype):
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            loss_sum += loss.detach().double().cpu()
            _accumulate(objective_sums, metrics)
        loss_value = float(all_reduce_sum(loss_sum, self.ctx))
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trainable(), self.schedule.max_grad_norm))
        # fp16: gradients that overflow are the scaler's to handle (it skips the step); a loss is not
        if not (math.isfinite(loss_value) and (math.isfinite(grad_norm) or self.scaler is not None)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"step {self.state.step + 1}: loss {loss_value}, gradient norm {grad_norm}: not finite; "
                f"stopped without updating the model; {self._set_aside_diverged()}"
            )
        self._warn_if_collapsed(loss_value, grad_norm)
        learning_rate = self.scheduler.get_last_lr()[0]
        if self.scaler is None:
            self.optimizer.step()
            self.scheduler.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when the unscaled gradients are not finite
            self.scaler.update()  # halves the scale after a skipped step
            if self.scaler.get_scale() >= scale:  # as transformers: no scheduler step for a skipped one
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.device.type == "cpu":
            host_memory.release_freed_host_memory()  # the step's freed tensors, off the resident set
        local = [
            sum(batch_tokens(batch) for batch in micro_batches),
            self.objective.num_tokens(micro_batches),
        ]
        tokens, counted = (int(value) for value in all_reduce_sum(torch.tensor(local), self.ctx).tolist())
        self.state.step += 1
        self.state.position = self.batches.advance(self.state.position)
        self.state.tokens_seen += tokens
        self.state.num_tokens += counted
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
            self._window["objective"][key] = self._window["objective"].get(key, 0.0) + float(value)
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
        if self.schedule.best_metric is not None and self.schedule.best_metric not in metrics:
            raise ConfigError(
                f"config key 'metric_for_best_model': {self.schedule.best_metric!r} is not an evaluation "
                f"metric of this run; its metrics: {', '.join(key for key in metrics if key != 'step')}"
            )
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
            "num_tokens": self.state.num_tokens,
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

    def _fp32_gemms(self) -> bool | None:
        """Whether this run's low-precision GEMMs on a CPU are fp32 ones (None: not a CPU run in bf16/fp16),
        decided once for all ranks (any rank's slow native GEMMs make them fp32 on every rank) and pinned."""
        if self.ctx.device.type != "cpu" or self.gemm_dtype not in LOW_PRECISION:
            return None
        slow = cpu_gemm.low_precision_gemm_is_slow(self.gemm_dtype)
        if self.ctx.world_size > 1:
            slow = bool(all_reduce_sum(torch.tensor(float(slow), dtype=torch.float64), self.ctx) > 0)
        cpu_gemm.pin_low_precision_gemm(self.gemm_dtype, slow)
        return slow

    def _autocast(self) -> contextlib.ExitStack:
        """Autocast, and fp32 GEMMs where this CPU's low-precision ones are slow (the backward pass
        takes the latter too: ``fastalign.ops.cpu_gemm``)."""
        return autocast(self.ctx.device, self.autocast_dtype, self.gemm_dtype)

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


def autocast(
    device: torch.device, dtype: torch.dtype | None, gemm_dtype: torch.dtype | None = None
) -> contextlib.ExitStack:
    """``torch.autocast`` to ``dtype`` on ``device``'s type (none when ``dtype`` is None), with fp32
    GEMMs where this CPU's ``gemm_dtype`` (default ``dtype``) ones are slow (``fastalign.ops.cpu_gemm``)."""
    stack = contextlib.ExitStack()
    if dtype is not None:
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
    stack.enter_context(cpu_gemms(device, gemm_dtype or dtype))
    return stack


def _to(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def _accumulate(sums: dict[str, torch.Tensor], metrics: dict) -> None:
    for key, value in metrics.items():
        value = torch.as_tensor(value).detach().double().cpu()
        sums[key] = sums[key] + value if key in sums else value
