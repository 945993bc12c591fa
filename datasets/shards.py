"""Shards: Arrow IPC files that are also zero-copy, memory-mapped numpy arrays.

A *shard* is one Arrow IPC file holding one record batch of :class:`Transitions` columns:

* vector columns (observations, actions, ...) are ``FixedSizeList<float32|int64>``, the
  per-row shape kept in the field's metadata (``shape``), so images round-trip;
* bool columns (``terminals``, ``timeouts``) are stored as ``uint8`` and viewed as ``bool``,
  because Arrow packs booleans into bits and bits cannot be memory-mapped as numpy;
* the file is uncompressed and holds a single record batch, so every column is one contiguous,
  64-byte-aligned buffer: :func:`read_shard` memory-maps the file and hands out read-only numpy
  views of those buffers without copying. That view *is* the "memory-mapped numpy view": there
  is no second copy of the data on disk.

A *shard set* is a directory of shards plus ``manifest.json`` (schema version, rows, the
xxh3-128 checksum of every file, the source dataset and the parameters that made it). Every
write goes to a temporary name first and is renamed into place, so nothing half-written ever
appears under a final name; every read verifies the checksum first.

Shards written independently (one per rollout task) each normalise ``self_normalised_weight``
over their own rows; a set whose manifest records :data:`POOLED_MEAN_WEIGHT` (the mean
importance weight over all its shards) hands that column out normalised over the whole set.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import xxhash

from offaug.datasets.atomic import atomic_path, json_default, staged_directory, write_json_atomic
from offaug.datasets.errors import ChecksumError, DataError
from offaug.datasets.transitions import ALL_FIELDS, REQUIRED_FIELDS, Transitions, concatenate
from offaug.datasets.weights import self_normalised_weights

SCHEMA_VERSION = 1
"""Version of the shard schema; bumped on any change a reader must know about."""
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "xxh3_128"
_BOOL_FIELDS = frozenset({"terminals", "timeouts"})
_META_KEY = b"offaug.meta"
_EXTRA_PREFIX = "extra:"
_SCHEMA_KEY = b"offaug.schema_version"
POOLED_MEAN_WEIGHT = "pooled_mean_weight"
"""Manifest ``params`` key: the mean importance weight over every shard of the set."""


def manifest_path(directory: str | os.PathLike[str]) -> Path:
    """Where the manifest of a shard set in ``directory`` is."""
    return Path(directory) / MANIFEST_NAME


def is_shard_set(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds an offaug shard set (a finished one: its manifest is written
    last)."""
    return manifest_path(directory).is_file()


@dataclasses.dataclass(frozen=True)
class ShardRef:
    """A small, JSON-serialisable reference to one shard file: what stages pass around."""

    path: str
    """Absolute path of the ``.arrow`` file."""
    rows: int
    """Number of transitions."""
    episodes: int
    """Number of distinct episodes."""
    checksum: str
    """``xxh3_128`` hex digest of the whole file."""
    schema_version: int = SCHEMA_VERSION
    """Shard schema version the file was written with."""
    columns: tuple[str, ...] = ()
    """Columns present in the file (extras as ``extra:NAME``)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` inverts it."""
        data = dataclasses.asdict(self)
        data["columns"] = list(self.columns)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardRef:
        """Build a reference from :meth:`to_json`'s output."""
        return cls(
            path=str(data["path"]),
            rows=int(data["rows"]),
            episodes=int(data["episodes"]),
            checksum=str(data["checksum"]),
            schema_version=int(data.get("schema_version", SCHEMA_VERSION)),
            columns=tuple(data.get("columns", ())),
        )


