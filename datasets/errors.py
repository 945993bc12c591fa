"""Errors raised by the data layer.

Every error names the file and the field it is about and says what to do, so that a user who
sees it in a pipeline log can act without reading offaug's source.
"""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """A dataset, shard or file that cannot be read as offaug expects.

    Attributes:
        path: The file or directory at fault (``None`` for in-memory data).
        field: The field, column or key at fault (``None`` when the whole file is).
        hint: What the user can do about it.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        field: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.field = field
        self.hint = hint
        parts = []
        if self.path is not None:
            parts.append(f"{self.path}")
        if field is not None:
            parts.append(f"field {field!r}")
        where = ": ".join(parts)
        text = f"{where}: {message}" if where else message
        if hint:
            text = f"{text} ({hint})"
        super().__init__(text)


class ChecksumError(DataError):
    """A shard file whose content does not match the checksum in its manifest."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """A Minari dataset id or path that is not on disk."""
