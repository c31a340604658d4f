"""loss_curve.png: the loss, and the mean reward where the objective logs one, over whole-number steps."""

from types import SimpleNamespace

import pytest

from fastalign.train.callbacks import LossCurve

pytest.importorskip("matplotlib")


def _figure(tmp_path, monkeypatch, history):
    from matplotlib.figure import Figure

    saved = {}
    original = Figure.savefig

    def savefig(self, path, **kwargs):
        saved["figure"] = self
        return original(self, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    engine = SimpleNamespace(ctx=SimpleNamespace(is_main=True), state=SimpleNamespace(log_history=history))
    LossCurve(tmp_path / "loss_curve.png").on_train_end(engine)
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    return saved["figure"]


def test_a_sampling_objective_plots_its_reward_beside_its_loss(tmp_path, monkeypatch):
    history = [{"step": step, "loss": 0.0, "reward": 0.1 * step} for step in range(1, 4)]
    figure = _figure(tmp_path, monkeypatch, history)
    assert [ax.get_ylabel() for ax in figure.axes] == ["loss", "reward"]
    for ax in figure.axes:
        ticks = [tick for tick in ax.get_xticks() if 1 <= tick <= 3]
        assert ticks and all(float(tick).is_integer() for tick in ticks)


def test_an_objective_without_a_reward_plots_its_loss_alone(tmp_path, monkeypatch):
    history = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "eval_loss": 1.6}]
    figure = _figure(tmp_path, monkeypatch, history)
    assert [ax.get_ylabel() for ax in figure.axes] == ["loss"]
