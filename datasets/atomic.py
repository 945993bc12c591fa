"""Write-then-rename: the one home of offaug's atomic file and directory writes.

Every writer in offaug (shards, manifests, checkpoints, published datasets, run records) goes
through these helpers, so a reader sees either the complete old content or the complete new
content, never a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


def tmp_name(path: Path) -> Path:
    """A hidden sibling name for ``path``: a rename from it is atomic on the same file system."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")


def json_default(value: Any) -> Any:
    """``json.dumps`` fallback for numpy scalars/arrays, sets, tuples and paths."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; rename it into place on success.

    On any exception the temporary file is removed and whatever was at ``path`` stays.
    """
    final = Path(path)
    tmp = tmp_name(final)
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename."""
    write_text_atomic(path, json.dumps(data, indent=2, default=json_default) + "\n")


def replace_directory(staging: Path, final: Path, *, overwrite: bool = True) -> None:
    """Move the complete directory ``staging`` to ``final``.

    With ``overwrite`` what was at ``final`` is replaced; without it an existing ``final``
    (including one that appeared while ``staging`` was being built) is refused.

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is false.
    """
    if not final.exists():
        try:
            os.rename(staging, final)
            return
        except OSError:
            if not final.exists():
                raise
            # ``final`` appeared while ``staging`` was built: treated as an existing one.
    if not overwrite:
        raise FileExistsError(f"{final}: exists; pass overwrite=True to replace it")
    # Two renames: the old directory moves aside, the new one moves in, then the old one goes.
    retired = tmp_name(final)
    os.replace(final, retired)
    try:
        os.replace(staging, final)
    except BaseException:
        os.replace(retired, final)
        raise
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(final: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a new, empty hidden sibling of ``final`` to fill; move it into place on success.

    The existing ``final`` is refused up front unless ``overwrite``, and replaced only once the
    block has completed. On any exception the staging directory is removed and whatever was at
    ``final`` stays. Hidden, so listings of the parent (Minari's among them) skip it.

    Raises:
        FileExistsError: ``final`` exists and ``overwrite`` is false.
    """
    target = Path(final)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tmp_name(target)
    staging.mkdir()
    try:
        yield staging
        replace_directory(staging, target, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
