"""Read a D4RL-format HDF5 file into :class:`Transitions`.

A D4RL file holds flat arrays, one row per step: ``observations``, ``actions``, ``rewards``,
``terminals``, and when present ``timeouts`` (D4RL v1/v2), ``next_observations`` and
``infos/*``. offaug's rules, and where they differ from ``d4rl.qlearning_dataset``:

* **Episodes** end at every row where ``terminals`` or ``timeouts`` is set. Files without
  ``timeouts`` (D4RL v0) also end an episode after every ``max_episode_steps`` steps counted
  from the last end (default 1000, the locomotion time limit): exactly ``qlearning_dataset``'s
  rule with ``env._max_episode_steps``. Such a step is marked as a timeout.
* **Next observations.** With ``next_observations`` in the file, they are used as stored and no
  row is dropped. Without it, a step's next observation is the following row, but only inside
  the same episode. A step with no successor in its episode (the last step of an episode) then:

  - is **kept** when it is terminal, with ``next_observations`` equal to its own observation:
    a terminal never bootstraps, so the value is never used, and it never borrows the first
    observation of the next episode (``qlearning_dataset`` does borrow it);
  - is **dropped** when it is a timeout or the last row of the file (``qlearning_dataset``
    drops it too); the step before it, now its episode's last, is marked as a timeout so that
    episode ends stay visible.
* ``qlearning_dataset`` always drops the file's last row and never returns timeouts; offaug
  keeps them as the ``timeouts`` column.
* v0 files: ``qlearning_dataset``'s step counter restarts at 1, not 0, after a terminal (it is
  reset and incremented in the same iteration), so it cuts the episode after a terminal one
  step early, and it drops a terminal step that falls exactly on the time limit. offaug counts
  from each episode's true first step and keeps terminal steps. Without terminals both agree
  row for row (tested).
* ``infos/*`` arrays with one row per step become ``extras`` (``infos/qpos``, ...) when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.transitions import Transitions

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals")
DEFAULT_MAX_EPISODE_STEPS = 1000


def _read_array(handle: Any, key: str, path: Path) -> npt.NDArray[Any]:
    # h5py loads when an HDF5 file is read, as for Minari's HDF5 storage (datasets/storage):
    # importing offaug.datasets does not load it.
    import h5py

    node = handle.get(key)
    if node is None:
        raise DataError(
            "required key missing",
            path=path,
            field=key,
            hint=f"a D4RL file holds {', '.join(REQUIRED_KEYS)}",
        )
    if not isinstance(node, h5py.Dataset):
        raise DataError("expected an array, found a group", path=path, field=key)
    try:
        return np.asarray(node[()])
    except (OSError, RuntimeError) as exc:
        raise DataError(
            f"cannot read ({exc})", path=path, field=key, hint="the file is truncated or corrupted"
        ) from exc


def _episode_ends_v0(
    terminals: npt.NDArray[np.bool_], max_episode_steps: int
) -> npt.NDArray[np.bool_]:
    """Time-limit ends for files without ``timeouts``: every ``max_episode_steps`` since an end."""
    n = len(terminals)
    # Segments restart after every terminal; the step count runs within a segment.
    segment_starts = np.concatenate(([0], np.flatnonzero(terminals[:-1]) + 1))
    starts_per_row = segment_starts[np.searchsorted(segment_starts, np.arange(n), side="right") - 1]
    position = np.arange(n) - starts_per_row
    at_limit = position % max_episode_steps == max_episode_steps - 1
    ends: npt.NDArray[np.bool_] = at_limit & ~terminals
    return ends


def read_d4rl_hdf5(
    path: str | Path,
    *,
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    info_keys: Sequence[str] = (),
    check_finite: bool = True,
) -> Transitions:
    """Read a D4RL-format HDF5 file (see the module docstring for the rules).

    Args:
        path: The ``.hdf5`` file.
        max_episode_steps: Time limit used to split episodes in files without ``timeouts``.
        info_keys: ``infos/*`` arrays to carry as extras (e.g. ``("qpos", "qvel")``).
        check_finite: Refuse NaN/inf observations and rewards.
    """
    import h5py  # loaded on first use, see _read_array

    file = Path(path)
    if not file.is_file():
        raise DataError("file not found", path=file)
    try:
        handle = h5py.File(file, "r")
    except OSError as exc:
        raise DataError(
            f"cannot open as HDF5 ({exc})",
            path=file,
            hint="the file is truncated, corrupted or not HDF5; re-download it",
        ) from exc
    with handle:
        arrays = {key: _read_array(handle, key, file) for key in REQUIRED_KEYS}
        has_timeouts = "timeouts" in handle
        timeouts_raw = _read_array(handle, "timeouts", file) if has_timeouts else None
        next_raw = (
            _read_array(handle, "next_observations", file)
            if "next_observations" in handle
            else None
        )
        infos = {key: _read_array(handle, f"infos/{key}", file) for key in info_keys}
    n = len(arrays["rewards"])
    checks = {**arrays, **({"timeouts": timeouts_raw} if timeouts_raw is not None else {})}
    if next_raw is not None:
        checks["next_observations"] = next_raw
    checks.update({f"infos/{k}": v for k, v in infos.items()})
    for key, value in checks.items():
        if value.ndim == 0 or len(value) != n:
            raise DataError(
                f"has {len(value) if value.ndim else 0} rows, rewards has {n}",
                path=file,
                field=key,
                hint="all D4RL arrays must have one row per step",
            )
    if n == 0:
        raise DataError("file holds no steps", path=file, field="rewards")
    rewards = arrays["rewards"].reshape(n, -1)
    if rewards.shape[1] != 1:
        raise DataError(
            f"rewards must be (N,) or (N, 1), got {arrays['rewards'].shape}",
            path=file,
            field="rewards",
        )
    terminals = arrays["terminals"].reshape(n).astype(bool)
    if timeouts_raw is not None:
        timeouts = timeouts_raw.reshape(n).astype(bool)
    else:
        timeouts = _episode_ends_v0(terminals, max_episode_steps)
    ends = terminals | timeouts
    # The file's last row ends the last episode whatever its flags say.
    ends_with_last = ends.copy()
    ends_with_last[-1] = True
    episode_ids = np.concatenate(([0], np.cumsum(ends_with_last[:-1]))).astype(np.int64)

    observations = arrays["observations"]
    keep = np.ones(n, dtype=bool)
    if next_raw is not None:
        next_observations = next_raw
    else:
        next_observations = np.empty_like(observations)
        next_observations[:-1] = observations[1:]
        # Terminal ends keep their own observation as a never-used placeholder.
        next_observations[terminals] = observations[terminals]
        # Timeouts and an unterminated last row have no successor in their episode: drop them
        # and mark the step before (if in the same episode) as the episode's timeout end.
        keep = ~(ends_with_last & ~terminals)
        dropped = np.flatnonzero(~keep)
        previous = dropped[dropped > 0] - 1
        previous = previous[keep[previous] & (episode_ids[previous] == episode_ids[previous + 1])]
        timeouts = timeouts.copy()
        timeouts[previous] = True
    actions = arrays["actions"]
    actions = (
        actions.astype(np.int64).reshape(n)
        if actions.dtype.kind in "iu"
        else actions.astype(np.float32, copy=False)
    )
    observation_dtype = np.int64 if observations.dtype.kind in "iu" else np.float32
    transitions = Transitions(
        observations=observations[keep].astype(observation_dtype, copy=False),
        actions=actions[keep],
        rewards=rewards.reshape(n)[keep].astype(np.float32, copy=False),
        next_observations=next_observations[keep].astype(observation_dtype, copy=False),
        terminals=terminals[keep],
        timeouts=timeouts[keep],
        episode_ids=episode_ids[keep],
        extras={f"infos/{k}": v[keep] for k, v in infos.items()},
        meta={
            "format": "d4rl-hdf5",
            "path": str(file.absolute()),
            "has_timeouts": has_timeouts,
            "has_next_observations": next_raw is not None,
            "max_episode_steps": None if has_timeouts else max_episode_steps,
            "dropped_steps": int(n - keep.sum()),
        },
    )
    if check_finite:
        transitions.check_finite(origin=str(file))
    return transitions
