"""The reward model's loss, TRL's ``RewardTrainer``: Bradley–Terry on the scores of preference pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """[P] each pair's loss term: −log σ(r_chosen − r_rejected − margin), the negative log-likelihood of
    the preference under the Bradley–Terry model (``margin``: how far apart the pair should be scored,
    e.g. from a rating gap; none: 0), plus ``center_rewards_coefficient`` · (r_chosen + r_rejected)²,
    which keeps the rewards centred at zero (Eisenstein et al. 2023, Eq. 2; TRL adds the mean of it).
    Their mean over the pairs is TRL's loss."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    terms = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        terms = terms + center_rewards_coefficient * (chosen + rejected) ** 2
    return terms


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """TRL's ``RewardTrainer`` metrics of one batch's scores (detached): ``accuracy`` (share of pairs scored
    the right way round, strictly), ``margin`` (mean r_chosen − r_rejected), and ``min_reward``,
    ``mean_reward``, ``max_reward`` over every score, chosen and rejected."""
    with torch.no_grad():
        scores = torch.cat([chosen, rejected])
        return {
            "accuracy": (chosen > rejected).float().mean(),
            "margin": (chosen - rejected).mean(),
            "min_reward": scores.min(),
            "mean_reward": scores.mean(),
            "max_reward": scores.max(),
        }
