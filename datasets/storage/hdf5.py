"""Minari's HDF5 storage: one ``data/main_data.hdf5`` with an ``episode_{i}`` group per episode.

Each group has attributes ``id`` and ``total_steps`` and datasets ``observations`` (N+1 rows;
a group of leaves for a Dict space), ``actions``, ``rewards`` (float64), ``terminations``,
``truncations`` and an ``infos`` group, chunked and resizable as h5py lays them out for Minari
(so Minari can append to a dataset offaug wrote).

Reading opens each episode group's datasets through h5py's low-level API and, when a dataset
is one uncompressed chunk (what Minari writes for all but long episodes), takes its bytes with
``read_direct_chunk``, cheaper than a selection read; otherwise a plain read. Writing makes the
same objects h5py's high-level API would, with the property lists made once and reused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.layout import (
    STEP_KEYS,
    InfoColumn,
    ObservationLayout,
    Spaces,
    StoredEpisodes,
)
from offaug.datasets.shards import file_checksum
from offaug.datasets.storage import EpisodeArrays, StorageBackend, StorageFormat, file_identity

try:
    # h5py's own chunk-shape heuristic (what ``chunks=True`` gives Minari's datasets); private,
    # so a future h5py may move it.
    from h5py._hl.filters import guess_chunk as _h5py_guess_chunk
except ImportError:
    _h5py_guess_chunk = None

HDF5_FILE = "main_data.hdf5"
IN_MEMORY_BYTES = 256 * 1024 * 1024
"""Largest expected ``main_data.hdf5`` built in memory and written out once at close."""
MAX_COMPRESSION = 1032
"""Most bytes a filtered dataset may declare per byte of its file: deflate's limit (about
1032:1), far above what real data compresses to."""


# --------------------------------------------------------------------------- reading


class _LeafReader:
    """Reads one dataset (by path) of every episode group and collects its bytes.

    The first episode is read carefully: dtype, row shape, layout and filters are looked up.
    When the dataset is chunked without filters (how Minari writes it), later episodes take the
    fast path: open, then ``read_direct_chunk`` of chunk 0, accepted only when its length is
    exactly ``rows * row_bytes`` (one chunk, no padding); anything else (several chunks, another
    dtype or shape) falls back to the careful read. Minari writes every episode with the same
    dataset options, so filters are looked up once per dataset name.
    """

    def __init__(self, path: str, file_bytes: int) -> None:
        self.path = path.encode()
        self.file_bytes = file_bytes
        """Size of the HDF5 file: what an unfiltered dataset's declared shape must fit in."""
        self.parts: list[bytes] = []
        self.dtype: np.dtype[Any] | None = None
        self.row_shape: tuple[int, ...] = ()
        self.row_bytes = 0
        self.fast = False
        self.origin: tuple[int, ...] = ()

    def read(self, group: Any, rows: int | None, where: str) -> int:
        """Read this dataset of one episode; ``rows`` is the expected row count, if known."""
        try:
            dataset = h5py.h5d.open(group, self.path)
        except KeyError as exc:
            raise DataError("missing in the HDF5 file", field=where) from exc
        if self.fast and rows is not None and rows * self.row_bytes <= self.file_bytes:
            _, raw = dataset.read_direct_chunk(self.origin)
            if len(raw) == rows * self.row_bytes:
                self.parts.append(raw)
                return rows
        return self._read_carefully(dataset, where)

    def _read_carefully(self, dataset: Any, where: str) -> int:
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
        declared = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        if declared > self.file_bytes * (1 if not self.filtered(dataset) else MAX_COMPRESSION):
            raise DataError(
                f"declares shape {shape} ({declared:,} bytes), more than the"
                f" {self.file_bytes:,}-byte file can hold",
                field=where,
                hint="the file is corrupted; re-download or regenerate the dataset",
            )
        try:
            array = np.empty(shape, dtype=dtype)
        except MemoryError as exc:
            raise DataError(
                f"declares shape {shape}, too large to read into memory",
                field=where,
                hint="the file is corrupted, or too large for this machine",
            ) from exc
        if array.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, array)
        self.parts.append(array.astype(self.dtype, copy=False).tobytes())
        return int(shape[0])

    @staticmethod
    def filtered(dataset: Any) -> bool:
        """Whether ``dataset`` is stored through filters (compression)."""
        return bool(dataset.get_create_plist().get_nfilters() > 0)

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
    try:
        handle = h5py.File(file_path, "r")
    except OSError as exc:
        raise DataError(
            f"cannot open HDF5 file ({exc})",
            path=file_path,
            hint="the file is truncated or corrupted; re-download or regenerate the dataset",
        ) from exc
    file_bytes = os.path.getsize(file_path)
    with handle:
        root = handle.id
        observation_readers = {
            leaf: _LeafReader(f"observations/{leaf}" if leaf else "observations", file_bytes)
            for leaf in observation_leaves
        }
        step_readers = {key: _LeafReader(key, file_bytes) for key in STEP_KEYS}
        info_readers = {key: _LeafReader(f"infos/{key}", file_bytes) for key in info_keys}
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


