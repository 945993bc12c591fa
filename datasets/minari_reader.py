"""Read a Minari dataset directory into :class:`Transitions`, in bulk.

Minari stores each episode with its N+1 observations and N actions, rewards, terminations and
truncations. Its own reader (``MinariDataset.iterate_episodes``) walks episodes one by one
through h5py's high-level API or a pyarrow dataset per episode; here the whole dataset is read
at once and the transition view is built with one vectorised gather:

* ``observations`` = every stored observation except each episode's last,
* ``next_observations`` = every stored observation except each episode's first,

so a next observation always comes from its own episode. The result equals
``minari.iterate_episodes`` (after the dtype casts of the contract) episode by episode.

HDF5: each episode group's datasets are opened through h5py's low-level API and, when a dataset
is one uncompressed chunk (what Minari writes for all but long episodes), its bytes are taken
with ``read_direct_chunk``, about three times cheaper than a selection read; otherwise a plain
read. Datasets with many episodes are split over worker processes.

Arrow: one ``pyarrow.dataset`` scan over all episode directories with pyarrow's own threads.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.transitions import Transitions

_HDF5_FILE = "main_data.hdf5"
_STEP_KEYS = ("actions", "rewards", "terminations", "truncations")
# Below this many episodes a worker process costs more to start than it saves.
_PARALLEL_MIN_EPISODES = 1000


def data_dir_of(path: Path) -> Path:
    """The ``data/`` directory of a Minari dataset given the dataset or its ``data/`` folder."""
    if (path / "metadata.json").is_file():
        return path
    if (path / "data" / "metadata.json").is_file():
        return path / "data"
    raise DataError(
        "not a Minari dataset: no metadata.json here or in data/",
        path=path,
        hint="pass the dataset directory (the one that holds data/) or a dataset id",
    )


def read_metadata(data_dir: Path) -> dict[str, Any]:
    """Minari's ``metadata.json`` of a dataset."""
    path = data_dir / "metadata.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        # ValueError covers JSON syntax errors and bytes that are not UTF-8.
        raise DataError(
            f"cannot read Minari metadata ({exc})",
            path=path,
            hint="the file is corrupted; re-download or regenerate the dataset",
        ) from exc


def _spaces(metadata: dict[str, Any], data_dir: Path) -> tuple[Any, Any]:
    from minari.serialization import deserialize_space

    try:
        observation_space = deserialize_space(metadata["observation_space"])
        action_space = deserialize_space(metadata["action_space"])
    except KeyError as exc:
        raise DataError(
            "metadata has no serialised space", path=data_dir / "metadata.json", field=str(exc)
        ) from exc
    except (ValueError, TypeError, AttributeError) as exc:
        raise DataError(
            f"cannot parse the serialised spaces ({exc})",
            path=data_dir / "metadata.json",
            field="observation_space/action_space",
        ) from exc
    return observation_space, action_space


def flatten_layout(space: Any, prefix: str = "") -> list[tuple[str, tuple[int, ...]]]:
    """Leaf paths and shapes of an observation space, in Gymnasium's flattening order.

    A Dict space's leaves come in the space's own key order (the order
    ``gymnasium.spaces.flatten`` uses); the flattened observation concatenates them.
    """
    import gymnasium as gym

    if isinstance(space, gym.spaces.Dict):
        out: list[tuple[str, tuple[int, ...]]] = []
        for key, sub in space.spaces.items():
            out.extend(flatten_layout(sub, f"{prefix}{key}/"))
        return out
    if isinstance(space, gym.spaces.Box):
        return [(prefix.rstrip("/"), tuple(space.shape))]
    if isinstance(space, gym.spaces.Discrete) and not prefix:
        return [("", ())]
    raise DataError(
        f"unsupported space {space}: offaug reads Box, Discrete and Dict-of-Box spaces",
        field=prefix.rstrip("/") or "observations",
    )


def _check_action_space(space: Any) -> None:
    import gymnasium as gym

    if not isinstance(space, (gym.spaces.Box, gym.spaces.Discrete)):
        raise DataError(
            f"unsupported action space {space}: offaug reads Box and Discrete actions",
            field="actions",
        )


