"""Read a Minari dataset directory into :class:`Transitions`, in bulk.

Minari stores each episode with its N+1 observations and N actions, rewards, terminations and
truncations. Its own reader (``MinariDataset.iterate_episodes``) walks episodes one by one
through h5py's high-level API or a pyarrow dataset per episode; here the storage backend
(:mod:`offaug.datasets.storage`) reads every episode at once and the transition view is built
with one vectorised gather (:func:`offaug.datasets.layout.transition_rows`):

* ``observations`` = every stored observation except each episode's last,
* ``next_observations`` = every stored observation except each episode's first,

so a next observation always comes from its own episode. The result equals
``minari.iterate_episodes`` (after the dtype casts of the contract) episode by episode.
HDF5 datasets with many episodes are split over reader processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.layout import (
    METADATA_NAME,
    STEP_KEYS,
    ObservationLayout,
    check_action_space,
    data_dir_of,
    flatten_layout,
    read_metadata,
    read_spaces,
    transition_rows,
)
from offaug.datasets.storage import STORAGE_FORMATS, EpisodeArrays, storage_backend
from offaug.datasets.transitions import Transitions

__all__ = ["data_dir_of", "flatten_layout", "read_metadata", "read_minari_dir"]

# Below this many episodes a worker process costs more to start than it saves.
_PARALLEL_MIN_EPISODES = 1000


def _pool_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    # The reader processes unpickle this module's _read_range, which reads through a backend.
    backends = [f"offaug.datasets.storage.{name}" for name in STORAGE_FORMATS]
    context.set_forkserver_preload(["numpy", "offaug.datasets.minari_reader", *backends])
    return context


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Start pool processes without re-running the caller's ``__main__`` module in them.

    A forkserver (or spawn) child normally re-executes the parent's main script, so a user's
    script without an ``if __name__ == "__main__":`` guard would run its top level again in
    each reader process, side effects included, and fail there with ``BrokenProcessPool``.
    The readers need nothing from ``__main__`` (the task is this module's ``_read_range``), so
    while the processes start, ``__main__`` shows multiprocessing neither a file nor a spec:
    the two attributes it looks at to decide what to re-import.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if name in vars(main)
    }
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _merge_ranges(parts: Sequence[EpisodeArrays]) -> EpisodeArrays:
    if len(parts) == 1:
        return parts[0]
    merged: EpisodeArrays = {"lengths": np.concatenate([p["lengths"] for p in parts])}
    for group in ("observations", "infos"):
        merged[group] = {k: np.concatenate([p[group][k] for p in parts]) for k in parts[0][group]}
    for key in STEP_KEYS:
        merged[key] = np.concatenate([p[key] for p in parts])
    return merged


def _read_range(
    data_format: str,
    data_dir: str,
    episode_ids: Sequence[int],
    layout: ObservationLayout,
    info_keys: Sequence[str],
) -> EpisodeArrays:
    """Read some episodes of a dataset: the unit of work of one process."""
    try:
        return storage_backend(data_format).read_episodes(
            Path(data_dir), episode_ids, layout, info_keys
        )
    except DataError:
        raise
    except (
        OSError,
        RuntimeError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        NotImplementedError,
    ) as exc:
        # A corrupted file can fail anywhere inside h5py or pyarrow; pyarrow's exceptions
        # derive from these built-in ones.
        raise DataError(
            f"cannot read the stored episodes ({type(exc).__name__}: {exc})",
            path=data_dir,
            hint="a file is truncated or corrupted; re-download or regenerate the dataset",
        ) from exc


def _read_all(
    data_format: str,
    data_dir: Path,
    episode_ids: Sequence[int],
    layout: ObservationLayout,
    info_keys: Sequence[str],
    workers: int,
) -> EpisodeArrays:
    """Read every episode, split over ``workers`` processes when the dataset is large enough
    and its format gains from it (``StorageBackend.reads_in_processes``)."""
    backend = storage_backend(data_format)
    backend.check(data_dir)
    args = (data_format, str(data_dir))
    if (
        not backend.reads_in_processes
        or workers <= 1
        or len(episode_ids) < _PARALLEL_MIN_EPISODES
        # Daemonic processes (Dask workers, pool workers) may not start children.
        or multiprocessing.current_process().daemon
    ):
        return _read_range(*args, episode_ids, layout, info_keys)
    chunks = [list(c) for c in np.array_split(np.asarray(episode_ids), workers) if len(c)]
    # The parent reads the first chunk itself while workers read the rest. Workers come from a
    # forkserver: forking a parent that may hold torch or pyarrow threads is unsafe, a fresh
    # interpreter per call costs a second of imports, and the fork server pays them once.
    with ProcessPoolExecutor(max_workers=len(chunks) - 1, mp_context=_pool_context()) as pool:
        # The pool starts its processes inside submit().
        with _main_not_rerun():
            futures = [
                pool.submit(_read_range, *args, chunk, list(layout), list(info_keys))
                for chunk in chunks[1:]
            ]
        parts = [_read_range(*args, chunks[0], layout, info_keys)]
        parts.extend(f.result() for f in futures)
    return _merge_ranges(parts)


def _flatten_observations(
    parts: dict[str, npt.NDArray[Any]], layout: ObservationLayout, space: Any
) -> npt.NDArray[Any]:
    if isinstance(space, gym.spaces.Discrete):
        return parts[""].astype(np.int64, copy=False).reshape(-1)
    if not isinstance(space, gym.spaces.Dict):
        return parts[""].astype(np.float32, copy=False)
    columns = [parts[leaf].reshape(len(parts[leaf]), -1) for leaf, _ in layout]
    return np.concatenate(columns, axis=1).astype(np.float32, copy=False)


def read_minari_dir(
    path: str | Path,
    *,
    workers: int | None = None,
    info_keys: Sequence[str] = (),
    check_finite: bool = True,
) -> Transitions:
    """Read every episode of a Minari dataset directory.

    Args:
        path: The dataset directory (holding ``data/``) or its ``data/`` folder.
        workers: Processes for HDF5 reading (default: one per core, used only for datasets
            large enough to pay for them; Arrow is read in one process).
        info_keys: Per-observation ``infos`` arrays (N+1 rows per episode, e.g. ``qpos``) to
            carry as ``extras["infos/KEY"]``, aligned with ``observations``.
        check_finite: Refuse NaN/inf observations and rewards.

    Returns:
        :class:`Transitions` with ``meta`` holding the spaces, the Dict key order
        (``observation_keys``), the env spec and reference scores.
    """
    data_dir = data_dir_of(Path(path))
    metadata = read_metadata(data_dir)
    observation_space, action_space = read_spaces(metadata, data_dir)
    layout = flatten_layout(observation_space)
    check_action_space(action_space)
    leaves = [leaf for leaf, _ in layout]
    total_episodes = int(metadata.get("total_episodes", 0))
    episode_ids = list(range(total_episodes))
    data_format = metadata.get("data_format", "hdf5")
    if total_episodes == 0:
        raise DataError("dataset has no episodes", path=data_dir, field="total_episodes")
    # Refuses an unknown format before anything is read.
    storage_backend(data_format, path=data_dir / METADATA_NAME)
    raw = _read_all(
        data_format, data_dir, episode_ids, layout, info_keys, workers or os.cpu_count() or 1
    )
    lengths = raw["lengths"]
    expected_steps = metadata.get("total_steps")
    if expected_steps is not None and int(lengths.sum()) != int(expected_steps):
        raise DataError(
            f"episodes hold {int(lengths.sum())} steps, metadata says {expected_steps}",
            path=data_dir,
            field="total_steps",
        )
    current, following = transition_rows(lengths)
    stacked = _flatten_observations(raw["observations"], layout, observation_space)
    actions = raw["actions"]
    actions = (
        actions.astype(np.int64, copy=False).reshape(-1)
        if actions.dtype.kind in "iu"
        else actions.astype(np.float32, copy=False)
    )
    meta: dict[str, Any] = {
        "format": f"minari-{data_format}",
        "dataset_id": metadata.get("dataset_id"),
        "observation_space": metadata.get("observation_space"),
        "action_space": metadata.get("action_space"),
        "env_spec": metadata.get("env_spec"),
        "eval_env_spec": metadata.get("eval_env_spec"),
        "ref_min_score": metadata.get("ref_min_score"),
        "ref_max_score": metadata.get("ref_max_score"),
        "observation_keys": [leaf for leaf in leaves if leaf] or None,
        "observation_layout": [[leaf, list(shape)] for leaf, shape in layout],
    }
    transitions = Transitions(
        observations=stacked[current],
        actions=actions,
        rewards=raw["rewards"].astype(np.float32, copy=False),
        next_observations=stacked[following],
        terminals=raw["terminations"].astype(np.bool_, copy=False),
        timeouts=raw["truncations"].astype(np.bool_, copy=False),
        episode_ids=np.repeat(np.asarray(episode_ids, dtype=np.int64), lengths),
        extras={f"infos/{key}": value[current] for key, value in raw["infos"].items()},
        meta=meta,
    )
    if check_finite:
        transitions.check_finite(origin=str(data_dir))
    return transitions
