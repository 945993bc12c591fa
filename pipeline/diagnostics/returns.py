"""Monte-Carlo returns of dataset episodes, computed per episode without crossing boundaries.

Returns are computed backwards per episode with ``gamma``. An episode cut by a time limit
(timeout) misses its tail, so its Monte-Carlo returns are biased *low* near the cut (and Q - MC
biased *high*); :func:`complete_returns` marks the rows whose return is complete up to
``gamma^m < e^-3``: the episode terminated, or at least ``3 / (1 - gamma)`` steps remain.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def discounted_returns(
    rewards: npt.ArrayLike, episode_ids: npt.ArrayLike, gamma: float
) -> npt.NDArray[np.float64]:
    """G_t = r_t + gamma G_{t+1} inside each episode, computed backwards; (N,) float64.

    An episode's last step has G = r (its tail is unknown after a timeout: biased low there).
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    ids = np.asarray(episode_ids).reshape(-1)
    out = r.copy()
    if r.size == 0:
        return out
    # Sweep by distance from the episode's end: one vectorised step per distance over the rows
    # at that distance (grouped once by a stable sort), instead of a Python loop over rows.
    to_end = steps_to_end(ids)
    order = np.argsort(to_end, kind="stable")
    group_ends = np.cumsum(np.bincount(to_end))
    for distance in range(1, len(group_ends)):
        rows = order[group_ends[distance - 1] : group_ends[distance]]
        out[rows] = r[rows] + gamma * out[rows + 1]
    return out


def steps_to_end(episode_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Per row, the number of rows after it in the same episode (0 at the last row)."""
    ids = np.asarray(episode_ids).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids)) + 1))
    stops = np.concatenate((starts[1:], [ids.size]))
    lengths = stops - starts
    position = np.arange(ids.size) - np.repeat(starts, lengths)
    return np.asarray(np.repeat(lengths, lengths) - 1 - position, dtype=np.int64)


def complete_returns(
    terminals: npt.ArrayLike, episode_ids: npt.ArrayLike, gamma: float
) -> npt.NDArray[np.bool_]:
    """Rows whose discounted MC return is complete up to gamma^m < e^-3.

    True when the row's episode ended in a terminal, or at least 3 / (1 - gamma) rows follow.
    """
    ids = np.asarray(episode_ids).reshape(-1)
    to_end = steps_to_end(ids)
    if ids.size == 0:
        return np.zeros(0, dtype=bool)
    terminal = np.asarray(terminals, dtype=bool).reshape(-1)
    last_rows = np.flatnonzero(to_end == 0)
    episode_terminated = terminal[last_rows]
    starts = np.concatenate(([0], last_rows[:-1] + 1))
    per_row = np.repeat(episode_terminated, last_rows - starts + 1)
    return np.asarray(per_row | (to_end >= 3.0 / (1.0 - gamma)), dtype=bool)
