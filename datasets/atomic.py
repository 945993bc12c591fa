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
    if isinstance(value, (set, tuple)):
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


def replace_directory(staging: Path, final: Path) -> None:
    """Move the complete directory ``staging`` to ``final``, replacing what was there."""
    if not final.exists():
        os.replace(staging, final)
        return
    # Two renames: the old directory moves aside, the new one moves in, then the old one goes.
    retired = tmp_name(final)
    os.replace(final, retired)
    try:
        os.replace(staging, final)
    except BaseException:
        os.replace(retired, final)
        raise
    shutil.rmtree(retired, ignore_errors=True)
