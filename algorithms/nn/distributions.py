"""Action distributions and the action box: the one home of the truncated normal, of the
tanh-squashed Gaussian and of the map between an environment's action bounds and the
normalised box ``[-1, 1]^d``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from offaug.algorithms.nn.truncated_normal import LOG_SQRT_2PI as LOG_SQRT_2PI  # the learners' name
from offaug.algorithms.nn.truncated_normal import ArrayOps
from offaug.algorithms.nn.truncated_normal import (
    truncated_normal_log_prob as _truncated_normal_log_prob,
)

if TYPE_CHECKING:
    from offaug.algorithms.base import Spaces

TORCH_OPS = ArrayOps(
    exp=torch.exp,
    log=torch.log,
    log1p=torch.log1p,
    where=torch.where,
    ndtr=torch.special.ndtr,
    log_ndtr=torch.special.log_ndtr,
    clamp=torch.clamp,
    any=lambda _: True,  # no data-dependent branch: compiled losses and GPUs never sync here
)


def truncated_normal_log_prob(
    actions: torch.Tensor,
    mean: torch.Tensor,
    log_std: torch.Tensor,
    low: float = -1.0,
    high: float = 1.0,
) -> torch.Tensor:
    """Log-density of a Gaussian truncated to ``[low, high]^d``, summed over the last axis.

    ``log N(a; m, s) - log(Phi((high - m)/s) - Phi((low - m)/s))`` per dimension
    (:mod:`offaug.algorithms.nn.truncated_normal`, which the rollouts' numpy path shares).
    """
    log_prob: torch.Tensor = _truncated_normal_log_prob(
        TORCH_OPS, actions, mean, log_std, low, high
    )
    return log_prob


def tanh_gaussian(
    mean: torch.Tensor, log_std: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reparameterised tanh-Gaussian actions and their log-densities (SAC's squashing).

    ``a = tanh(mean + exp(log_std) * noise)``; the log-density is the Gaussian's minus
    ``sum log(1 - tanh(x)^2)``. ``mean``, ``log_std`` ``(..., act)`` broadcast against
    ``noise`` ``(..., act)``; returns actions ``noise.shape`` and log-densities
    ``noise.shape[:-1]``.
    """
    pre_tanh = mean + log_std.exp() * noise
    log_prob = (-0.5 * noise.pow(2) - log_std - LOG_SQRT_2PI).sum(-1)
    # log(1 - tanh(x)^2) written stably: 2 * (log 2 - x - softplus(-2x)).
    log_prob = log_prob - (2 * (math.log(2) - pre_tanh - F.softplus(-2 * pre_tanh))).sum(-1)
    return torch.tanh(pre_tanh), log_prob


TANH_EDGE = 1e-6
"""How far inside the normalised box :func:`tanh_gaussian_log_prob` moves actions on its faces."""


def tanh_gaussian_log_prob(
    actions: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor
) -> torch.Tensor:
    """Log-density of ``tanh(N(mean, std))`` at given actions in ``[-1, 1]^d``, summed over the
    last axis: ``log N(atanh a; mean, std) - sum log(1 - a^2)`` (the density of
    :func:`tanh_gaussian`'s samples, evaluated at actions that were not drawn from it).

    A tanh-Gaussian puts no mass on the box's faces while a truncated-Gaussian or clipped
    rollout action can lie on one: such actions are moved ``TANH_EDGE`` inside, where the
    density is finite (and, for any std the actor allows, tiny unless the mean is saturated).
    """
    inside = actions.clamp(-1.0 + TANH_EDGE, 1.0 - TANH_EDGE)
    # 1 - a and 1 + a are exact in floating point near the faces, unlike 1 - a^2.
    log_one_minus, log_one_plus = torch.log1p(-inside), torch.log1p(inside)
    pre_tanh = 0.5 * (log_one_plus - log_one_minus)  # atanh(a)
    z = (pre_tanh - mean) / log_std.exp()
    log_gaussian = -0.5 * z.pow(2) - log_std - LOG_SQRT_2PI
    return (log_gaussian - log_one_minus - log_one_plus).sum(-1)


class ActionNormaliser(nn.Module):
    """Maps Box actions to ``[-1, 1]`` inside the trainer (identity for discrete actions)."""

    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(self, spaces: Spaces) -> None:
        super().__init__()
        if spaces.discrete or not spaces.action_low:
            low = torch.full((max(spaces.action_dim, 1),), -1.0)
            high = torch.full((max(spaces.action_dim, 1),), 1.0)
        else:
            low = torch.tensor(spaces.action_low, dtype=torch.float32)
            high = torch.tensor(spaces.action_high, dtype=torch.float32)
        self.register_buffer("scale", 2.0 / (high - low))
        self.register_buffer("offset", -1.0 - low * 2.0 / (high - low))
        # log |d normalised / d env|: add to a normalised-box log-density to get the env-box one.
        self.log_abs_det = float(torch.log(2.0 / (high - low)).sum())

    def forward(self, actions: torch.Tensor) -> torch.Tensor:
        return (actions * self.scale + self.offset).clamp(-1.0, 1.0)

    def inverse(self, actions: torch.Tensor) -> torch.Tensor:
        """Normalised actions back to the environment's bounds."""
        return (actions - self.offset) / self.scale