class _LeafReader:
    """Reads one dataset (by path) of every episode group and collects its bytes.

    The first episode is read carefully: dtype, row shape, layout and filters are looked up.
    When the dataset is chunked without filters (how Minari writes it), later episodes take the
    fast path: open, then ``read_direct_chunk`` of chunk 0, accepted only when its length is
    exactly ``rows * row_bytes`` (one chunk, no padding); anything else (several chunks, another
    dtype or shape) falls back to the careful read. Minari writes every episode with the same
    dataset options, so filters are looked up once per dataset name.
    """

    def __init__(self, path: str) -> None:
        self.path = path.encode()
        self.parts: list[bytes] = []
        self.dtype: np.dtype[Any] | None = None
        self.row_shape: tuple[int, ...] = ()
        self.row_bytes = 0
        self.fast = False
        self.origin: tuple[int, ...] = ()

    def read(self, group: Any, rows: int | None, where: str) -> int:
        """Read this dataset of one episode; ``rows`` is the expected row count, if known."""
        import h5py

        try:
            dataset = h5py.h5d.open(group, self.path)
        except KeyError as exc:
            raise DataError("missing in the HDF5 file", field=where) from exc
        if self.fast and rows is not None:
            _, raw = dataset.read_direct_chunk(self.origin)
            if len(raw) == rows * self.row_bytes:
                self.parts.append(raw)
                return rows
        return self._read_carefully(dataset, where)

    def _read_carefully(self, dataset: Any, where: str) -> int:
        import h5py

        shape = tuple(dataset.shape)
        dtype = dataset.dtype
        if self.dtype is None:
            plist = dataset.get_create_plist()
            self.dtype = dtype
            self.row_shape = shape[1:]
            self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * dtype.itemsize
            self.origin = (0,) * len(shape)
            self.fast = bool(
                plist.get_layout() == h5py.h5d.CHUNKED
                and plist.get_nfilters() == 0
                and dtype.isnative
                and dtype.kind in "fiub"
            )
        elif shape[1:] != self.row_shape:
            raise DataError(
                f"rows have shape {shape[1:]} here but {self.row_shape} in earlier episodes",
                field=where,
            )
        array = np.empty(shape, dtype=dtype)
        if array.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, array)
        self.parts.append(array.astype(self.dtype, copy=False).tobytes())
        return int(shape[0])

    def concatenate(self) -> npt.NDArray[Any]:
        if self.dtype is None:
            return np.empty(0)
        flat = np.frombuffer(b"".join(self.parts), dtype=self.dtype)
        return flat.reshape((-1, *self.row_shape))


def _read_hdf5_range(
    file_path: str,
    episode_ids: Sequence[int],
    observation_leaves: Sequence[str],
    info_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """Read ``episode_ids`` from a Minari HDF5 file (runs in the parent or a worker process)."""
    import h5py

    try:
        handle = h5py.File(file_path, "r")
    except OSError as exc:
        raise DataError(
            f"cannot open HDF5 file ({exc})",
            path=file_path,
            hint="the file is truncated or corrupted; re-download or regenerate the dataset",
        ) from exc
    with handle:
        root = handle.id
        observation_readers = {
            leaf: _LeafReader(f"observations/{leaf}" if leaf else "observations")
            for leaf in observation_leaves
        }
        step_readers = {key: _LeafReader(key) for key in _STEP_KEYS}
        info_readers = {key: _LeafReader(f"infos/{key}") for key in info_keys}
        lengths = np.empty(len(episode_ids), dtype=np.int64)
        h5g_open = h5py.h5g.open
        h5d_open = h5py.h5d.open
        for i, episode_id in enumerate(episode_ids):
            name = f"episode_{episode_id}"
            try:
                group = h5g_open(root, name.encode())
            except KeyError as exc:
                raise DataError("episode group missing", path=file_path, field=name) from exc
            except (RuntimeError, ValueError, OSError) as exc:
                raise DataError(
                    f"cannot read episode group ({exc})",
                    path=file_path,
                    field=name,
                    hint="the file is truncated or corrupted; re-download or regenerate it",
                ) from exc
            try:
                # The step count comes from one shape look-up; every other dataset is checked
                # against it (exactly, through its byte length on the fast path).
                length = int(h5d_open(group, b"rewards").shape[0])
                steps = {
                    key: reader.read(group, length, f"{name}/{key}")
                    for key, reader in step_readers.items()
                }
                counts = {
                    leaf: reader.read(
                        group, length + 1, f"{name}/observations{'/' + leaf if leaf else ''}"
                    )
                    for leaf, reader in observation_readers.items()
                }
                info_counts = {
                    key: reader.read(group, length + 1, f"{name}/infos/{key}")
                    for key, reader in info_readers.items()
                }
            except DataError as exc:
                raise DataError(str(exc), path=file_path, field=exc.field) from exc
            except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise DataError(
                    f"cannot read episode data ({type(exc).__name__}: {exc})",
                    path=file_path,
                    field=name,
                    hint="the file is truncated or corrupted; re-download or regenerate it",
                ) from exc
            for key, count in steps.items():
                if count != length:
                    raise DataError(
                        f"has {count} rows but rewards has {length}",
                        path=file_path,
                        field=f"{name}/{key}",
                    )
            for leaf, count in counts.items():
                if count != length + 1:
                    raise DataError(
                        f"has {count} observations for {length} steps; Minari stores N+1",
                        path=file_path,
                        field=f"{name}/observations{'/' + leaf if leaf else ''}",
                    )
            for key, count in info_counts.items():
                if count != length + 1:
                    raise DataError(
                        f"has {count} rows for {length} steps; offaug reads per-observation "
                        "infos (N+1 rows, as Minari's DataCollector records them)",
                        path=file_path,
                        field=f"{name}/infos/{key}",
                    )
            lengths[i] = length
        result: dict[str, Any] = {
            "lengths": lengths,
            "observations": {k: r.concatenate() for k, r in observation_readers.items()},
        }
        result.update({key: r.concatenate() for key, r in step_readers.items()})
        result["infos"] = {key: r.concatenate() for key, r in info_readers.items()}
        return result


def _pool_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["h5py", "numpy", "pyarrow", "offaug.datasets.minari_reader"])
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


