"""Where datasets and caches live on disk, and the checks that keep ids inside their root."""

from __future__ import annotations

import os
from pathlib import Path

from offaug.datasets.errors import DataError


def dataset_root(root: str | Path | None = None) -> Path:
    """The Minari datasets root: ``root``, or ``MINARI_DATASETS_PATH``, or ``~/.minari/datasets``.

    Read at call time, so a test or a worker can point it elsewhere.
    """
    if root is not None:
        return Path(root).expanduser().absolute()
    env = os.environ.get("MINARI_DATASETS_PATH")
    if env:
        return Path(env).expanduser().absolute()
    return Path.home() / ".minari" / "datasets"


def cache_root() -> Path:
    """offaug's cache of converted datasets: ``OFFAUG_CACHE_DIR``, else ``~/.cache/offaug``."""
    env = os.environ.get("OFFAUG_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    return Path.home() / ".cache" / "offaug"


def resolve_dataset_dir(dataset_id: str, root: str | Path | None = None) -> Path:
    """The directory of a Minari dataset id under ``root``; ids cannot escape the root.

    Raises:
        DataError: the id is absolute or contains ``..`` (it would point outside the root).
    """
    parts = dataset_id.split("/")
    if dataset_id.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise DataError(
            "a dataset id is [namespace/]name-vK and may not be absolute or contain '..'",
            field=f"dataset_id={dataset_id!r}",
        )
    base = dataset_root(root)
    target = (base / dataset_id).absolute()
    if base != target and base not in target.parents:
        raise DataError("resolves outside the datasets root", field=f"dataset_id={dataset_id!r}")
    return target
