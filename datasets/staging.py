"""Lay out a chunk of :class:`Transitions` as Minari stores episodes (see :mod:`.layout`).

:func:`stage` checks a chunk against the spaces (shapes, dtypes that hold the values
exactly, next observations that continue inside an episode) and copies it once into
:class:`StoredEpisodes`: N+1 observations per episode, the step columns, and the step infos
aligned with the observations and padded on each episode's last row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.layout import InfoColumn, Spaces, StoredEpisodes
from offaug.datasets.transitions import Transitions


def _cast_exact(values: npt.NDArray[Any], dtype: np.dtype[Any], field: str) -> npt.NDArray[Any]:
    """``values`` as ``dtype``, refusing a narrowing cast that changes a value."""
    if values.dtype == dtype:
        return values
    cast = values.astype(dtype)
    if not np.can_cast(values.dtype, dtype, "safe"):
        back = cast.astype(values.dtype)
        same = back == values
        if values.dtype.kind == "f":
            same |= np.isnan(values) & np.isnan(back)
        if not bool(np.all(same)):
            raise DataError(
                f"values do not fit the space's dtype {dtype} exactly (data is {values.dtype})",
                field=field,
                hint="publish with spaces whose dtype holds the data",
            )
    return cast


def _check_continuity(chunk: Transitions, where: str) -> None:
    """Every next observation but an episode's last must be the following row's observation."""
    if len(chunk) < 2:
        return
    same_episode = chunk.episode_ids[1:] == chunk.episode_ids[:-1]
    following = chunk.observations[1:]
    previous_next = chunk.next_observations[:-1]
    differ = following != previous_next
    if following.dtype.kind == "f":
        differ &= ~(np.isnan(following) & np.isnan(previous_next))
    if differ.ndim > 1:
        differ = differ.reshape(differ.shape[0], -1).any(axis=1)
    bad = np.flatnonzero(differ & same_episode)
    if bad.size:
        row = int(bad[0])
        raise DataError(
            f"next_observations[{row}] differs from observations[{row + 1}] inside episode "
            f"{int(chunk.episode_ids[row])} ({bad.size} such rows); Minari stores one "
            "observation sequence per episode, which cannot hold both",
            field=f"{where}.next_observations",
            hint="publish data whose episodes are contiguous observation sequences",
        )


def stage(
    chunk: Transitions, spaces: Spaces, columns: Sequence[InfoColumn], where: str
) -> StoredEpisodes:
    """Check one chunk against the spaces and lay it out per episode (one copy)."""
    _check_shapes(chunk, spaces, where)
    _check_continuity(chunk, where)
    bounds = chunk.episode_bounds()
    starts = bounds[:-1]
    lengths = np.diff(bounds)
    episodes = len(lengths)
    episode_of_step = np.repeat(np.arange(episodes, dtype=np.int64), lengths)
    step_rows = np.arange(len(chunk), dtype=np.int64) + episode_of_step
    final_rows = bounds[1:] + np.arange(episodes, dtype=np.int64)
    last_steps = bounds[1:] - 1
    stored_count = len(chunk) + episodes

    observations: list[npt.NDArray[Any]] = []
    flat_current = chunk.observations.reshape(len(chunk), -1) if spaces.observation_dict else None
    flat_last = (
        chunk.next_observations[last_steps].reshape(episodes, -1)
        if spaces.observation_dict
        else None
    )
    for leaf in spaces.leaves:
        field = f"{where}.observations" + ("/" + "/".join(leaf.path) if leaf.path else "")
        stored = np.empty((stored_count, *leaf.shape), dtype=leaf.dtype)
        if flat_current is not None and flat_last is not None:
            columns_of_leaf = slice(leaf.offset, leaf.offset + leaf.width)
            current = flat_current[:, columns_of_leaf].reshape(len(chunk), *leaf.shape)
            last = flat_last[:, columns_of_leaf].reshape(episodes, *leaf.shape)
        else:
            current = chunk.observations
            last = chunk.next_observations[last_steps]
        stored[step_rows] = _cast_exact(current, leaf.dtype, field)
        stored[final_rows] = _cast_exact(last, leaf.dtype, field)
        observations.append(stored)

    infos = []
    for column in columns:
        stored = np.empty((stored_count, *column.row_shape), dtype=column.dtype)
        if column.missing_fill is None:
            values = chunk.extras[column.column]
            if values.dtype != column.dtype or tuple(values.shape[1:]) != column.row_shape:
                raise DataError(
                    f"{values.dtype} {values.shape[1:]} here, {column.dtype} {column.row_shape} "
                    "in the first part",
                    field=f"{where}.extras[{column.column!r}]",
                )
            stored[step_rows] = values
        else:
            present = getattr(chunk, column.column)
            stored[step_rows] = column.missing_fill if present is None else present
        stored[final_rows] = column.pad
        infos.append(stored)

    return StoredEpisodes(
        lengths=lengths,
        starts=starts,
        final_rows=final_rows,
        step_rows=step_rows,
        observations=tuple(observations),
        actions=np.ascontiguousarray(
            _cast_exact(chunk.actions, spaces.action_dtype, f"{where}.actions")
        ),
        rewards=chunk.rewards.astype(np.float64),
        terminations=np.ascontiguousarray(chunk.terminals),
        truncations=np.ascontiguousarray(chunk.timeouts),
        infos=tuple(infos),
    )


def _check_shapes(chunk: Transitions, spaces: Spaces, where: str) -> None:
    if spaces.observation_discrete:
        if chunk.observations.ndim != 1 or chunk.observations.dtype != np.int64:
            raise DataError(
                f"a Discrete observation space needs int64 (N,) observations, got "
                f"{chunk.observations.dtype} {chunk.observations.shape}",
                field=f"{where}.observations",
            )
    elif spaces.observation_dict:
        width = sum(leaf.width for leaf in spaces.leaves)
        if chunk.observation_shape != (width,):
            raise DataError(
                f"rows of shape {chunk.observation_shape}; the Dict space's leaves "
                f"{[('/'.join(leaf.path), leaf.shape) for leaf in spaces.leaves]} flatten to "
                f"({width},)",
                field=f"{where}.observations",
                hint="flattened Dict observations concatenate the leaves in the space's key order",
            )
    elif chunk.observation_shape != spaces.leaves[0].shape:
        raise DataError(
            f"rows of shape {chunk.observation_shape}, the observation space has "
            f"{spaces.leaves[0].shape}",
            field=f"{where}.observations",
        )
    if spaces.action_discrete:
        if chunk.actions.ndim != 1 or chunk.actions.dtype != np.int64:
            raise DataError(
                f"a Discrete action space needs int64 (N,) actions, got {chunk.actions.dtype} "
                f"{chunk.actions.shape}",
                field=f"{where}.actions",
            )
    elif chunk.action_shape != spaces.action_shape:
        raise DataError(
            f"rows of shape {chunk.action_shape}, the action space has {spaces.action_shape}",
            field=f"{where}.actions",
        )