def file_checksum(path: str | Path) -> str:
    """The ``xxh3_128`` hex digest of a file, read through a memory map."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return str(xxhash.xxh3_128(view).hexdigest())


def _column_to_arrow(name: str, values: npt.NDArray[Any]) -> tuple[pa.Field, pa.Array]:
    array = np.ascontiguousarray(values)
    if name in _BOOL_FIELDS:
        array = array.view(np.uint8)
    arrow_type = pa.from_numpy_dtype(array.dtype)
    if array.ndim == 1:
        return pa.field(name, arrow_type, nullable=False), pa.array(array, type=arrow_type)
    row_shape = array.shape[1:]
    width = int(np.prod(row_shape))
    flat = pa.array(array.reshape(-1), type=arrow_type)
    list_type = pa.list_(arrow_type, width)
    metadata = {b"shape": ",".join(str(d) for d in row_shape).encode()}
    field = pa.field(name, list_type, nullable=False, metadata=metadata)
    return field, pa.FixedSizeListArray.from_arrays(flat, type=list_type)


def write_shard(transitions: Transitions, path: str | Path) -> ShardRef:
    """Write one shard file atomically and return its reference.

    Args:
        transitions: The rows to write.
        path: Final file name (``.arrow``). Its parent directory must exist.
    """
    final = Path(path).absolute()
    fields, arrays = [], []
    columns = dict(transitions.columns())
    columns.update({_EXTRA_PREFIX + k: v for k, v in transitions.extras.items()})
    for name, values in columns.items():
        field, array = _column_to_arrow(name, values)
        fields.append(field)
        arrays.append(array)
    metadata = {
        _SCHEMA_KEY: str(SCHEMA_VERSION).encode(),
        _META_KEY: json.dumps(dict(transitions.meta), default=json_default).encode(),
    }
    schema = pa.schema(fields, metadata=metadata)
    batch = pa.record_batch(arrays, schema=schema)
    with atomic_path(final) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(batch)
        checksum = file_checksum(tmp)
    return ShardRef(
        path=str(final),
        rows=len(transitions),
        episodes=transitions.num_episodes,
        checksum=checksum,
        columns=tuple(columns),
    )


def _arrow_to_column(name: str, column: pa.Array, field: pa.Field, path: Path) -> Any:
    if column.null_count:
        raise DataError("has null values; shards never hold nulls", path=path, field=name)
    if pa.types.is_fixed_size_list(column.type):
        shape_text = (field.metadata or {}).get(b"shape")
        if shape_text is None:
            raise DataError(
                "vector column without a 'shape' in its metadata", path=path, field=name
            )
        row_shape = tuple(int(d) for d in shape_text.split(b","))
        flat = column.values.to_numpy(zero_copy_only=True)
        return flat.reshape((len(column), *row_shape))
    values = column.to_numpy(zero_copy_only=True)
    if name in _BOOL_FIELDS:
        values = values.view(np.bool_)
    return values


def read_shard(
    path: str | Path, *, checksum: str | None = None, verify: bool = True
) -> Transitions:
    """Memory-map one shard and return read-only, zero-copy :class:`Transitions`.

    Args:
        path: The ``.arrow`` file.
        checksum: The expected ``xxh3_128`` digest (from a manifest). Checked when ``verify``.
        verify: Hash the file and compare before reading it.

    Raises:
        ChecksumError: The file does not match ``checksum``.
        DataError: The file is not an offaug shard (truncated, another schema version, ...).
    """
    file = Path(path)
    if not file.is_file():
        raise DataError("shard file is missing", path=file, hint="re-create the shard set")
    if verify and checksum is not None:
        actual = file_checksum(file)
        if actual != checksum:
            raise ChecksumError(
                f"checksum mismatch: manifest says {checksum}, file has {actual}",
                path=file,
                hint="the file is corrupted or was modified; delete it and regenerate the shard",
            )
    try:
        return _decode_shard(file)
    except DataError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        # A corrupted file can fail anywhere in Arrow's decoding or in its JSON metadata.
        raise DataError(
            f"not a readable offaug shard ({type(exc).__name__}: {exc})",
            path=file,
            hint="the file is truncated or corrupted; regenerate it",
        ) from exc


def _decode_shard(file: Path) -> Transitions:
    source = pa.memory_map(str(file), "r")
    reader = pa.ipc.open_file(source)
    schema = reader.schema
    if reader.num_record_batches != 1:
        raise DataError(
            f"holds {reader.num_record_batches} record batches; offaug shards hold one",
            path=file,
        )
    batch = reader.get_batch(0)
    version = int((schema.metadata or {}).get(_SCHEMA_KEY, b"0"))
    if version != SCHEMA_VERSION:
        raise DataError(
            f"shard schema version {version}, this offaug reads {SCHEMA_VERSION}",
            path=file,
            hint="regenerate the shard with this version of offaug",
        )
    meta = json.loads((schema.metadata or {}).get(_META_KEY, b"{}"))
    columns: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for i, field in enumerate(schema):
        values = _arrow_to_column(field.name, batch.column(i), field, file)
        if field.name.startswith(_EXTRA_PREFIX):
            extras[field.name[len(_EXTRA_PREFIX) :]] = values
        elif field.name in ALL_FIELDS:
            columns[field.name] = values
        else:
            raise DataError("unknown column", path=file, field=field.name)
    missing = [name for name in REQUIRED_FIELDS if name not in columns]
    if missing:
        raise DataError(f"required columns missing: {missing}", path=file)
    try:
        return Transitions(**columns, extras=extras, meta=meta)
    except DataError as exc:
        raise DataError(str(exc), path=file, field=exc.field) from exc


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """A directory of shards with its manifest: the reference stages pass between them."""

    directory: str
    """Absolute path of the shard-set directory."""
    shards: tuple[ShardRef, ...]
    """The shards, in order."""
    source: Mapping[str, Any]
    """What the data was made from (dataset id or path, its identity)."""
    params: Mapping[str, Any]
    """The parameters that made it (loader options, rollout config, ...)."""
    meta: Mapping[str, Any]
    """The :attr:`Transitions.meta` of the data (spaces, env spec, key order)."""

    @property
    def rows(self) -> int:
        """Total transitions over all shards."""
        return sum(s.rows for s in self.shards)

    @property
    def episodes(self) -> int:
        """Total episodes over all shards (episodes never span shards)."""
        return sum(s.episodes for s in self.shards)

    @property
    def manifest_path(self) -> Path:
        """Where the manifest lives."""
        return manifest_path(self.directory)

    def to_json(self) -> dict[str, Any]:
        """The manifest's content."""
        shards = []
        for ref in self.shards:
            entry = ref.to_json()
            # Paths inside the manifest are relative so a shard set can be moved or copied.
            entry["path"] = os.path.relpath(ref.path, self.directory)
            shards.append(entry)
        return {
            "schema_version": SCHEMA_VERSION,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "rows": self.rows,
            "episodes": self.episodes,
            "shards": shards,
            "source": dict(self.source),
            "params": dict(self.params),
            "meta": dict(self.meta),
        }

    def write_manifest(self) -> None:
        """Write ``manifest.json`` atomically."""
        write_json_atomic(self.manifest_path, self.to_json())

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> ShardSet:
        """Read a shard set's manifest (shards are read by :meth:`load` or :meth:`iter_shards`).

        Raises:
            DataError: No manifest, an unreadable one, or another schema version.
        """
        root = Path(directory).absolute()
        manifest = manifest_path(root)
        if not manifest.is_file():
            raise DataError(
                "no manifest.json: not an offaug shard set (or its write never finished)",
                path=root,
            )
        try:
            data = json.loads(manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"manifest is not valid JSON ({exc})", path=manifest) from exc
        version = int(data.get("schema_version", 0))
        if version != SCHEMA_VERSION:
            raise DataError(
                f"schema version {version}, this offaug reads {SCHEMA_VERSION}",
                path=manifest,
                field="schema_version",
                hint="regenerate the shard set with this version of offaug",
            )
        try:
            shards = tuple(
                dataclasses.replace(ShardRef.from_json(s), path=str(root / s["path"]))
                for s in data["shards"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"malformed shard entry ({exc})", path=manifest, field="shards"
            ) from exc
        return cls(
            directory=str(root),
            shards=shards,
            source=data.get("source", {}),
            params=data.get("params", {}),
            meta=data.get("meta", {}),
        )

    def iter_shards(self, *, verify: bool = True) -> Iterable[Transitions]:
        """Yield each shard as memory-mapped :class:`Transitions`, verifying checksums."""
        for ref in self.shards:
            yield self.read(ref, verify=verify)

    def read(self, ref: ShardRef, *, verify: bool = True) -> Transitions:
        """Read one shard of this set, checking its row count against the manifest."""
        data = read_shard(ref.path, checksum=ref.checksum, verify=verify)
        if len(data) != ref.rows:
            raise DataError(f"has {len(data)} rows, the manifest says {ref.rows}", path=ref.path)
        pooled_mean = self.params.get(POOLED_MEAN_WEIGHT)
        if (
            pooled_mean is not None
            and data.importance_weight is not None
            and "self_normalised_weight" in data.extras
        ):
            normalised = self_normalised_weights(data.importance_weight, pooled_mean)
            extras = {**data.extras, "self_normalised_weight": normalised.astype(np.float32)}
            data = dataclasses.replace(data, extras=extras)
        return data

    def load(self, *, verify: bool = True) -> Transitions:
        """All rows as one :class:`Transitions`: zero-copy for a single shard, else one copy."""
        parts = list(self.iter_shards(verify=verify))
        if not parts:
            raise DataError("shard set holds no shards", path=self.directory)
        if len(parts) == 1:
            return dataclasses.replace(parts[0], meta=dict(self.meta))
        # Shards of one dataset keep its episode ids; shards written independently (one per
        # rollout task) each count from 0 and are renumbered so that ids stay ascending.
        ascending = all(
            len(a) == 0 or len(b) == 0 or b.episode_ids[0] > a.episode_ids[-1]
            for a, b in itertools.pairwise(parts)
        )
        joined = concatenate(parts, renumber_episodes=not ascending)
        return dataclasses.replace(joined, meta=dict(self.meta))

    def verify(self) -> list[tuple[ShardRef, str]]:
        """Check every shard; return ``(shard, problem)`` for each bad one (empty when all good)."""
        bad: list[tuple[ShardRef, str]] = []
        for ref in self.shards:
            try:
                self.read(ref, verify=True)
            except DataError as exc:
                bad.append((ref, str(exc)))
        return bad


def _split_points(transitions: Transitions, rows_per_shard: int) -> list[int]:
    # Cut only at episode boundaries, so that an episode never spans two shards.
    bounds = transitions.episode_bounds()
    cuts = [0]
    for bound in bounds[1:-1]:
        if bound - cuts[-1] >= rows_per_shard:
            cuts.append(int(bound))
    cuts.append(len(transitions))
    return cuts


def write_shard_set(
    transitions: Transitions,
    directory: str | Path,
    *,
    rows_per_shard: int | None = None,
    source: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> ShardSet:
    """Write ``transitions`` as a shard set, atomically as a whole directory.

    The set is built in a temporary sibling directory and renamed into place, so a reader sees
    either the complete set or nothing.

    Args:
        transitions: The rows to write.
        directory: The shard-set directory to create.
        rows_per_shard: Aim for shards of about this many rows (cut at episode boundaries);
            ``None`` writes one shard.
        source: Provenance of the data (stored in the manifest).
        params: Parameters that made it (stored in the manifest).
        overwrite: Replace an existing shard set at ``directory``.

    Raises:
        FileExistsError: ``directory`` exists and ``overwrite`` is false.
    """
    final = Path(directory).absolute()
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: shard set exists; pass overwrite=True to replace it")
    with staged_directory(final, overwrite=overwrite) as staging:
        cuts = (
            [0, len(transitions)]
            if rows_per_shard is None
            else _split_points(transitions, max(1, rows_per_shard))
        )
        refs = []
        for index, (start, stop) in enumerate(itertools.pairwise(cuts)):
            ref = write_shard(transitions.slice(start, stop), staging / f"shard-{index:05d}.arrow")
            refs.append(ref)
        shard_set = ShardSet(
            directory=str(staging),
            shards=tuple(refs),
            source=dict(source or {}),
            params=dict(params or {}),
            meta=dict(transitions.meta),
        )
        shard_set.write_manifest()
    return ShardSet.open(final)
