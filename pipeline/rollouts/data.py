"""What rollouts take from the data: where branches start and what return they must reach.

**Starts.** A branch starts at a dataset transition chosen ``uniform``-ly, or ``sparse``-ly:
with probability proportional to that state's distance to its k-th nearest neighbour among the
dataset's states (standardised per dimension), so branches go where the data is thin. The
model backend also offers ``disagreement``: proportional to the dynamics ensemble's spread at
the dataset action (:meth:`offaug.pipeline.models.dynamics.DynamicsEnsemble.disagreement`).

**Filter.** With ``filter: data`` an augmented episode is kept only if its return is at least
what the data earns over the same number of steps, less ``margin`` per step and less
``tolerance`` times the size of that expected return:

* a branch from dataset transition ``r`` of length ``L`` is compared with the data's own
  rewards ``r .. r + L - 1`` when the data's episode has that many steps left, else with the
  data's mean reward per step times ``L``;
* an episode from a reset is compared with the data's mean reward per step times ``L`` (the
  data's mean episode return per step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from scipy.spatial import cKDTree

from offaug.datasets.transitions import Transitions

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
StartsKind = Literal["uniform", "sparse", "disagreement"]
FilterKind = Literal["none", "data", "policy", "value"]
"""``data``: against the data's return; ``policy`` and ``value``: against the policy's own
(:mod:`offaug.pipeline.rollouts.references`)."""
SPARSITY_NEIGHBOURS = 5
"""k of the k-NN distance that ``sparse`` starts weight by."""
RESET_START = -1
"""The start row recorded for an episode that began at an environment reset."""


def sparsity(observations: npt.ArrayLike, k: int = SPARSITY_NEIGHBOURS) -> FloatArray:
    """(N,) each state's distance to its k-th nearest other state, in standardised units."""
    states = np.asarray(observations, dtype=np.float64)
    states = states.reshape(len(states), -1)
    if len(states) < 2:
        return np.ones(len(states))
    standardised = (states - states.mean(0)) / (states.std(0) + 1e-8)
    k = min(k, len(states) - 1)
    # k + 1: each state's nearest neighbour in the tree is itself.
    distances, _ = cKDTree(standardised).query(standardised, k=k + 1)
    return np.asarray(distances[:, -1], dtype=np.float64)


def start_probabilities(scores: npt.ArrayLike) -> FloatArray:
    """Probabilities proportional to non-negative ``scores`` (uniform where they are all 0)."""
    values = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0, posinf=0.0)
    values = np.maximum(values, 0.0)
    total = values.sum()
    if total <= 0:
        return np.full(len(values), 1.0 / max(len(values), 1))
    return np.asarray(values / total, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class ReturnBaseline:
    """The data's rewards, arranged to give its return over any stretch of an episode."""

    prefix: FloatArray
    """(N + 1,) cumulative rewards over the rows in order."""
    steps_left: IntArray
    """(N,) steps from each row to the end of its episode, the row included."""
    reward_per_step: float
    """The data's mean reward per step (its mean episode return per step)."""
    episode_return: float = 0.0
    """The data's mean episode return."""

    @classmethod
    def from_transitions(cls, data: Transitions) -> ReturnBaseline:
        """The baseline of a dataset's episodes."""
        rewards = np.asarray(data.rewards, dtype=np.float64)
        bounds = data.episode_bounds()
        lengths = np.diff(bounds)
        ends = np.repeat(bounds[1:], lengths)
        return cls(
            prefix=np.concatenate(([0.0], np.cumsum(rewards))),
            steps_left=(ends - np.arange(len(rewards))).astype(np.int64),
            reward_per_step=float(rewards.mean()) if len(rewards) else 0.0,
            episode_return=float(rewards.sum() / len(lengths)) if len(lengths) else 0.0,
        )

    def expected_returns(
        self,
        start_rows: IntArray,
        lengths: IntArray,
        terminated: npt.NDArray[np.bool_] | None = None,
    ) -> FloatArray:
        """What the data earns from each start row (or a reset) over each length.

        A reset episode that ended by termination (a fall) is held to the data's whole mean
        episode return: its length is the policy's doing, and a short fall must not pass on a
        high reward per step. A reset episode that outlives the data's mean episode is held to
        that whole return too, not to the data's reward per step times its length: the data
        never earned past its own episodes' end (a Hopper policy that stays up for 1,000 steps
        at 2.2 a step beats data that falls after 357 at 3.35).
        """
        starts = np.asarray(start_rows, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        expected = self.reward_per_step * lengths.astype(np.float64)
        resets = starts < 0
        expected[resets] = np.minimum(expected[resets], self.episode_return)
        if terminated is not None:
            expected[resets & np.asarray(terminated, dtype=bool)] = self.episode_return
        branched = ~resets
        long_enough = np.zeros(len(starts), dtype=bool)
        long_enough[branched] = self.steps_left[starts[branched]] >= lengths[branched]
        rows = starts[long_enough]
        expected[long_enough] = self.prefix[rows + lengths[long_enough]] - self.prefix[rows]
        return expected


@dataclasses.dataclass(frozen=True)
class EpisodeFilter:
    """Keeps the augmented episodes that earn at least the data (less ``margin`` per step and
    ``tolerance`` of the expected return's size)."""

    baseline: ReturnBaseline
    margin: float = 0.0
    """Reward per step an episode may fall short of the data by and still be kept."""
    tolerance: float = 0.0
    """Fraction of the expected return's magnitude an episode may fall short by. Unlike the
    per-step margin it does not grow with the episode's length, so a reset episode that runs to
    the time limit is held to the same bar as one that falls."""

    def keep(
        self,
        returns: FloatArray,
        lengths: IntArray,
        start_rows: IntArray,
        terminated: npt.NDArray[np.bool_] | None = None,
    ) -> npt.NDArray[Any]:
        """(episodes,) bool: which episodes to keep (``terminated``: which ended by a fall)."""
        expected = self.baseline.expected_returns(start_rows, lengths, terminated)
        allowed = expected - self.margin * np.asarray(lengths, dtype=np.float64)
        allowed -= self.tolerance * np.abs(expected)
        kept: npt.NDArray[np.bool_] = np.asarray(returns, dtype=np.float64) >= allowed
        return kept


def keep_episodes(
    columns: dict[str, npt.NDArray[Any]], lengths: IntArray, keep: npt.NDArray[np.bool_]
) -> dict[str, npt.NDArray[Any]]:
    """The rows of the kept episodes of ``columns`` (episodes of ``lengths`` consecutive rows)."""
    rows = np.repeat(np.asarray(keep, dtype=bool), np.asarray(lengths, dtype=np.int64))
    return {name: values[rows] for name, values in columns.items()}


def draw_start_row(
    rng: np.random.Generator, n: int, probabilities: npt.NDArray[np.float64] | None
) -> int:
    """A dataset row to branch from: uniformly over ``n``, or with ``probabilities``."""
    if probabilities is None:
        return int(rng.integers(0, n))
    return int(rng.choice(n, p=probabilities))
