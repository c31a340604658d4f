"""``optim``, ``lr_scheduler_type``/``lr_scheduler_kwargs`` and ``warmup_steps`` as transformers'
``TrainingArguments`` define them: every optimizer name trains, weight decay skips biases and norms as
``Trainer`` does, every schedule name builds with the warmup kept, and bad keywords are one-line errors."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from fastalign.builtin import tiny_model
from fastalign.train.config import LR_SCHEDULERS, OPTIMIZERS, ConfigError, TrainConfig, load_config
from fastalign.train.optim import MAKERS, build_optimizer, build_scheduler, check_schedule, warmup_steps


def test_every_optimizer_name_has_a_maker():
    assert set(OPTIMIZERS) == set(MAKERS)


def _steps(optim: str, steps: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model("llama")
    optimizer = build_optimizer(model, TrainConfig(optim=optim, learning_rate=1e-3, weight_decay=0.1))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_every_optimizer_trains(optim):
    torch.manual_seed(0)
    before = tiny_model("llama").state_dict()
    after = _steps(optim).state_dict()
    assert all(torch.isfinite(value).all() for value in after.values())
    assert any(not torch.equal(before[name], value) for name, value in after.items())


def test_fused_and_unfused_adamw_agree():
    fused, plain = _steps("adamw_torch_fused").state_dict(), _steps("adamw_torch").state_dict()
    for name, value in fused.items():
        torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_weight_decay_skips_biases_and_norms_as_trainer_does():
    model = tiny_model("qwen2")  # q/k/v biases and RMSNorms
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1, learning_rate=1e-3))
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] for p in group["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in decayed}
    own = {name for name, _ in model.named_parameters()}  # a tied head is the embedding's parameter
    assert names == set(Trainer.get_decay_parameter_names(None, model)) & own
    assert any("bias" in name for name, _ in model.named_parameters()) and not any("bias" in n for n in names)


def _rates(scheduler, optimizer, steps: int = 10) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name", LR_SCHEDULERS)
def test_every_schedule_builds_and_keeps_the_warmup(name):
    kwargs = {
        "cosine_with_min_lr": {"min_lr_rate": 0.1},
        "cosine_warmup_with_min_lr": {"min_lr_rate": 0.1},
        "warmup_stable_decay": {"num_decay_steps": 2},
    }.get(name)
    config = TrainConfig(
        lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=4, learning_rate=1.0
    )
    if name == "constant":  # transformers' constant has no warmup: a warmup with it is refused
        with pytest.raises(
            ConfigError, match="config key 'warmup_steps': lr_scheduler_type 'constant' has no"
        ):
            check_schedule(config)
        return
    check_schedule(config)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    rates = _rates(build_scheduler(optimizer, config, max_steps=10), optimizer)
    # a 4-step linear warmup (each schedule starts it at 0 or at 1/4: transformers' own choice)
    assert rates[0] <= 0.25 + 1e-9 and rates[0] < rates[1] < rates[2] < rates[3] <= 1.0


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup"])
def test_keywords_a_constant_schedule_would_drop_are_refused(name):
    """transformers' ``get_scheduler`` drops ``lr_scheduler_kwargs`` for both constant schedules (any key,
    even a misspelt one); ``constant`` is transformers' own: the rate from the first step."""
    with pytest.raises(ConfigError, match=f"lr_scheduler_type '{name}' takes none"):
        check_schedule(TrainConfig(lr_scheduler_type=name, lr_scheduler_kwargs={"num_cycles": 2}))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    config = TrainConfig(lr_scheduler_type="constant", learning_rate=1.0)
    assert _rates(build_scheduler(optimizer, config, max_steps=4), optimizer, steps=4) == [1.0] * 4


def test_warmup_steps_below_one_is_a_ratio():
    assert warmup_steps(TrainConfig(warmup_steps=0.25), max_steps=40) == 10
    assert warmup_steps(TrainConfig(warmup_steps=3), max_steps=40) == 3
    assert warmup_steps(TrainConfig(warmup_ratio=0.1), max_steps=40) == 4


@pytest.mark.parametrize(("ratio", "max_steps"), [(0.1, 15), (0.3, 5), (0.01, 10), (0.5, 7)])
def test_a_warmup_ratio_rounds_up_as_transformers(ratio, max_steps):
    from transformers import TrainingArguments

    expected = TrainingArguments(output_dir="unused", warmup_steps=ratio).get_warmup_steps(max_steps)
    assert warmup_steps(TrainConfig(warmup_steps=ratio), max_steps) == expected
    assert warmup_steps(TrainConfig(warmup_ratio=ratio), max_steps) == expected


def test_cosine_with_min_lr_reaches_its_floor_from_a_flag():
    config = load_config(
        None,
        [
            "--lr_scheduler_type",
            "cosine_with_min_lr",
            "--lr_scheduler_kwargs",
            '{"min_lr_rate": 0.1}',
            "--learning_rate",
            "1.0",
        ],
    )
    assert config.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = build_scheduler(optimizer, config, max_steps=10)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1)


def test_a_keyword_the_schedule_does_not_take_is_named_before_any_model_work():
    config = TrainConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs={"min_lr": 0.1})
    with pytest.raises(
        ConfigError, match=r"^config key 'lr_scheduler_kwargs' \(\{'min_lr': 0.1\}\) does not fit"
    ):
        check_schedule(config)


def test_lr_scheduler_kwargs_must_be_a_mapping():
    with pytest.raises(ConfigError, match="must be a mapping of names to values"):
        load_config(None, ["--lr_scheduler_kwargs", "min_lr_rate=0.1"])
