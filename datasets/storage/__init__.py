"""Minari's storage formats behind one small interface, one module per format.

Like Minari's own ``dataset/_storages/__init__.py``, backends are registered by name and
imported lazily: :func:`storage_backend` imports ``offaug.datasets.storage.<name>`` the first
time a dataset of that format is read or written, so importing offaug loads neither h5py's nor
pyarrow's storage code until it is needed. Each module holds its format's reader *and* writer.

A backend reads a range of episodes into :data:`EpisodeArrays` and writes
:class:`~offaug.datasets.layout.StoredEpisodes` through an :class:`EpisodeWriter`; everything
else about a Minari dataset (metadata, spaces, the N+1 alignment) is in
:mod:`offaug.datasets.layout` and shared by both formats.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from offaug.datasets.errors import DataError
from offaug.datasets.layout import InfoColumn, ObservationLayout, Spaces, StoredEpisodes

StorageFormat = Literal["hdf5", "arrow"]
"""Minari's ``data_format`` values offaug reads and writes."""
STORAGE_FORMATS: tuple[StorageFormat, ...] = ("hdf5", "arrow")

EpisodeArrays = dict[str, Any]
"""Episodes read by a backend, stacked: ``lengths`` (E,) steps per episode; ``observations``
``{leaf: (R + E, *shape)}`` (N+1 rows per episode); ``actions``, ``rewards``,
``terminations``, ``truncations`` (R, ...); ``infos`` ``{key: (R + E, *shape)}``."""


class EpisodeWriter(Protocol):
    """Writes episodes, in order, as Minari episodes ``0, 1, ...`` under a ``data/`` folder."""

    def write(self, episodes: StoredEpisodes) -> None:
        """Append these episodes."""

    def close(self) -> tuple[dict[str, str], int]:
        """Finish; return ``({path under data/: xxh3_128}, bytes written)``."""

    def abort(self) -> None:
        """Release what is open after a failure (the caller removes the files)."""


class StorageBackend(Protocol):
    """One Minari storage format."""

    name: StorageFormat
    reads_in_processes: bool
    """Whether a large read is split over reader processes (:mod:`offaug.datasets.minari_reader`):
    worth it where a process spends its time in the format's library under the GIL."""

    def identity(self, data_dir: Path) -> list[Any]:
        """What identifies the stored episodes' content cheaply (for the shard cache)."""

    def check(self, data_dir: Path) -> None:
        """Refuse, with a :class:`DataError`, a ``data/`` folder whose storage is missing."""

    def read_episodes(
        self,
        data_dir: Path,
        episode_ids: Sequence[int],
        layout: ObservationLayout,
        info_keys: Sequence[str],
    ) -> EpisodeArrays:
        """Read ``episode_ids`` (runs in the parent or in a reader process)."""

    def writer(
        self,
        data_dir: Path,
        spaces: Spaces,
        columns: Sequence[InfoColumn],
        *,
        expected_bytes: int,
    ) -> EpisodeWriter:
        """A writer into the empty folder ``data_dir``; ``expected_bytes`` of step arrays."""


_MODULES: dict[str, str] = {name: f"offaug.datasets.storage.{name}" for name in STORAGE_FORMATS}


def storage_backend(name: str, *, path: Path | None = None) -> StorageBackend:
    """The backend of a Minari ``data_format`` (its module imported on first use).

    Args:
        name: The format, ``"hdf5"`` or ``"arrow"``.
        path: The metadata file that names it, for the error message.

    Raises:
        DataError: ``name`` is not a format offaug supports.
    """
    module = _MODULES.get(name)
    if module is None:
        raise DataError(
            f"storage format {name!r} is not supported ({', '.join(STORAGE_FORMATS)})",
            path=path,
            field="data_format",
        )
    backend: StorageBackend = importlib.import_module(module).BACKEND
    return backend


def file_identity(path: Path) -> list[Any]:
    """A file's name, size and modification time: its cheap content identity."""
    stat = path.stat()
    return [path.name, stat.st_size, stat.st_mtime_ns]
