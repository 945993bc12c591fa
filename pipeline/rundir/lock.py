"""The lock of a run directory: one ``offaug run`` at a time per directory.

:class:`RunLock` holds an exclusive ``flock`` on ``RUN_DIR/run.lock`` for the whole run and
writes its holder (host, pid, start time, command) into the file. The kernel drops the lock
when the holder exits or is killed, so a second run on a held directory stops at once with
:class:`RunDirectoryLocked` naming the holder, and a run after a killed one finds the file
unlocked and takes it over (:attr:`RunLock.taken_over` names whose it was). On a filesystem
that cannot lock files at all, a run goes on unlocked with a warning.

Standard library only: ``offaug run`` takes the lock before it imports Dask, torch or the data
layer, so that a second run on a held directory stops within a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from offaug.pipeline.rundir.run_layout import RunLayout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run directory's lock."""

    host: str
    pid: int
    started: str
    """When it took the lock, ``%Y-%m-%dT%H:%M:%S%z``."""
    command: str

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started} ({self.command})"


class RunDirectoryLocked(RuntimeError):
    """Another live run holds the run directory's lock."""

    def __init__(self, lock: Path, holder: LockHolder | None) -> None:
        who = holder.describe() if holder is not None else "a run that is still starting"
        super().__init__(
            f"{lock.parent} is in use by another offaug run: {who}. Wait for it to finish, "
            f"or pass another --out; if that run is gone (its host unreachable), delete {lock}."
        )
        self.lock = lock
        self.holder = holder


class RunLock:
    """The exclusive lock of one run directory, held from :meth:`acquire` to :meth:`release`.

    ``taken_over`` is the holder recorded by a run that died holding it (``None`` when the lock
    was free and clean).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = RunLayout(Path(run_dir)).lock
        self.taken_over: LockHolder | None = None
        self._fd: int | None = None

    def acquire(self) -> LockHolder:
        """Take the lock and record this process as its holder; return that record.

        Raises:
            RunDirectoryLocked: a live process holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    raise RunDirectoryLocked(self.path, holder) from None
                if exc.errno in _NO_FLOCK:
                    log.warning("%s: the filesystem cannot lock files; running unlocked", self.path)
                    return _this_process()
                raise
            # The holder releases by deleting the file: if it did so between our open and our
            # flock, we hold a lock on a deleted file; lock the new one instead.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        self.taken_over = _read_holder(fd)
        holder = _this_process()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dataclasses.asdict(holder)).encode(), 0)
        os.fsync(fd)
        return holder

    def release(self) -> None:
        """Delete the lock file and drop the lock (deleting first: see :meth:`acquire`)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _this_process() -> LockHolder:
    return LockHolder(
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        command=" ".join(sys.argv) or sys.executable,
    )


def _read_holder(fd: int) -> LockHolder | None:
    """The holder recorded in an open lock file, or ``None`` if it records none."""
    raw = os.pread(fd, 1 << 16, 0)
    try:
        data = json.loads(raw)
        return LockHolder(
            host=str(data["host"]),
            pid=int(data["pid"]),
            started=str(data["started"]),
            command=str(data.get("command", "")),
        )
    except (ValueError, TypeError, KeyError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def describe_takeover(holder: LockHolder) -> str:
    """The log line for taking over the lock of a run that died holding it."""
    if holder.host == socket.gethostname():
        state = "not running" if not pid_alive(holder.pid) else "running but not holding it"
        gone = f"pid {holder.pid} is {state}"
    else:
        gone = "it no longer holds it"
    return f"took over the lock of a run that was killed ({holder.describe()}; {gone})"
