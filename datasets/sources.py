"""``load_transitions``: one entry point for every dataset offaug reads, with a shard cache.

A *source* is one of

* a Minari dataset id (``mujoco/hopper/medium-v0``), resolved under ``MINARI_DATASETS_PATH``
  (default ``~/.minari/datasets``);
* a Minari dataset directory (the one holding ``data/``, or ``data/`` itself), HDF5 or Arrow;
* a D4RL-format ``.hdf5`` / ``.h5`` file;
* an offaug shard-set directory (holding ``manifest.json``).

A converted Minari or D4RL dataset is cached as an offaug shard set under
``OFFAUG_CACHE_DIR`` (read at call time; default ``~/.cache/offaug``), keyed by the source's
path, the size and modification time of every file in it and the loader's options. The next
load memory-maps the cache instead of re-reading Minari's per-episode storage; changing any
file of the source changes the key, and a cache entry that fails its checksum is rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import minari
import xxhash

from offaug.datasets.d4rl_reader import DEFAULT_MAX_EPISODE_STEPS, read_d4rl_hdf5
from offaug.datasets.errors import DataError, DatasetNotFoundError
from offaug.datasets.layout import METADATA_NAME, data_dir_of, read_metadata
from offaug.datasets.minari_reader import read_minari_dir
from offaug.datasets.paths import cache_root, dataset_root, resolve_dataset_dir
from offaug.datasets.shards import ShardSet, is_shard_set, write_shard_set
from offaug.datasets.storage import file_identity, storage_backend
from offaug.datasets.transitions import Transitions

logger = logging.getLogger(__name__)

SourceKind = Literal["minari", "d4rl", "shards"]
CACHE_FORMAT_VERSION = 1
"""Bumped whenever a reader's output changes, so that old cache entries are not reused."""
_D4RL_SUFFIXES = (".hdf5", ".h5")


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    """Where a source lives on disk and how to read it."""

    kind: SourceKind
    path: Path
    """The Minari ``data/`` directory, the D4RL file, or the shard-set directory."""
    name: str
    """The id or path the user gave."""


def resolve_source(source: str | os.PathLike[str], *, download: bool = False) -> ResolvedSource:
    """Find a source on disk (downloading a Minari dataset when asked).

    Raises:
        DatasetNotFoundError: neither a path nor a local Minari id; the message says where it
            looked and which command fetches it.
    """
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() not in _D4RL_SUFFIXES:
                raise DataError(
                    "not a dataset: expected a D4RL .hdf5 file or a directory",
                    path=path,
                )
            return ResolvedSource("d4rl", path.absolute(), text)
        if is_shard_set(path):
            return ResolvedSource("shards", path.absolute(), text)
        return ResolvedSource("minari", data_dir_of(path.absolute()), text)
    if text.endswith(_D4RL_SUFFIXES) or (os.sep in text and text.startswith((".", "/", "~"))):
        raise DatasetNotFoundError("file not found", path=path)
    dataset_dir = resolve_dataset_dir(text)
    if not (dataset_dir / "data" / "metadata.json").is_file():
        if download:
            _download(text)
        else:
            raise DatasetNotFoundError(
                f"Minari dataset {text!r} is not on disk under MINARI_DATASETS_PATH="
                f"{dataset_root()}",
                path=dataset_dir,
                hint=(
                    f"fetch it with `offaug inspect {text} --download` (or `minari download "
                    f"{text}`), set MINARI_DATASETS_PATH to where it lives, or make one with "
                    "`offaug make-dataset`"
                ),
            )
    return ResolvedSource("minari", dataset_dir / "data", text)


def _download(dataset_id: str) -> None:
    target = resolve_dataset_dir(dataset_id)
    existed = target.exists()
    try:
        minari.download_dataset(dataset_id)
    except Exception as exc:
        if not existed:
            # Leave nothing half-downloaded under the dataset's final name.
            shutil.rmtree(target, ignore_errors=True)
        # Deliberately broad: the failure comes from whichever HTTP stack Minari's remote uses
        # (httpx, requests, huggingface_hub, google-cloud), whose error types are not part of
        # Minari's API. The cause is chained and named in the message.
        raise DatasetNotFoundError(
            f"could not download Minari dataset {dataset_id!r}: {type(exc).__name__}: {exc}",
            path=target,
            hint="check the id with `minari list remote` and the network; "
            "nothing was written locally",
        ) from exc


