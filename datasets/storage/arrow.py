"""Minari's Arrow storage: ``data/<i>/part-0.arrow`` and ``data/<i>/metadata.json`` per episode.

An episode file holds one record batch of N+1 rows: ``observations`` (Box values as
fixed-size lists, a struct for a Dict space), the step columns ``actions``, ``rewards``,
``terminations`` and ``truncations`` padded with zeros on the last row, and an ``infos``
struct. Reading parses every episode file's IPC stream with pyarrow in one process; writing
builds one record batch per chunk and writes each episode as a zero-copy slice of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash

from offaug.datasets.errors import DataError
from offaug.datasets.layout import (
    STEP_KEYS,
    InfoColumn,
    ObservationLayout,
    Spaces,
    StoredEpisodes,
)
from offaug.datasets.storage import EpisodeArrays, StorageBackend, StorageFormat

# --------------------------------------------------------------------------- reading


def _fixed_list_to_numpy(column: Any, row_shape: tuple[int, ...]) -> npt.NDArray[Any]:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        flat: npt.NDArray[Any] = column.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape((len(column), *row_shape))
    values: npt.NDArray[Any] = column.to_numpy(zero_copy_only=False)
    return values


def _episode_file(data_dir: Path, episode_id: int) -> Path:
    # Minari writes data/<id>/part-0.arrow (tried first, by the reader); anything else is found
    # by listing the folder.
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


_MAGIC = b"ARROW1"


def _read_table(file: str) -> Any:
    """One episode file's table (FileNotFoundError passes on).

    An Arrow IPC file is its magic, padded to 8 bytes, then the IPC stream of its schema and
    record batches, then a footer that indexes them, then the magic again. A Minari episode
    file is small, so it is read whole into memory and its stream parsed from there: mapping
    it and opening it as a file (the footer parsed too) cost several times as much per file,
    which is what a dataset of thousands of short episodes is made of.
    """
    try:
        with open(file, "rb") as handle:
            data = handle.read()
        if len(data) < 16 or data[:6] != _MAGIC or data[-6:] != _MAGIC:
            raise pa.ArrowInvalid("not an Arrow IPC file (magic bytes missing)")
        return pa.ipc.open_stream(pa.py_buffer(data)[8:]).read_all()
    except FileNotFoundError:
        raise
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(
            f"cannot read Arrow episode file ({exc})",
            path=file,
            hint="the file is truncated or corrupted; re-download or regenerate the dataset",
        ) from exc


def _read_episode(data_dir: Path, prefix: str, episode_id: int) -> tuple[Any, str]:
    """Episode ``episode_id``'s table and file. ``prefix`` is ``str(data_dir)``: with thousands
    of short episodes, pathlib objects and a check before opening Minari's own file name would
    cost a good part of the read."""
    file = f"{prefix}/{episode_id}/part-0.arrow"
    try:
        return _read_table(file), file
    except FileNotFoundError:
        file = str(_episode_file(data_dir, episode_id))
        return _read_table(file), file


def _checked(table: Any, columns: Sequence[str], file: str) -> Any:
    """``table``'s ``columns``, refusing an episode file that lacks one."""
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"columns {missing} missing", path=file, field=missing[0])
    return table.select(columns)


def _read_arrow_range(
    data_dir: Path,
    episode_ids: Sequence[int],
    layout: Sequence[tuple[str, tuple[int, ...]]],
    info_keys: Sequence[str],
) -> dict[str, Any]:
    """Read Minari Arrow episodes (one IPC file each, N+1 rows, step columns padded).

    The per-file work is kept to reading and parsing the file: the columns are checked on the
    first file's schema, and every other file is only compared with it (files of one dataset
    share it; when one does not, each file's columns are checked and selected).
    """
    columns = ["observations", *STEP_KEYS, *(["infos"] if info_keys else [])]
    prefix = str(data_dir)
    read = [_read_episode(data_dir, prefix, episode_id) for episode_id in episode_ids]
    tables = [table for table, _ in read]
    first = tables[0].schema
    if all(table.schema.equals(first) for table in tables):
        _checked(tables[0], columns, read[0][1])
    else:
        tables = [_checked(table, columns, file) for table, file in read]
    rows = np.fromiter((t.num_rows for t in tables), dtype=np.int64, count=len(tables))
    if not rows.all():
        empty = read[int(np.argmin(rows))][1]
        raise DataError("episode file holds no rows; Minari stores N+1", path=empty)
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        raise DataError(f"episode files disagree on their schema ({exc})", path=data_dir) from exc
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
    if pa.types.is_fixed_size_list(column.type):
        return (column.type.list_size,)
    return ()


# --------------------------------------------------------------------------- writing


