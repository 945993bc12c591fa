"""Where numpy becomes torch: :class:`TorchBatch` for minibatches, two helpers for ``act``.

The data layer (``offaug.datasets``) is numpy only; a learner sees a sampler's
:class:`~offaug.datasets.sampler.Batch` only after :meth:`TorchBatch.from_batch` has converted
it, and observations or action indices handed to ``act``/``q_values`` go through
:func:`to_tensor` and :func:`index_tensor`. Nothing else in offaug turns arrays into tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from offaug.datasets.sampler import Batch


@dataclasses.dataclass(frozen=True)
class TorchBatch:
    """A :class:`~offaug.datasets.sampler.Batch` as torch tensors on one device.

    Terminations and truncations stay apart: learners bootstrap through a timeout.
    """

    observations: torch.Tensor  # (B, *obs) float32 (int64 for Discrete)
    actions: torch.Tensor  # (B, *act) float32 (int64 for Discrete)
    rewards: torch.Tensor  # (B,) float32
    next_observations: torch.Tensor  # (B, *obs)
    terminals: torch.Tensor  # (B,) float32: 1.0 where the MDP terminated
    timeouts: torch.Tensor  # (B,) float32: 1.0 where a time limit cut the episode
    weights: torch.Tensor  # (B,) float32 per-sample loss weights (1 when unweighted)
    next_actions: torch.Tensor | None = None  # (B, *act), the data's action at s', when sampled
    set_index: torch.Tensor | None = None  # (B,) int64 source of each row (``with_sources``)
    rollout_log_prob: torch.Tensor | None = None  # (B,) float32 log mu(a|s), NaN where absent

    @classmethod
    def from_batch(
        cls, batch: Batch, device: str | torch.device = "cpu", *, with_sources: bool = False
    ) -> TorchBatch:
        """Convert a numpy batch; flags become float so they can enter a loss directly.

        ``with_sources`` also converts each row's source (``set_index``) and, when the batch
        has it, ``rollout_log_prob``: what training-time weights need. Learners read neither.
        """

        def tensor(array: npt.NDArray[Any]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

        return cls(
            observations=tensor(batch.observations),
            actions=tensor(batch.actions),
            rewards=tensor(batch.rewards),
            next_observations=tensor(batch.next_observations),
            terminals=tensor(batch.terminals.astype(np.float32)),
            timeouts=tensor(batch.timeouts.astype(np.float32)),
            weights=tensor(batch.weights),
            next_actions=None if batch.next_actions is None else tensor(batch.next_actions),
            set_index=tensor(batch.set_index.astype(np.int64)) if with_sources else None,
            rollout_log_prob=(
                tensor(batch.rollout_log_prob)
                if with_sources and batch.rollout_log_prob is not None
                else None
            ),
        )


def to_tensor(array: npt.NDArray[Any], device: torch.device) -> torch.Tensor:
    """A numpy array of observations as a float32 tensor on ``device`` (for ``act``)."""
    # A copy: observations may be a read-only memory map, which torch must not wrap.
    return torch.tensor(np.asarray(array, dtype=np.float32), device=device)


def index_tensor(indices: npt.NDArray[Any], device: torch.device) -> torch.Tensor:
    """Discrete action indices as an int64 tensor on ``device`` (a copy, like :func:`to_tensor`)."""
    return torch.tensor(np.asarray(indices, dtype=np.int64), device=device)
