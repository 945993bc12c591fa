"""What every policy check shares: the sample of dataset episodes and batched policy calls.

The divergence, value and OPE checks share one sample of whole dataset episodes
(:func:`draw_sample`: at most ``max_states`` rows, drawn from its own seed) on which every policy
acts once, through :func:`batched_act` and :func:`batched_q`. :func:`jsonable` turns a result
into plain JSON values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from threadpoolctl import threadpool_limits

from offaug.pipeline.diagnostics.returns import complete_returns, discounted_returns
from offaug.pipeline.schema.run_sections import DiagnosticsModel

# Rows per policy/critic call: BCQ decodes 100 actions per state through a 750-wide VAE.
CHUNK_ROWS = 256

FloatArray = npt.NDArray[np.float64]
ActFunction = Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]
QFunction = Callable[[npt.NDArray[np.float32], npt.NDArray[Any]], npt.NDArray[Any]]


@dataclasses.dataclass
class TrainedPolicy:
    """A trained learner as the checks call it."""

    name: str
    act: ActFunction
    q_values: QFunction | None
    """The critic, for learners that have one."""


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run BLAS and torch on one thread inside the block, restoring torch's count after."""
    # Small matrices only: a multi-threaded BLAS or torch pool just spins on a busy machine
    # (see offaug.pipeline.rollouts.simulator), so both run on one thread here and are restored
    # after.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(previous)


def sample_indices(n: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """At most ``size`` distinct sorted row indices out of ``n`` (all of them when n <= size)."""
    if n <= size:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


def flat(observations: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Observations as ``(N, features)`` float32 (a Discrete observation becomes one column)."""
    array = np.asarray(observations)
    # A writable copy when needed: torch warns on (and must not write to) read-only memory maps.
    return np.require(array.reshape(len(array), -1), dtype=np.float32, requirements=["W"])


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars/arrays as Python numbers/lists and NaN/inf as None."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else None
    return value


def chunks(array: npt.NDArray[Any], size: int = CHUNK_ROWS) -> Iterator[npt.NDArray[Any]]:
    """``array`` in consecutive pieces of ``size`` rows (one empty piece for an empty array)."""
    for start in range(0, max(len(array), 1), size):
        yield array[start : start + size]


def batched_act(act: ActFunction, observations: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``act`` over ``observations`` in chunks of :data:`CHUNK_ROWS` rows."""
    obs = flat(observations)
    return np.concatenate([np.asarray(act(chunk)) for chunk in chunks(obs)])


def batched_q(
    q_values: QFunction, observations: npt.NDArray[Any], actions: npt.NDArray[Any]
) -> FloatArray:
    """``q_values`` over rows in chunks of :data:`CHUNK_ROWS`."""
    obs = flat(observations)
    parts = [
        np.asarray(q_values(obs[i : i + CHUNK_ROWS], actions[i : i + CHUNK_ROWS]), dtype=np.float64)
        for i in range(0, max(len(obs), 1), CHUNK_ROWS)
    ]
    return np.concatenate(parts).reshape(-1)


def sample_episodes(
    episode_ids: npt.ArrayLike, max_states: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    """Rows of whole episodes, taken in random order until ``max_states`` rows (sorted).

    At least one episode is taken; it is cut at ``max_states`` rows when longer.
    """
    ids = np.asarray(episode_ids).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(ids)) + 1, [ids.size]))
    order = rng.permutation(len(bounds) - 1)
    lengths = np.diff(bounds)[order]
    count = max(1, int(np.searchsorted(np.cumsum(lengths), max_states, side="right")))
    rows = np.concatenate([np.arange(bounds[e], bounds[e + 1]) for e in np.sort(order[:count])])
    return rows[:max_states].astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class PolicySample:
    """Whole dataset episodes sampled for the policy checks (rows of the original data)."""

    rows: npt.NDArray[np.int64]  # (M,)
    states: npt.NDArray[np.float32]  # (M, obs)
    actions: npt.NDArray[Any]  # (M, *act)
    next_states: npt.NDArray[np.float32]  # (M, obs)
    rewards: FloatArray  # (M,)
    terminals: npt.NDArray[np.bool_]  # (M,)
    episode_ids: npt.NDArray[Any]  # (M,)
    returns: FloatArray  # (M,) discounted MC return from each row, over the whole episode
    complete: npt.NDArray[np.bool_]  # (M,) whether that return is complete

    @property
    def starts(self) -> npt.NDArray[np.int64]:
        """Positions (in the sample) of each sampled episode's first row."""
        if len(self.rows) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(([0], np.flatnonzero(np.diff(self.episode_ids)) + 1)).astype(np.int64)


def draw_sample(original: Any, config: DiagnosticsModel, seed: int) -> PolicySample:
    """The shared sample of whole episodes, drawn from its own seed so every per-policy stage
    draws the same one."""
    rows = sample_episodes(
        original.episode_ids, config.max_states, np.random.default_rng([seed, 1])
    )
    gamma = config.gamma
    return PolicySample(
        rows=rows,
        states=flat(original.observations[rows]),
        actions=np.asarray(original.actions[rows]),
        next_states=flat(original.next_observations[rows]),
        rewards=np.asarray(original.rewards[rows], dtype=np.float64),
        terminals=np.asarray(original.terminals[rows], dtype=bool),
        episode_ids=np.asarray(original.episode_ids[rows]),
        returns=discounted_returns(original.rewards, original.episode_ids, gamma)[rows],
        complete=complete_returns(original.terminals, original.episode_ids, gamma)[rows],
    )
