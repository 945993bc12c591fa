"""CQL's own pure losses: the importance-sampled conservative gap, its penalty, the Lagrange
dual and the value of its three backups. ``E`` critics, ``B`` transitions, ``S`` sampled actions
per state. The TD, actor and temperature losses are SAC's
(:mod:`offaug.algorithms.learners.losses`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from offaug.algorithms.base import weighted_mean
from offaug.algorithms.nn.networks import ensemble_values

if TYPE_CHECKING:
    from offaug.algorithms.nn.networks import CriticEnsemble

ALPHA_MAX = 1e6
"""Upper clip of the conservative weight ``exp(log_alpha)`` (d3rlpy and the authors' code)."""


def conservative_gap(
    q_data: torch.Tensor, q_sampled: torch.Tensor, log_density: torch.Tensor
) -> torch.Tensor:
    """Per critic and state, ``log sum_a exp Q(s, a) - Q(s, a_data)``: ``(E, B)``.

    ``q_sampled`` ``(E, S, B)`` scores actions drawn from proposals with log-densities
    ``log_density`` ``(S, B)``; ``logsumexp(Q - log q)`` is the importance-sampled estimate.
    """
    return torch.logsumexp(q_sampled - log_density, dim=1) - q_data


def original_rows_gap(
    gap: torch.Tensor,
    q_data: torch.Tensor,
    weights: torch.Tensor | None,
    set_index: torch.Tensor,
) -> torch.Tensor:
    """The gap of COMBO's penalty (Yu et al. 2021, eq. 2): the log-sum-exp pushed down at every
    row's state, ``Q`` pushed up on the original data's rows (source 0) only, ``(E, B)``.

    Per row ``w_i * lse_i - u_i * Q(s_i, a_i)``, where ``u`` keeps the original rows' weights
    rescaled to average 1 over the batch: its plain mean is ``E_w[lse] - E_original[Q]``, so it
    goes to :func:`conservative_penalty` and :func:`alpha_loss` with ``weights=None``. With only
    original rows it is ``gap`` (times the weights). Augmented rows then teach the critics their
    transitions by TD without their actions counting as the data's (which CQL's own penalty
    raises, pulling the policy towards the rollout policy's noisy actions).
    """
    original = (set_index == 0).to(gap.dtype)
    up = original if weights is None else original * weights
    up = up * (up.numel() / up.sum().clamp_min(torch.finfo(gap.dtype).tiny))
    log_sum_exp = gap + q_data
    down = log_sum_exp if weights is None else log_sum_exp * weights
    return down - q_data * up


def conservative_penalty(
    gap: torch.Tensor,
    weights: torch.Tensor | None,
    conservative_weight: float,
    threshold: float,
) -> torch.Tensor:
    """``conservative_weight * (E_w[gap] - threshold)`` summed over the ``E`` critics.

    The threshold only shifts the value (it matters to the Lagrange form, not to the critics).
    """
    critics = gap.shape[0]
    return conservative_weight * (weighted_mean(gap.sum(0), weights) - critics * threshold)


def alpha_loss(
    log_alpha: torch.Tensor,
    gap: torch.Tensor,
    weights: torch.Tensor | None,
    conservative_weight: float,
    threshold: float,
) -> torch.Tensor:
    """Dual loss of the Lagrange form: ``-alpha * conservative_weight * (gap - threshold)``.

    Averaged over critics; descending it raises alpha while the gap is above ``threshold``.
    """
    alpha = log_alpha.exp().clamp(0.0, ALPHA_MAX)
    gap_mean = weighted_mean(gap.detach().mean(0), weights)
    return -alpha * conservative_weight * (gap_mean - threshold)


def backup_values(
    backup: Literal["mean", "soft", "max"],
    critic_target: CriticEnsemble,
    next_obs: torch.Tensor,
    next_mean: torch.Tensor,
    next_sampled: torch.Tensor,
    next_log_prob: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """``V(s')`` of the chosen backup: ``(B,)``. ``next_sampled`` is ``(n + 1, B, act)`` policy
    actions at ``s'`` and ``next_log_prob`` ``(n + 1, B)`` their log-densities."""
    if backup == "mean":
        action = torch.tanh(next_mean)
        return ensemble_values(critic_target, next_obs, action).min(0).values
    if backup == "soft":
        q_next = ensemble_values(critic_target, next_obs, next_sampled[0])
        return q_next.min(0).values - temperature * next_log_prob[0]
    n, batch_size, act_dim = next_sampled[1:].shape
    # (n, B, obs) -> (n * B, obs); the actions likewise.
    repeated = next_obs.unsqueeze(0).expand(n, -1, -1).reshape(-1, next_obs.shape[-1])
    q_next = ensemble_values(critic_target, repeated, next_sampled[1:].reshape(-1, act_dim))
    return q_next.view(-1, n, batch_size).min(0).values.max(0).values  # (E, n, B) -> (B,)
