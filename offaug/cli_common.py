"""What every ``offaug`` command shares: the consoles, error reporting and small parsers."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
import yaml
from rich.console import Console

console = Console()
err_console = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")


class StorageFormat(str, Enum):
    """Minari storage formats offaug writes."""

    hdf5 = "hdf5"
    arrow = "arrow"


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one red error line and exit with ``code`` (2: bad input, 1: a failed check)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=code)


def guard(action: Callable[[], T], *errors: type[Exception]) -> T:
    """Run ``action``; offaug's documented errors (and ``errors``) become one line and exit 2.

    Anything else is a bug and keeps its traceback.
    """
    # Imported here: the offaug.datasets package loads gymnasium, pyarrow and h5py, which
    # `offaug --help` and the argument checks before any work should not wait for.
    from offaug.datasets.errors import DataError

    caught: tuple[type[Exception], ...] = (DataError, FileExistsError, FileNotFoundError, *errors)
    try:
        return action()
    except caught as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from exc


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML (or JSON) file holding a mapping, e.g. a learner config; exit 2 otherwise."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        fail(f"{path}: cannot read YAML ({exc})")
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        fail(f"{path}: must be a mapping of {what}")
    return loaded
