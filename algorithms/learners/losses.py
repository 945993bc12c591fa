"""Loss pieces that several learners share, each written once.

``E`` critics, ``B`` transitions. Every loss is a weighted mean over the batch
(:func:`~offaug.algorithms.base.weighted_mean`), so importance-weighted data weights it per row.

* :func:`td_target`: the one-step bootstrap target of CQL, BCQ and their discrete forms;
* :func:`ensemble_td_loss`: the squared TD error summed over an ensemble of critics
  (SAC, CQL, BCQ);
* :func:`soft_actor_loss` and :func:`temperature_loss`: SAC's policy and entropy-temperature
  losses (Haarnoja et al. 2018, arXiv:1812.05905, eqs. 7 and 18), which CQL reuses.
"""

from __future__ import annotations

import torch

from offaug.algorithms.base import weighted_mean
from offaug.algorithms.fusing import per_member


def td_target(
    rewards: torch.Tensor,
    terminals: torch.Tensor,
    next_values: torch.Tensor,
    gamma: float | torch.Tensor,
) -> torch.Tensor:
    """``r + gamma * (1 - terminal) * V(s')``: ``(B,) -> (B,)``. A timeout is not a terminal."""
    return rewards + per_member(gamma, rewards) * (1.0 - terminals) * next_values


def ensemble_td_loss(
    q_values: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """Squared TD error summed over critics, weighted mean over the batch.

    ``q_values`` ``(E, B)``, ``targets`` ``(B,)`` (no gradient); critics are counted from the end,
    so a stacked run's ``(K, E, B)`` and ``(K, B)`` give ``(K,)``.
    """
    return weighted_mean((q_values - targets.unsqueeze(-2)).pow(2).sum(-2), weights)


def soft_actor_loss(
    q_values: torch.Tensor,
    log_prob: torch.Tensor,
    temperature: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """SAC's policy loss ``temperature * log pi(a|s) - min_e Q_e(s, a)``, ``a ~ pi(.|s)``.

    ``q_values`` ``(E, B)``, ``log_prob`` ``(B,)``, ``temperature`` a detached scalar or ``(1,)``.
    """
    # min().values: its backward is one scatter, amin's spreads over ties in six ops.
    return weighted_mean(temperature * log_prob - q_values.min(dim=0).values, weights)


def soft_bc_actor_loss(
    data_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    temperature: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """SAC's policy loss with the data's log-likelihood in place of ``Q``:
    ``temperature * log pi(a~|s) - log pi(a|s)``, ``a~ ~ pi(.|s)`` and ``a`` the data's action
    (CQL's behaviour-cloning warm start, the authors' ``policy_eval_start``).

    ``data_log_prob`` and ``log_prob`` ``(B,)``, ``temperature`` a detached scalar or ``(1,)``.
    """
    return weighted_mean(temperature * log_prob - data_log_prob, weights)


def temperature_loss(
    log_temperature: torch.Tensor,
    log_prob: torch.Tensor,
    target_entropy: float,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``-temperature * (log pi(a|s) + target_entropy)``: raises it while entropy is too low.

    No gradient reaches the policy.
    """
    return weighted_mean(-log_temperature.exp() * (log_prob.detach() + target_entropy), weights)
