"""The run directory's reader and lock, with real processes holding and dying with the lock.

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

from offaug.datasets import DataError
from offaug.pipeline.layout import DatasetRef, ModelRef, RunLayout
from offaug.pipeline.rundir import (
    RunDirectoryLocked,
    RunLock,
    StageRecords,
    read_stage_records,
)

HOLD = """
import sys, time
from pathlib import Path
from offaug.pipeline.layout import RunLayout
from offaug.pipeline.rundir import RunLock
lock = RunLock(RunLayout(Path(sys.argv[1])))
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
            RunLock(RunLayout(tmp_path)).acquire()
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
    lock = RunLock(RunLayout(tmp_path))
    mine = lock.acquire()
    try:
        assert lock.taken_over is not None and lock.taken_over.pid == holder.pid
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid() == mine.pid
    finally:
        lock.release()
    assert not (tmp_path / "run.lock").exists()
    # Released cleanly: the next run finds nothing to take over.
    with RunLock(RunLayout(tmp_path)) as again:
        assert again.taken_over is None


def test_a_released_lock_is_free_at_once(tmp_path: Path) -> None:
    started = time.perf_counter()
    for _ in range(3):
        with RunLock(RunLayout(tmp_path)):
            pass
    assert time.perf_counter() - started < 5


def test_stage_records_decode_to_their_types(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    source = DatasetRef("a/b-v0", 10, 2, "id", True, {"format": "hdf5"})
    model = ModelRef("bc", str(tmp_path / "bc.pt"), "x", {"train": {}})
    records = StageRecords(layout)
    records.record("source", "k1", source, 1.0, None, [])
    records.record("train:bc-original", "k2", model, 2.0, "tcp://w", ["source"])
    read = read_stage_records(tmp_path)
    assert read.result("source", DatasetRef) == source
    assert read.results("train:", ModelRef) == [model]
    assert "source" in read and "rollout" not in read
    with pytest.raises(DataError, match="no finished 'rollout' stage"):
        read.result("rollout", ModelRef)
    with pytest.raises(DataError, match="not a ModelRef"):
        read.result("source", ModelRef)
    with pytest.raises(FileNotFoundError, match=r"stages\.json"):
        read_stage_records(tmp_path / "elsewhere")
