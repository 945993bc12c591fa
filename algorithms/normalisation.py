"""Statistics of the training data that a learner takes once, before its first step.

TD3+BC standardises observations with the dataset's mean and standard deviation, and IQL
(optionally) too; IQL's locomotion recipe also scales rewards by ``1000 / (max - min)`` of
the episode returns. A learner that needs them implements ``prepare(sampler)`` and keeps
the numbers in its ``state_dict``, so a restored checkpoint's ``act`` and ``q_values`` apply
them without the data.

Both are taken over the rows the sampler draws from, weighted by each set's share of a batch:
with ``mixing=[0.5, 0.5]`` the original and the augmented set count half each, whatever their
sizes, which is the distribution the learner's batches come from.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from offaug.datasets.sampler import MixtureSampler

OBSERVATION_STD_EPSILON = 1e-3
"""Added to every standard deviation (TD3+BC's and d3rlpy's ``StandardObservationScaler``'s)."""

RETURN_RANGE_TARGET = 1000.0
"""IQL's reward scale: rewards times ``1000 / (max return - min return)``."""


def observation_moments(
    sampler: MixtureSampler,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Mean and standard deviation (plus :data:`OBSERVATION_STD_EPSILON`) per dimension.

    Each set's moments enter with its share of a batch (``sampler.counts``); inside a set every
    row counts once. Observations are flattened to ``(N, obs)``.
    """
    dim = int(np.prod(sampler.pools[0].parts[0].observations.shape[1:]))
    first, second = np.zeros(dim), np.zeros(dim)
    for pool, count in zip(sampler.pools, sampler.counts, strict=True):
        share = count / sampler.batch_size
        for part in pool.parts:
            rows = np.asarray(part.observations, dtype=np.float64).reshape(len(part), dim)
            first += share * rows.sum(0) / pool.rows
            second += share * np.square(rows).sum(0) / pool.rows
    std = np.sqrt(np.maximum(second - first**2, 0.0)) + OBSERVATION_STD_EPSILON
    return first.astype(np.float32), std.astype(np.float32)


def return_range(sampler: MixtureSampler) -> float:
    """``max - min`` of the undiscounted episode returns over every set (0 for one episode).

    An episode is a run of equal ``episode_ids``; one cut by a shard boundary cannot occur
    (episodes never span two shards).
    """
    returns: list[npt.NDArray[np.float64]] = []
    for pool in sampler.pools:
        for part in pool.parts:
            returns.append(part.episode_returns())
    every = np.concatenate(returns)
    return float(every.max() - every.min())


def reward_scale(sampler: MixtureSampler) -> float:
    """``1000 / (max return - min return)``; 1 where all returns are equal."""
    spread = return_range(sampler)
    return RETURN_RANGE_TARGET / spread if spread > 0 else 1.0


class ObservationNormaliser(nn.Module):
    """``(s - mean) / std`` with the data's moments as buffers (identity until they are set)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, observation_dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(observation_dim))
        self.register_buffer("std", torch.ones(observation_dim))

    def set_moments(self, mean: npt.NDArray[np.float32], std: npt.NDArray[np.float32]) -> None:
        """Use these moments from now on (e.g. :func:`observation_moments`)."""
        with torch.no_grad():
            self.mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
            self.std.copy_(torch.as_tensor(std, dtype=torch.float32))

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        return (observations - self.mean) / self.std