class ArrowWriter:
    """Writes ``data/<id>/part-0.arrow`` + ``metadata.json`` per episode, as Minari does.

    One record batch of stored rows is built per chunk; each episode is a zero-copy slice of
    it, serialised to memory (so that the checksum needs no second read) and written out.
    """

    def __init__(self, data_dir: Path, spaces: Spaces, columns: Sequence[InfoColumn]) -> None:
        self._data_dir = data_dir
        self._spaces = spaces
        self._columns = columns
        self._schema: Any = None
        self._options = pa.ipc.IpcWriteOptions()
        self._next_id = 0
        self._checksums: dict[str, str] = {}
        self._bytes = 0

    def _values(self, values: npt.NDArray[Any]) -> Any:
        """A numpy column as Minari's Arrow encoding (fixed-size lists for vectors)."""
        if values.ndim == 1:
            return pa.array(values)
        width = int(np.prod(values.shape[1:], dtype=np.int64))
        flat = pa.array(np.ascontiguousarray(values).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, type=pa.list_(flat.type, width))

    def _observations(self, chunk: StoredEpisodes) -> Any:
        if not self._spaces.observation_dict:
            return self._values(chunk.observations[0])
        tree: dict[str, Any] = {}
        for leaf, values in zip(self._spaces.leaves, chunk.observations, strict=True):
            node = tree
            for key in leaf.path[:-1]:
                node = node.setdefault(key, {})
            node[leaf.path[-1]] = self._values(values)

        def build(node: dict[str, Any]) -> Any:
            arrays = [build(v) if isinstance(v, dict) else v for v in node.values()]
            return pa.StructArray.from_arrays(arrays, names=list(node))

        return build(tree)

    def _infos(self, chunk: StoredEpisodes) -> Any:
        arrays, fields = [], []
        for column, values in zip(self._columns, chunk.infos, strict=True):
            array = self._values(values)
            # Minari's reader reshapes a list column by its "shape" metadata; a scalar column
            # is a plain array (Minari's own writer gives it an empty shape it cannot read).
            metadata = (
                {"shape": ",".join(str(d) for d in values.shape[1:])} if values.ndim > 1 else None
            )
            arrays.append(array)
            fields.append(pa.field(column.key, array.type, metadata=metadata))
        return pa.StructArray.from_arrays(arrays, fields=fields)

    def write(self, chunk: StoredEpisodes) -> None:
        columns: dict[str, Any] = {
            "observations": self._observations(chunk),
            "actions": self._values(chunk.pad_steps(chunk.actions)),
            "rewards": self._values(chunk.pad_steps(chunk.rewards)),
            "terminations": self._values(chunk.pad_steps(chunk.terminations)),
            "truncations": self._values(chunk.pad_steps(chunk.truncations)),
        }
        if self._columns:
            columns["infos"] = self._infos(chunk)
        batch = pa.RecordBatch.from_pydict(columns)
        if self._schema is None:
            self._schema = batch.schema
        elif batch.schema != self._schema:
            raise DataError(
                f"chunk schema {batch.schema} differs from the first chunk's {self._schema}",
                path=self._data_dir,
            )
        # Plain strings, not pathlib: path objects cost more than these small writes. (Threads
        # do not help: creating files in one directory is serialised by the file system.)
        data_dir = str(self._data_dir)
        for e, (start, length) in enumerate(
            zip(chunk.starts.tolist(), chunk.lengths.tolist(), strict=True)
        ):
            episode_id = self._next_id
            self._next_id += 1
            sink = pa.BufferOutputStream()
            with pa.ipc.RecordBatchFileWriter(sink, self._schema, options=self._options) as out:
                out.write_batch(batch.slice(start + e, length + 1))
            part = sink.getvalue()
            # What json.dumps gives for Minari's {"id": ..., "total_steps": ...}, cheaper.
            metadata = f'{{"id": {episode_id}, "total_steps": {length}}}'.encode()
            self._checksums[f"{episode_id}/part-0.arrow"] = xxhash.xxh3_128(part).hexdigest()
            self._checksums[f"{episode_id}/metadata.json"] = xxhash.xxh3_128(metadata).hexdigest()
            self._bytes += part.size + len(metadata)
            _write_episode_files(f"{data_dir}/{episode_id}", part, metadata)

    def close(self) -> tuple[dict[str, str], int]:
        """Return ``({path under data/: checksum}, bytes written)``."""
        return self._checksums, self._bytes

    def abort(self) -> None:
        return None


def _write_episode_files(directory: str, part: Any, metadata: bytes) -> None:
    """One Minari Arrow episode: ``<id>/part-0.arrow`` and ``<id>/metadata.json``."""
    os.mkdir(directory)
    with open(f"{directory}/part-0.arrow", "wb") as handle:
        handle.write(part)
    with open(f"{directory}/metadata.json", "wb") as handle:
        handle.write(metadata)


# --------------------------------------------------------------------------- the backend


class ArrowBackend:
    """Minari's ``arrow`` format (see the module docstring)."""

    name: StorageFormat = "arrow"
    # One process reads every episode file and copies each column once; a reader process
    # would pickle its columns back through a pipe, which cost more than it saved in
    # bench_io's short-episode case (benchmarks/LOG.md).
    reads_in_processes = False

    def identity(self, data_dir: Path) -> list[Any]:
        """The listing of episode directories.

        Stat-ing thousands of episode files would cost more than reading a cached copy; with
        ``metadata.json`` (which Minari rewrites on every change it makes) the listing
        identifies the content. An episode file edited in place outside Minari's API is
        therefore not noticed.
        """
        return [sorted(os.listdir(data_dir))]

    def check(self, data_dir: Path) -> None:
        """Nothing to check up front: a missing episode file is reported when it is read."""

    def read_episodes(
        self,
        data_dir: Path,
        episode_ids: Sequence[int],
        layout: ObservationLayout,
        info_keys: Sequence[str],
    ) -> EpisodeArrays:
        """Read ``episode_ids``' episode files."""
        return _read_arrow_range(data_dir, episode_ids, layout, info_keys)

    def writer(
        self,
        data_dir: Path,
        spaces: Spaces,
        columns: Sequence[InfoColumn],
        *,
        expected_bytes: int,
    ) -> ArrowWriter:
        """A writer of one directory per episode (``expected_bytes`` is not needed)."""
        return ArrowWriter(data_dir, spaces, columns)


BACKEND: StorageBackend = ArrowBackend()
