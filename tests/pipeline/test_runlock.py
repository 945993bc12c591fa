"""The run directory's lock, with real processes holding it and dying with it.

Two real ``offaug run`` processes on one directory, and a run killed with SIGKILL, are in
``tests/pipeline/test_graph.py`` and ``tests/faults/test_faults.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offaug.pipeline.rundir.lock import RunDirectoryLocked, RunLock

HOLD = """
import sys, time
from offaug.pipeline.rundir.lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    """A process that takes the lock of ``run_dir`` and sleeps holding it."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirectoryLocked) as info:
            RunLock(tmp_path).acquire()
        message = str(info.value)
        assert f"pid {holder.pid}" in message and socket.gethostname() in message
        assert "started 20" in message and "--out" in message
        assert info.value.holder is not None and info.value.holder.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock(tmp_path)
    mine = lock.acquire()
    try:
        assert lock.taken_over is not None and lock.taken_over.pid == holder.pid
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid() == mine.pid
    finally:
        lock.release()
    assert not (tmp_path / "run.lock").exists()
    # Released cleanly: the next run finds nothing to take over.
    with RunLock(tmp_path) as again:
        assert again.taken_over is None


def test_a_released_lock_is_free_at_once(tmp_path: Path) -> None:
    started = time.perf_counter()
    for _ in range(3):
        with RunLock(tmp_path):
            pass
    assert time.perf_counter() - started < 5
