"""The engine's built-in behaviour, written as callbacks: metrics to JSONL, a progress bar, TensorBoard
and Weights & Biases when asked for, early stopping, and the loss-curve PNG at the end. Only the main
process writes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

from fastalign.train.checkpoint import DiskFullError, is_disk_full
from fastalign.train.engine import Callback, Engine


def _finite_or_null(value):
    """``value`` with each float that is NaN or infinite as None, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(item) for item in value]
    return value


class JsonlMetrics(Callback):
    """One JSON object per logging step (and per evaluation) in ``<output_dir>/metrics.jsonl``; a value
    that is not a finite number (a reward no function gave, a loss that diverged) is null, as JSON has no
    NaN (Python's ``json`` writes one that other readers refuse).

    A run resumed from step N continues the file: the rows a crashed run wrote after step N (and a line
    cut short by a kill) are dropped first, so each step is logged once."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_begin(self, engine: Engine) -> None:
        if engine.ctx.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_jsonl_after(self.path, engine.state.step)

    def _write(self, engine: Engine, record: dict) -> None:
        if engine.ctx.is_main:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
            except OSError as error:
                if not is_disk_full(error):
                    raise
                raise DiskFullError(
                    f"no space left on device while logging step {record.get('step')} to {self.path}"
                ) from None

    def on_log(self, engine: Engine, logs: dict) -> None:
        self._write(engine, logs)

    def on_evaluate(self, engine: Engine, metrics: dict) -> None:
        self._write(engine, metrics)


#: The objectives' headline metrics, shown beside the loss when a run logs them: (key, label, format).
HEADLINE_METRICS = (
    ("rewards/accuracies", "acc", "{:.2f}"),
    ("rewards/margins", "margin", "{:.3f}"),
    ("reward", "reward", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
)


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Drop the rows of a per-step JSONL log (``"step"`` in each) after ``step``, and any line cut short
    by a kill: a run resumed from step N then logs steps N+1... once, as the unbroken run did."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if _logged_step(line) is not None and _logged_step(line) <= step]
    if kept == lines:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _logged_step(line: str) -> int | None:
    """The step of a JSONL log's row, or None for a line that is not one (e.g. cut short by a kill)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class ProgressBar(Callback):
    """A tqdm bar over the steps with the latest loss, the objective's headline metrics (DPO's reward
    accuracy, GRPO's mean reward, ...), tokens/s and memory: the first process's (``tqdm.write`` prints
    with the bar disabled too, so the other ranks' lines are left out here)."""

    def on_train_begin(self, engine: Engine) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=engine.schedule.max_steps,
            initial=engine.state.step,
            disable=not engine.ctx.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )

    def on_step_end(self, engine: Engine, metrics: dict) -> None:
        self.bar.update(1)

    def on_log(self, engine: Engine, logs: dict) -> None:
        shown = {"loss": f"{logs['loss']:.4f}"}
        shown |= {label: form.format(logs[key]) for key, label, form in HEADLINE_METRICS if key in logs}
        shown["tok/s"] = f"{logs['tokens_per_second']:,.0f}"
        if "mfu" in logs:
            shown["mfu"] = f"{logs['mfu']:.1%}"
        shown["mem"] = f"{logs['peak_memory_gib']:.2f}GiB"
        self.bar.set_postfix(shown, refresh=False)
        if engine.ctx.is_main:
            self.bar.write(f"step {logs['step']}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))

    def on_evaluate(self, engine: Engine, metrics: dict) -> None:
        if engine.ctx.is_main:
            self.bar.write(f"step {metrics['step']}: eval_loss {metrics['eval_loss']:.4f}")

    def on_train_end(self, engine: Engine) -> None:
        self.bar.close()

    def on_train_error(self, engine: Engine, error: BaseException) -> None:
        self.bar.close()  # so that the error is printed on a line of its own


class TensorBoardMetrics(Callback):
    """Scalars under ``<output_dir>/runs`` (needs the tensorboard package)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)

    def on_train_begin(self, engine: Engine) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # events an earlier (crashed) run logged after this run's start step are dropped, as in metrics.jsonl
        purge = engine.state.step + 1
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge) if engine.ctx.is_main else None

    def on_log(self, engine: Engine, logs: dict) -> None:
        if self.writer:
            for key, value in logs.items():
                if key != "step":
                    self.writer.add_scalar(f"train/{key}", value, logs["step"])

    def on_evaluate(self, engine: Engine, metrics: dict) -> None:
        if self.writer:
            self.writer.add_scalar("eval/loss", metrics["eval_loss"], metrics["step"])

    def on_train_end(self, engine: Engine) -> None:
        if self.writer:
            self.writer.close()

    def on_train_error(self, engine: Engine, error: BaseException) -> None:
        self.on_train_end(engine)  # what was logged reaches the event file


class WandbMetrics(Callback):
    """Logs to Weights & Biases (needs the wandb package; its usual environment variables apply)."""

    def __init__(self, config: dict):
        self.config = config

    def on_train_begin(self, engine: Engine) -> None:
        import wandb

        self.run = wandb.init(config=self.config) if engine.ctx.is_main else None

    def on_log(self, engine: Engine, logs: dict) -> None:
        if self.run:
            self.run.log({f"train/{k}": v for k, v in logs.items() if k != "step"}, step=logs["step"])

    def on_evaluate(self, engine: Engine, metrics: dict) -> None:
        if self.run:
            self.run.log({"eval/loss": metrics["eval_loss"]}, step=metrics["step"])

    def on_train_end(self, engine: Engine) -> None:
        if self.run:
            self.run.finish()


class EarlyStopping(Callback):
    """Stops when the eval loss has not improved by ``min_delta`` for ``patience`` evaluations."""

    def __init__(self, patience: int = 3, min_delta: float = 0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = math.inf, 0

    def on_evaluate(self, engine: Engine, metrics: dict) -> None:
        if metrics["eval_loss"] < self.best - self.min_delta:
            self.best, self.bad = metrics["eval_loss"], 0
        else:
            self.bad += 1
            engine.should_stop = self.bad >= self.patience


class LossCurve(Callback):
    """``loss_curve.png`` of the logged training (and eval) loss at the end (needs matplotlib); beside it
    the mean reward where the objective logs one (GRPO, RLOO, online DPO, PPO): their loss starts at 0 by
    construction (the policy equals its old self), so the reward is what shows learning."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_train_end(self, engine: Engine) -> None:
        if not engine.ctx.is_main:
            return
        if importlib.util.find_spec("matplotlib") is None:
            print(f"loss curve not written: matplotlib is not installed ({self.path})")
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        history = engine.state.log_history
        train = [(h["step"], h["loss"]) for h in history if "loss" in h]
        evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
        rewards = [(h["step"], h["reward"]) for h in history if "reward" in h]
        fig, axes = plt.subplots(1, 2 if rewards else 1, figsize=(11 if rewards else 6, 4), squeeze=False)
        panels = [(axes[0][0], "loss", ((train, "train loss"), (evals, "eval loss")))]
        if rewards:
            panels.append((axes[0][1], "reward", ((rewards, "mean reward"),)))
        for ax, ylabel, series in panels:
            for points, label in series:
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=label)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
            ax.set_ylabel(ylabel)
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.path, dpi=120)
        plt.close(fig)