def _merge_ranges(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return parts[0]
    merged: dict[str, Any] = {"lengths": np.concatenate([p["lengths"] for p in parts])}
    for group in ("observations", "infos"):
        merged[group] = {k: np.concatenate([p[group][k] for p in parts]) for k in parts[0][group]}
    for key in _STEP_KEYS:
        merged[key] = np.concatenate([p[key] for p in parts])
    return merged


def _read_range(
    data_format: str,
    data_dir: str,
    episode_ids: Sequence[int],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    info_keys: Sequence[str],
) -> dict[str, Any]:
    """Read some episodes of a dataset: the unit of work of one process."""
    try:
        return _read_range_unchecked(data_format, data_dir, episode_ids, layout, info_keys)
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


def _read_range_unchecked(
    data_format: str,
    data_dir: str,
    episode_ids: Sequence[int],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    info_keys: Sequence[str],
) -> dict[str, Any]:
    if data_format == "hdf5":
        leaves = [leaf for leaf, _ in layout]
        return _read_hdf5_range(str(Path(data_dir) / _HDF5_FILE), episode_ids, leaves, info_keys)
    return _read_arrow_range(Path(data_dir), episode_ids, layout, info_keys)


def _read_all(
    data_format: str,
    data_dir: Path,
    episode_ids: Sequence[int],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    info_keys: Sequence[str],
    workers: int,
) -> dict[str, Any]:
    """Read every episode, split over ``workers`` processes when the dataset is large enough."""
    if data_format == "hdf5" and not (data_dir / _HDF5_FILE).is_file():
        raise DataError("HDF5 data file missing", path=data_dir / _HDF5_FILE)
    args = (data_format, str(data_dir))
    if (
        workers <= 1
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


def _fixed_list_to_numpy(column: Any, row_shape: tuple[int, ...]) -> npt.NDArray[Any]:
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        flat: npt.NDArray[Any] = column.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape((len(column), *row_shape))
    values: npt.NDArray[Any] = column.to_numpy(zero_copy_only=False)
    return values


def _episode_file(data_dir: Path, episode_id: int) -> Path:
    # Minari writes data/<id>/part-0.arrow; anything else is found by listing the folder.
    default = data_dir / str(episode_id) / "part-0.arrow"
    if default.is_file():
        return default
    folder = data_dir / str(episode_id)
    candidates = sorted(folder.glob("*.arrow")) if folder.is_dir() else []
    if len(candidates) != 1:
        raise DataError(
            f"expected one .arrow file for episode {episode_id}, found {len(candidates)}",
            path=folder,
            hint="the Arrow storage is incomplete; re-download or regenerate the dataset",
        )
    return candidates[0]


def _read_arrow_range(
    data_dir: Path,
    episode_ids: Sequence[int],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    info_keys: Sequence[str],
) -> dict[str, Any]:
    """Read Minari Arrow episodes (one IPC file each, N+1 rows, step columns padded)."""
    import pyarrow as pa

    columns = ["observations", *_STEP_KEYS, *(["infos"] if info_keys else [])]
    tables = []
    for episode_id in episode_ids:
        file = _episode_file(data_dir, episode_id)
        try:
            with pa.memory_map(str(file), "r") as source:
                table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(
                f"cannot read Arrow episode file ({exc})",
                path=file,
                hint="the file is truncated or corrupted; re-download or regenerate the dataset",
            ) from exc
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(f"columns {missing} missing", path=file, field=missing[0])
        if table.num_rows == 0:
            raise DataError("episode file holds no rows; Minari stores N+1", path=file)
        tables.append(table.select(columns))
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        raise DataError(f"episode files disagree on their schema ({exc})", path=data_dir) from exc
    rows = np.fromiter((t.num_rows for t in tables), dtype=np.int64, count=len(tables))
    lengths = rows - 1
    keep_steps = np.ones(int(rows.sum()), dtype=bool)
    keep_steps[np.cumsum(rows) - 1] = False

    observations: dict[str, npt.NDArray[Any]] = {}
    column = table.column("observations").combine_chunks()
    for leaf, shape in layout:
        node = column
        for key in filter(None, leaf.split("/")):
            node = node.field(key)
        observations[leaf] = _fixed_list_to_numpy(node, shape)
    result: dict[str, Any] = {"lengths": lengths, "observations": observations}
    actions = table.column("actions").combine_chunks()
    result["actions"] = _fixed_list_to_numpy(actions, _list_row_shape(actions))[keep_steps]
    for key in ("rewards", "terminations", "truncations"):
        result[key] = table.column(key).to_numpy()[keep_steps]
    result["infos"] = {}
    if info_keys:
        infos = table.column("infos").combine_chunks()
        for key in info_keys:
            if infos.type.get_field_index(key) < 0:
                raise DataError(
                    "missing from the stored infos", path=data_dir, field=f"infos/{key}"
                )
            node = infos.field(key)
            shape_text = (infos.type.field(key).metadata or {}).get(b"shape")
            row_shape = (
                tuple(int(d) for d in shape_text.split(b","))
                if shape_text
                else _list_row_shape(node)
            )
            result["infos"][key] = _fixed_list_to_numpy(node, row_shape)
    return result


def _list_row_shape(column: Any) -> tuple[int, ...]:
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type):
        return (column.type.list_size,)
    return ()


def _episode_index(lengths: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], ...]:
    """Row indices into the stacked N+1 observations: (current, next)."""
    total = int(lengths.sum())
    stored_starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))
    step_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    # Position of every step inside its own episode: 0, 1, ..., N_i - 1.
    within = np.arange(total, dtype=np.int64) - np.repeat(step_starts, lengths)
    current = np.repeat(stored_starts, lengths) + within
    return current, current + 1


