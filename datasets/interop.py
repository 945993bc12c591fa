"""Hand offaug's exact transitions to other libraries.

d3rlpy's ``MDPDataset`` takes flat per-step arrays and cuts an episode after every step flagged
terminal or timeout, taking a step's next observation from the following row. A terminal step
gets a zero next observation (unused: no bootstrapping). The last step of a *truncated* episode
has no following row, so d3rlpy would drop it; :func:`to_d3rlpy_arrays` gives each such episode
one extra row holding its true final next observation (zero action and reward) that carries the
timeout flag, so d3rlpy samples exactly offaug's N transitions with their true next observations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.transitions import Transitions


def to_d3rlpy_arrays(transitions: Transitions) -> dict[str, npt.NDArray[Any]]:
    """``observations, actions, rewards, terminals, timeouts`` for ``d3rlpy.dataset.MDPDataset``."""
    bounds = transitions.episode_bounds()
    starts, stops = bounds[:-1], bounds[1:]
    last = stops - 1
    padded = ~transitions.terminals[last]
    shift = np.concatenate(([0], np.cumsum(padded)[:-1]))
    rows = len(transitions) + int(padded.sum())
    position = np.arange(len(transitions)) + np.repeat(shift, stops - starts)
    extra = last[padded] + shift[padded] + 1

    def spread(values: npt.NDArray[Any], dtype: Any) -> npt.NDArray[Any]:
        out = np.zeros((rows, *values.shape[1:]), dtype=dtype)
        out[position] = values
        return out

    observations = spread(transitions.observations, transitions.observations.dtype)
    observations[extra] = transitions.next_observations[last[padded]]
    terminals = np.zeros(rows, dtype=np.float32)
    terminals[position[last[~padded]]] = 1.0
    timeouts = np.zeros(rows, dtype=np.float32)
    timeouts[extra] = 1.0
    return {
        "observations": observations,
        "actions": spread(transitions.actions, transitions.actions.dtype),
        "rewards": spread(transitions.rewards, np.float32),
        "terminals": terminals,
        "timeouts": timeouts,
    }


def to_d3rlpy(transitions: Transitions) -> Any:
    """A ``d3rlpy.dataset.MDPDataset`` holding exactly these transitions (needs d3rlpy)."""
    # d3rlpy is optional (a dev dependency) and imports torch, which the data layer does not.
    from d3rlpy.dataset import MDPDataset

    return MDPDataset(**to_d3rlpy_arrays(transitions))