# --------------------------------------------------------------------------- writing


class Hdf5Writer:
    """Writes episode groups into ``main_data.hdf5`` through h5py's low-level API.

    The objects are those h5py's ``create_group`` / ``create_dataset(data=...,
    chunks=True, maxshape=(None, ...))`` / ``attrs[...] =`` make for Minari, with the property
    lists, types and dataspaces made once and reused. A dataset that is one chunk (all but
    long episodes) is written with ``write_direct_chunk``, skipping HDF5's selection machinery.

    With ``in_memory`` the file is built by HDF5's core driver and written to ``path`` in one
    go when it closes: each of the thousands of small objects of a short-episode dataset then
    costs no write system call; the file on disk is the same format, read by any HDF5 reader.
    """

    def __init__(
        self,
        path: Path,
        spaces: Spaces,
        columns: Sequence[InfoColumn],
        *,
        in_memory: bool = False,
    ) -> None:
        self._path = path
        self._file = (
            h5py.File(path, "w", driver="core", backing_store=True)
            if in_memory
            else h5py.File(path, "w")
        )
        self._spaces = spaces
        self._columns = columns
        self._lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        self._lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
        self._scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self._int64 = h5py.h5t.py_create(np.dtype(np.int64), logical=True)
        # (shape, dtype) -> (HDF5 type, dataspace, creation property list, chunk offset or
        # None when the dataset spans several chunks): made once, reused by every episode.
        self._plans: dict[tuple[tuple[int, ...], str], tuple[Any, Any, Any, Any]] = {}
        self._next_id = 0

    def _plan(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Any, Any, Any, Any]:
        chunk = _guess_chunk(shape, (None, *shape[1:]), dtype.itemsize)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(chunk)
        dcpl.set_obj_track_times(False)
        plan = (
            h5py.h5t.py_create(dtype, logical=True),
            h5py.h5s.create_simple(shape, (h5py.h5s.UNLIMITED, *shape[1:])),
            dcpl,
            (0,) * len(shape) if chunk == shape else None,
        )
        self._plans[(shape, dtype.str)] = plan
        return plan

    def _dataset(self, group: Any, name: bytes, values: npt.NDArray[Any]) -> None:
        """One resizable chunked dataset holding ``values`` (C-contiguous)."""
        plan = self._plans.get((values.shape, values.dtype.str)) or self._plan(
            values.shape, values.dtype
        )
        dataset = h5py.h5d.create(group, name, plan[0], plan[1], dcpl=plan[2])
        if plan[3] is not None:
            dataset.write_direct_chunk(plan[3], values.data)
        else:
            dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, values)

    def _attribute(self, group: Any, name: bytes, value: int) -> None:
        attribute = h5py.h5a.create(group, name, self._int64, self._scalar)
        attribute.write(np.array(value, dtype=np.int64))

    def _group(self, parent: Any, name: bytes) -> Any:
        return h5py.h5g.create(parent, name, lcpl=self._lcpl)

    def write(self, chunk: StoredEpisodes) -> None:
        root = self._file.id
        spaces = self._spaces
        observation_names = [tuple(key.encode() for key in leaf.path) for leaf in spaces.leaves]
        info_names = [column.key.encode() for column in self._columns]
        for e, (start, length) in enumerate(
            zip(chunk.starts.tolist(), chunk.lengths.tolist(), strict=True)
        ):
            episode_id = self._next_id
            self._next_id += 1
            group = self._group(root, f"episode_{episode_id}".encode())
            self._attribute(group, b"id", episode_id)
            self._attribute(group, b"total_steps", length)
            stored = slice(start + e, start + e + length + 1)
            steps = slice(start, start + length)
            if spaces.observation_dict:
                # One group per Dict level, as Minari nests them: observations/<key>/...
                groups: dict[tuple[bytes, ...], Any] = {(): self._group(group, b"observations")}
                for names, values in zip(observation_names, chunk.observations, strict=True):
                    for depth in range(1, len(names)):
                        if names[:depth] not in groups:
                            groups[names[:depth]] = self._group(
                                groups[names[: depth - 1]], names[depth - 1]
                            )
                    self._dataset(groups[names[:-1]], names[-1], values[stored])
            else:
                self._dataset(group, b"observations", chunk.observations[0][stored])
            self._dataset(group, b"actions", chunk.actions[steps])
            self._dataset(group, b"rewards", chunk.rewards[steps])
            self._dataset(group, b"terminations", chunk.terminations[steps])
            self._dataset(group, b"truncations", chunk.truncations[steps])
            if info_names:
                info_group = self._group(group, b"infos")
                for name, values in zip(info_names, chunk.infos, strict=True):
                    self._dataset(info_group, name, values[stored])

    def close(self) -> tuple[dict[str, str], int]:
        """Close the file; return ``({path under data/: checksum}, bytes written)``."""
        self._file.close()
        return {HDF5_FILE: file_checksum(self._path)}, self._path.stat().st_size

    def abort(self) -> None:
        if self._file.id.valid:
            self._file.close()