def source_identity(resolved: ResolvedSource) -> list[Any]:
    """What identifies a source's content for the cache, cheaply.

    A D4RL file: its size and modification time. A Minari dataset: those of ``metadata.json``
    plus what its storage backend names (:meth:`StorageBackend.identity`): for HDF5 the data
    file's size and modification time; for Arrow, which stores one directory per episode, the
    listing of episode directories (``metadata.json`` changes on every change Minari makes), so
    an episode file edited in place outside Minari's API is not noticed: load with
    ``cache=False`` or run ``offaug cache clear``.
    """
    path = resolved.path
    if path.is_file():
        return [file_identity(path)]
    metadata_path = path / METADATA_NAME
    backend = storage_backend(read_metadata(path).get("data_format", "hdf5"), path=metadata_path)
    return [file_identity(metadata_path), *backend.identity(path)]


def cache_key(resolved: ResolvedSource, options: dict[str, Any]) -> str:
    """The cache key of a source: its path, every file's size and mtime, and the options."""
    identity = {
        "version": CACHE_FORMAT_VERSION,
        "kind": resolved.kind,
        "path": str(resolved.path),
        "files": source_identity(resolved),
        "options": options,
    }
    return xxhash.xxh3_128(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _read(resolved: ResolvedSource, options: dict[str, Any]) -> Transitions:
    # Finiteness is checked by the caller, on cached and fresh data alike.
    if resolved.kind == "minari":
        return read_minari_dir(
            resolved.path,
            workers=options["workers"],
            info_keys=options["info_keys"],
            check_finite=False,
        )
    return read_d4rl_hdf5(
        resolved.path,
        max_episode_steps=options["max_episode_steps"],
        info_keys=options["info_keys"],
        check_finite=False,
    )


def load_transitions(
    source: str | os.PathLike[str],
    *,
    download: bool = False,
    cache: bool = True,
    info_keys: Sequence[str] = (),
    max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS,
    workers: int | None = None,
    verify: bool = True,
    check_finite: bool = True,
) -> Transitions:
    """Load a dataset as :class:`Transitions` (see the module docstring for sources and caching).

    Args:
        source: Minari id, Minari directory, D4RL ``.hdf5`` file or offaug shard set.
        download: Fetch a Minari id that is not on disk (needs a network).
        cache: Read from and write to the shard cache under ``OFFAUG_CACHE_DIR``.
        info_keys: Per-step ``infos`` arrays to carry as extras (``qpos``, ``qvel``).
        max_episode_steps: D4RL v0 files only: the time limit that splits episodes.
        workers: Processes for reading Minari HDF5 (default one per core).
        verify: Check shard checksums when reading the cache or a shard set.
        check_finite: Refuse NaN/inf observations, actions and rewards (``inspect`` counts
            them instead).

    Returns:
        The transitions; from the cache or a shard set they are read-only memory maps.
    """
    resolved = resolve_source(source, download=download)
    transitions, known_finite = _load(
        resolved, cache, info_keys, max_episode_steps, workers, verify
    )
    if check_finite and not known_finite:
        transitions.check_finite(origin=str(resolved.path))
    return transitions


def _is_finite(transitions: Transitions) -> bool:
    try:
        transitions.check_finite()
    except DataError:
        return False
    return True


def _load(
    resolved: ResolvedSource,
    cache: bool,
    info_keys: Sequence[str],
    max_episode_steps: int,
    workers: int | None,
    verify: bool,
) -> tuple[Transitions, bool]:
    """The transitions, and whether they are already known to be finite (cache manifest)."""
    if resolved.kind == "shards":
        return ShardSet.open(resolved.path).load(verify=verify), False
    options: dict[str, Any] = {"info_keys": list(info_keys)}
    if resolved.kind == "d4rl":
        options["max_episode_steps"] = max_episode_steps
    if not cache:
        read_options = {**options, "workers": workers, "max_episode_steps": max_episode_steps}
        return _read(resolved, read_options), False
    entry = cache_root() / "transitions" / cache_key(resolved, options)
    if is_shard_set(entry):
        try:
            cached = ShardSet.open(entry)
            # Finiteness was checked when the entry was written (and the checksum holds).
            return cached.load(verify=verify), bool(verify and cached.params.get("finite"))
        except DataError as exc:
            logger.warning("cache entry %s is unusable (%s); rebuilding it", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    transitions = _read(
        resolved, {**options, "workers": workers, "max_episode_steps": max_episode_steps}
    )
    finite = _is_finite(transitions)
    try:
        write_shard_set(
            transitions,
            entry,
            source={"kind": resolved.kind, "name": resolved.name, "path": str(resolved.path)},
            params={**options, "finite": finite},
            overwrite=True,
        )
    except OSError as exc:
        # A read-only or full cache must not stop the load itself.
        logger.warning("could not write the cache entry %s: %s", entry, exc)
    return transitions, finite
