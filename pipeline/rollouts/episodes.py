"""Episodes of a simulator rollout: per-environment staging, growing columns, then Transitions.

Each environment's current episode is staged in arrays sized for a whole time limit; a finished
episode moves to :class:`GrowingColumns` with its length, return, start row and reset seed; the
kept episodes become simulator :class:`Transitions` with every weight column
(:func:`simulator_transitions`, shared by the noisy loop and the lookahead search).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.transitions import Source, Transitions
from offaug.pipeline.rollouts.behaviour import WeightColumns, weight_columns


class EpisodeStaging:
    """Per-env staging for the episodes in progress, and the finished episodes' columns."""

    def __init__(self, columns: Mapping[str, tuple[tuple[int, ...], Any]], n_envs: int, limit: int):
        # Pre-allocated for a whole time limit per environment.
        self.staging = {k: np.zeros((n_envs, limit, *s), dtype=d) for k, (s, d) in columns.items()}
        self.lengths = np.zeros(n_envs, dtype=np.int64)
        self.output = GrowingColumns(columns)
        self.episode_lengths: list[int] = []
        self.returns: list[float] = []
        self.start_rows: list[int] = []
        self.reset_seeds: list[int] = []

    def record(self, rows: npt.NDArray[np.int64], values: Mapping[str, npt.NDArray[Any]]) -> None:
        """Append one step to each of ``rows``' episodes."""
        t = self.lengths[rows]
        for name, column in values.items():
            self.staging[name][rows, t] = column
        self.lengths[rows] = t + 1

    def record_steps(self, env: int, values: Mapping[str, npt.NDArray[Any]], steps: int) -> None:
        """Append ``steps`` consecutive steps (``values``' first rows) to ``env``'s episode."""
        t = int(self.lengths[env])
        for name, column in values.items():
            self.staging[name][env, t : t + steps] = column[:steps]
        self.lengths[env] = t + steps

    def mark_last_timeout(self, env: int) -> None:
        """End ``env``'s episode at its last recorded step, as truncated."""
        if self.lengths[env] > 0:
            self.staging["timeouts"][env, self.lengths[env] - 1] = True

    def finish(self, env: int, start_row: int, reset_seed: int = 0) -> None:
        """Move ``env``'s episode to the output (if it has steps) and empty its staging."""
        n = int(self.lengths[env])
        if n > 0:
            self.output.append({k: v[env] for k, v in self.staging.items()}, n)
            self.episode_lengths.append(n)
            self.returns.append(float(self.staging["rewards"][env, :n].astype(np.float64).sum()))
            self.start_rows.append(start_row)
            self.reset_seeds.append(reset_seed)
        self.lengths[env] = 0


class GrowingColumns:
    """Column arrays that double their capacity as episodes are appended."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        self.capacity = 1024
        self.size = 0
        self.arrays = {k: np.empty((self.capacity, *s), dtype=d) for k, (s, d) in shapes.items()}

    def append(self, block: Mapping[str, npt.NDArray[Any]], rows: int) -> None:
        while self.size + rows > self.capacity:
            self.capacity *= 2
            for name, array in self.arrays.items():
                grown = np.empty((self.capacity, *array.shape[1:]), dtype=array.dtype)
                grown[: self.size] = array[: self.size]
                self.arrays[name] = grown
        for name, values in block.items():
            self.arrays[name][self.size : self.size + rows] = values[:rows]
        self.size += rows

    def result(self) -> dict[str, npt.NDArray[Any]]:
        return {k: v[: self.size].copy() for k, v in self.arrays.items()}


def simulator_transitions(
    data: Mapping[str, npt.NDArray[Any]],
    lengths: npt.NDArray[np.int64],
    meta: Mapping[str, Any],
    max_weight: float,
) -> tuple[Transitions, WeightColumns]:
    """Collected episodes (``data``: :class:`EpisodeStaging`'s columns, episodes of ``lengths``
    consecutive rows) as simulator :class:`Transitions` with every weight column; the weight
    statistics go into ``meta["rollout"]["weight_stats"]``."""
    weights = weight_columns(
        data["behaviour_log_prob"], data["rollout_log_prob"], lengths, max_weight
    )
    rollout_meta = {**dict(meta.get("rollout") or {}), "weight_stats": weights.stats}
    transitions = Transitions(
        observations=data["observations"],
        actions=data["actions"],
        rewards=data["rewards"],
        next_observations=data["next_observations"],
        terminals=data["terminals"],
        timeouts=data["timeouts"],
        episode_ids=np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
        rollout_log_prob=data["rollout_log_prob"].astype(np.float32),
        behaviour_log_prob=data["behaviour_log_prob"].astype(np.float32),
        importance_weight=weights.importance_weight,
        source=np.full(int(lengths.sum()), Source.SIMULATOR, dtype=np.int8),
        extras=weights.extras,
        meta={**dict(meta), "rollout": rollout_meta},
    )
    return transitions, weights
