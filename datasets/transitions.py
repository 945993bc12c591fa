"""The transition contract: one frozen container of numpy arrays that crosses every boundary.

Shapes and dtypes, written down once (``N`` transitions):

====================== ============ ===================================================
field                  shape        dtype and meaning
====================== ============ ===================================================
``observations``       ``(N, *o)``  float32 for Box (and flattened Dict) spaces;
                                    int64 ``(N,)`` for Discrete spaces
``actions``            ``(N, *a)``  float32 for Box spaces; int64 ``(N,)`` for Discrete
``rewards``            ``(N,)``     float32, rank 1 (never ``(N, 1)``)
``next_observations``  ``(N, *o)``  as ``observations``; always the *same* episode's
                                    next observation, never the next episode's first
``terminals``          ``(N,)``     bool: the MDP terminated (no bootstrapping)
``timeouts``           ``(N,)``     bool: the episode was truncated (time limit); *not*
                                    a terminal, the learner bootstraps through it
``episode_ids``        ``(N,)``     int64, equal within an episode, ascending
``rollout_log_prob``   ``(N,)``     float32 or None: log mu(a|s) of the policy that
                                    generated the action (augmented data)
``behaviour_log_prob`` ``(N,)``     float32 or None: log beta_hat(a|s), the BC model
``importance_weight``  ``(N,)``     float32 or None: beta_hat / mu, possibly clipped
``source``             ``(N,)``     int8 :class:`Source` code or None: where it came from
``extras[name]``       ``(N, ...)`` any numeric dtype, e.g. ``infos/qpos`` for branching
====================== ============ ===================================================

A step can be neither terminal nor timeout only when it is not the last of its episode.
``Transitions`` never rewrites what it is given: ``__post_init__`` only checks.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError

FloatArray = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]


SIMULATOR_STATE_KEYS: tuple[str, ...] = ("qpos", "qvel")
"""The ``infos/*`` keys that hold a MuJoCo simulator's state at each observation."""
CONTROL_STATE_KEY = "state"
"""The ``infos/*`` key of a classic-control env's ``unwrapped.state`` at each observation."""


class Source(enum.IntEnum):
    """Where a transition came from (the ``source`` column)."""

    ORIGINAL = 0
    """The source dataset itself."""
    SIMULATOR = 1
    """A noisy rollout in the dataset's own simulator."""
    MODEL = 2
    """A rollout in a learned-dynamics model."""
    REVIEWED = 3
    """An episode a person reviewed (``offaug review``; its ``label`` extra: 1 chosen, 0 not)."""
    GENERATED = 4
    """A transition sampled from a generative model of the data (rollout backend ``diffusion``)."""


REQUIRED_FIELDS: tuple[str, ...] = (
    "observations",
    "actions",
    "rewards",
    "next_observations",
    "terminals",
    "timeouts",
    "episode_ids",
)
OPTIONAL_FIELDS: tuple[str, ...] = (
    "rollout_log_prob",
    "behaviour_log_prob",
    "importance_weight",
    "source",
)
ALL_FIELDS: tuple[str, ...] = REQUIRED_FIELDS + OPTIONAL_FIELDS
SPACE_META_KEYS: tuple[str, ...] = (
    "dataset_id",
    "observation_space",
    "action_space",
    "env_spec",
    "eval_env_spec",
    "ref_min_score",
    "ref_max_score",
    "observation_keys",
)
"""``meta`` keys describing where data lives (spaces, env, scores); derived data keeps them."""

# The dtype each rank-1 column must have; observations and actions are checked by kind.
_COLUMN_DTYPES: dict[str, np.dtype[Any]] = {
    "rewards": np.dtype(np.float32),
    "terminals": np.dtype(np.bool_),
    "timeouts": np.dtype(np.bool_),
    "episode_ids": np.dtype(np.int64),
    "rollout_log_prob": np.dtype(np.float32),
    "behaviour_log_prob": np.dtype(np.float32),
    "importance_weight": np.dtype(np.float32),
    "source": np.dtype(np.int8),
}
_ARRAY_DTYPES = (np.dtype(np.float32), np.dtype(np.int64))


@dataclasses.dataclass(frozen=True, eq=False)
class Transitions:
    """A batch of transitions, the unit every offaug stage reads and writes.

    See the module docstring for shapes and dtypes. ``meta`` carries what describes the data
    rather than being data: the observation/action spaces, the key order of a flattened Dict
    observation space, the environment spec and where the data came from.
    """

    observations: npt.NDArray[Any]  # (N, *obs) float32, or (N,) int64 for Discrete
    actions: npt.NDArray[Any]  # (N, *act) float32, or (N,) int64 for Discrete
    rewards: FloatArray  # (N,)
    next_observations: npt.NDArray[Any]  # (N, *obs), same episode only
    terminals: BoolArray  # (N,)
    timeouts: BoolArray  # (N,)
    episode_ids: IntArray  # (N,)
    rollout_log_prob: FloatArray | None = None  # (N,)
    behaviour_log_prob: FloatArray | None = None  # (N,)
    importance_weight: FloatArray | None = None  # (N,)
    source: npt.NDArray[np.int8] | None = None  # (N,)
    extras: Mapping[str, npt.NDArray[Any]] = dataclasses.field(default_factory=dict)
    """Further per-row numeric columns by name, e.g. ``infos/qpos`` (N, nq) for branching."""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.rewards)
        for name in ALL_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, np.ndarray):
                raise DataError(f"expected a numpy array, got {type(value).__name__}", field=name)
            if value.ndim == 0 or value.shape[0] != n:
                raise DataError(
                    f"has {value.shape[0] if value.ndim else 0} rows but rewards has {n}; "
                    "every column must have one row per transition",
                    field=name,
                )
            expected = _COLUMN_DTYPES.get(name)
            if expected is not None:
                if value.dtype != expected:
                    raise DataError(f"dtype must be {expected}, got {value.dtype}", field=name)
                if value.ndim != 1:
                    raise DataError(f"must be rank 1 (N,), got shape {value.shape}", field=name)
            elif value.dtype not in _ARRAY_DTYPES:
                raise DataError(
                    f"dtype must be float32 (Box) or int64 (Discrete), got {value.dtype}",
                    field=name,
                )
        for name, value in self.extras.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != n:
                raise DataError(
                    f"extra column must be an array with {n} rows", field=f"extras[{name!r}]"
                )
            if value.dtype.kind not in "fiub":
                raise DataError(
                    f"extra columns must be numeric, got {value.dtype}", field=f"extras[{name!r}]"
                )
        if self.observations.shape != self.next_observations.shape:
            raise DataError(
                f"shape {self.next_observations.shape} differs from observations "
                f"{self.observations.shape}",
                field="next_observations",
            )

    def __len__(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def observation_shape(self) -> tuple[int, ...]:
        """Shape of one observation."""
        return tuple(self.observations.shape[1:])

    @property
    def action_shape(self) -> tuple[int, ...]:
        """Shape of one action (``()`` for a Discrete action)."""
        return tuple(self.actions.shape[1:])

    @property
    def is_discrete_action(self) -> bool:
        """Whether actions are Discrete indices."""
        return bool(self.actions.dtype == np.int64)

    @property
    def num_episodes(self) -> int:
        """Number of distinct episodes."""
        if len(self) == 0:
            return 0
        return int(np.count_nonzero(np.diff(self.episode_ids)) + 1)

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """The present array columns by name, required first, in contract order."""
        out: dict[str, npt.NDArray[Any]] = {}
        for name in ALL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def episode_bounds(self) -> npt.NDArray[np.int64]:
        """Start offsets of every episode plus the total length: ``(E + 1,)``."""
        if len(self) == 0:
            return np.zeros(1, dtype=np.int64)
        starts = np.flatnonzero(np.diff(self.episode_ids)) + 1
        return np.concatenate(([0], starts, [len(self)])).astype(np.int64)

    def episode_sums(self, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The sum of a per-row ``(N,)`` series over each episode: ``(E,)`` float64."""
        if len(self) == 0:
            return np.zeros(0)
        rows = np.asarray(values, dtype=np.float64)
        return np.asarray(np.add.reduceat(rows, self.episode_bounds()[:-1]), dtype=np.float64)

    def episode_returns(self, *, finite: bool = False) -> npt.NDArray[np.float64]:
        """Undiscounted return of every episode, ``(E,)`` float64; ``finite`` counts NaN and
        infinite rewards as 0 (to summarise a broken dataset rather than refuse it)."""
        rewards = np.asarray(self.rewards, dtype=np.float64)
        if finite:
            rewards = np.where(np.isfinite(rewards), rewards, 0.0)
        return self.episode_sums(rewards)

    def iter_episodes(self) -> Iterator[Transitions]:
        """Yield each episode as its own ``Transitions`` (views, no copies)."""
        bounds = self.episode_bounds()
        for start, stop in itertools.pairwise(bounds):
            yield self.slice(int(start), int(stop))

    def slice(self, start: int, stop: int) -> Transitions:
        """Rows ``start:stop`` as views of this container's arrays."""
        return self._map_rows(lambda v: v[start:stop])

    def take(self, indices: npt.ArrayLike) -> Transitions:
        """Rows at ``indices`` (a copy)."""
        index = np.asarray(indices)
        return self._map_rows(lambda v: v[index])

    def with_columns(self, **columns: npt.NDArray[Any] | None) -> Transitions:
        """A new container with some columns replaced or added (others shared)."""
        unknown = set(columns) - set(ALL_FIELDS)
        if unknown:
            raise DataError(f"unknown columns {sorted(unknown)}; allowed: {list(ALL_FIELDS)}")
        return dataclasses.replace(self, **columns)  # type: ignore[arg-type]

    def _map_rows(self, rows: Callable[[npt.NDArray[Any]], npt.NDArray[Any]]) -> Transitions:
        columns = {k: rows(v) for k, v in self.columns().items()}
        extras = {k: rows(v) for k, v in self.extras.items()}
        return Transitions(**columns, extras=extras, meta=self.meta)

    def check_finite(self, *, origin: str | None = None) -> None:
        """Raise :class:`DataError` naming the first field that holds NaN or inf.

        Args:
            origin: The file the data came from, named in the error.
        """
        for name in ("observations", "next_observations", "rewards", "actions"):
            value = getattr(self, name)
            if value.dtype.kind != "f":
                continue
            bad = ~np.isfinite(value)
            if bad.any():
                row = int(np.argwhere(bad)[0][0])
                raise DataError(
                    f"{int(bad.sum())} NaN/inf values (first at row {row}, episode "
                    f"{int(self.episode_ids[row])})",
                    path=origin,
                    field=name,
                    hint="clean or drop those episodes before loading",
                )

    def equals(self, other: Transitions) -> bool:
        """Whether both hold the same columns with identical values (``meta`` is ignored)."""
        mine = {**self.columns(), **{f"extras/{k}": v for k, v in self.extras.items()}}
        theirs = {**other.columns(), **{f"extras/{k}": v for k, v in other.extras.items()}}
        if mine.keys() != theirs.keys():
            return False
        return all(
            mine[k].dtype == theirs[k].dtype and np.array_equal(mine[k], theirs[k]) for k in mine
        )


def concatenate(parts: Sequence[Transitions], *, renumber_episodes: bool = True) -> Transitions:
    """Concatenate transitions; optional columns must be present in all parts or none.

    Args:
        parts: The containers to join, in order.
        renumber_episodes: Offset each part's ``episode_ids`` so that episodes stay distinct
            (ascending) across parts. With ``False`` ids are kept as they are.
    """
    if not parts:
        raise DataError("nothing to concatenate")
    names = list(parts[0].columns())
    extra_names = list(parts[0].extras)
    for i, part in enumerate(parts[1:], start=1):
        if list(part.columns()) != names or list(part.extras) != extra_names:
            raise DataError(
                f"part {i} has columns {list(part.columns()) + list(part.extras)}, "
                f"part 0 has {names + extra_names}",
                hint="add or drop optional columns so that all parts match before concatenating",
            )
    joined: dict[str, npt.NDArray[Any]] = {}
    for name in names:
        arrays = [getattr(p, name) for p in parts]
        if name == "episode_ids" and renumber_episodes:
            offset = 0
            shifted = []
            for arr in arrays:
                if len(arr) == 0:
                    continue
                base = arr - arr[0] + offset
                shifted.append(base)
                offset = int(base[-1]) + 1
            arrays = shifted or arrays
        joined[name] = np.concatenate(arrays)
    extras = {name: np.concatenate([p.extras[name] for p in parts]) for name in extra_names}
    return Transitions(**joined, extras=extras, meta=dict(parts[0].meta))