def _guess_chunk(
    shape: tuple[int, ...], maxshape: tuple[int | None, ...], itemsize: int
) -> tuple[int, ...]:
    """The chunk shape h5py picks for ``chunks=True`` (what Minari's datasets get)."""
    if _h5py_guess_chunk is None:  # a future h5py moved it: one chunk per dataset is as readable
        return shape
    return tuple(int(c) for c in _h5py_guess_chunk(shape, maxshape, itemsize))


# --------------------------------------------------------------------------- the backend


class Hdf5Backend:
    """Minari's ``hdf5`` format (see the module docstring)."""

    name: StorageFormat = "hdf5"
    # h5py opens and reads every object under the GIL, at a high cost per object: reader
    # processes divide it.
    reads_in_processes = True

    def identity(self, data_dir: Path) -> list[Any]:
        """The size and modification time of ``main_data.hdf5``."""
        path = data_dir / HDF5_FILE
        return [file_identity(path)] if path.is_file() else []

    def check(self, data_dir: Path) -> None:
        """Refuse a ``data/`` folder without ``main_data.hdf5``."""
        if not (data_dir / HDF5_FILE).is_file():
            raise DataError("HDF5 data file missing", path=data_dir / HDF5_FILE)

    def read_episodes(
        self,
        data_dir: Path,
        episode_ids: Sequence[int],
        layout: ObservationLayout,
        info_keys: Sequence[str],
    ) -> EpisodeArrays:
        """Read ``episode_ids`` from ``main_data.hdf5``."""
        leaves = [leaf for leaf, _ in layout]
        return _read_hdf5_range(str(data_dir / HDF5_FILE), episode_ids, leaves, info_keys)

    def writer(
        self,
        data_dir: Path,
        spaces: Spaces,
        columns: Sequence[InfoColumn],
        *,
        expected_bytes: int,
    ) -> Hdf5Writer:
        """A writer of ``main_data.hdf5``, built in memory when it is expected to be small."""
        in_memory = expected_bytes <= IN_MEMORY_BYTES
        return Hdf5Writer(data_dir / HDF5_FILE, spaces, columns, in_memory=in_memory)


BACKEND: StorageBackend = Hdf5Backend()