def _flatten_observations(
    parts: dict[str, npt.NDArray[Any]], layout: Sequence[tuple[str, tuple[int, ...]]], space: Any
) -> npt.NDArray[Any]:
    import gymnasium as gym

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
            large enough to pay for them).
        info_keys: Per-observation ``infos`` arrays (N+1 rows per episode, e.g. ``qpos``) to
            carry as ``extras["infos/KEY"]``, aligned with ``observations``.
        check_finite: Refuse NaN/inf observations and rewards.

    Returns:
        :class:`Transitions` with ``meta`` holding the spaces, the Dict key order
        (``observation_keys``), the env spec and reference scores.
    """
    data_dir = data_dir_of(Path(path))
    metadata = read_metadata(data_dir)
    observation_space, action_space = _spaces(metadata, data_dir)
    layout = flatten_layout(observation_space)
    _check_action_space(action_space)
    leaves = [leaf for leaf, _ in layout]
    total_episodes = int(metadata.get("total_episodes", 0))
    episode_ids = list(range(total_episodes))
    data_format = metadata.get("data_format", "hdf5")
    if total_episodes == 0:
        raise DataError("dataset has no episodes", path=data_dir, field="total_episodes")
    if data_format not in ("hdf5", "arrow"):
        raise DataError(
            f"storage format {data_format!r} is not supported (hdf5, arrow)",
            path=data_dir / "metadata.json",
            field="data_format",
        )
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
    current, following = _episode_index(lengths)
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
