"""Fault injection with real processes: killed workers and runs, corrupted shards, a full disk,
malformed input and unsafe payloads. Each test says what it injects and what must survive.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from offaug.algorithms.base import CheckpointError, load_checkpoint
from offaug.datasets import DataError, ShardSet, load_transitions, write_shard_set
from offaug.pipeline.engine.graph import run_workflow
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow
from tests.pipeline.test_graph import Cluster, _workflow

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, minari_root: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("dask-faults"), workers=2)
    yield started
    started.close()


def _final_files_are_whole(directory: Path) -> None:
    """Every .arrow file under its final name reads back (hidden temporary names aside)."""
    from offaug.datasets.shards import read_shard

    for path in directory.rglob("*.arrow"):
        if not path.name.startswith("."):
            read_shard(path, verify=False)


def test_flipped_byte_is_found_by_verify_and_only_that_shard_is_redone(
    cluster: Cluster, tmp_path: Path
) -> None:
    workflow = _workflow(tmp_path)
    run_dir = tmp_path / "run"
    run_workflow(workflow, run_dir, scheduler=cluster.address)
    shards = sorted((run_dir / "shards" / "augmented").glob("shard-*.arrow"))
    victim = shards[2]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))

    with pytest.raises(DataError, match=victim.name):
        ShardSet.open(run_dir / "shards" / "augmented").load()
    verify = subprocess.run(
        [str(BIN / "offaug"), "verify", str(run_dir)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 1
    assert victim.name in verify.stderr and shards[0].name not in verify.stderr

    rerun = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert "rollout:2" in rerun.executed
    assert {"rollout:0", "rollout:1", "rollout:3", "bc", "source"} <= set(rerun.skipped)
    assert not ShardSet.open(run_dir / "shards" / "augmented").verify()


def test_killing_offaug_run_mid_stage_then_rerunning_resumes(
    cluster: Cluster, tmp_path: Path, minari_root: Path
) -> None:
    workflow_file = tmp_path / "wf.yaml"
    workflow = _workflow(
        tmp_path, rollout={"episodes": 40, "tasks": 8, "n_envs": 2}, train={"steps": 300}
    )
    workflow_file.write_text(yaml.safe_dump(workflow.model_dump(mode="json")))
    run_dir = tmp_path / "run"
    env = {**os.environ, "MINARI_DATASETS_PATH": str(minari_root)}
    process = subprocess.Popen(
        [
            str(BIN / "offaug"),
            "run",
            str(workflow_file),
            "--out",
            str(run_dir),
            "--scheduler",
            cluster.address,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stages_file = run_dir / "stages.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (
        stages_file.is_file() and '"bc"' in stages_file.read_text()
    ):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    finished_before = set(json.loads(stages_file.read_text())["stages"])
    assert "bc" in finished_before and "rollout" not in finished_before
    _final_files_are_whole(run_dir)
    # The killed run could not release its lock: the file still names it.
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == process.pid

    resumed = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert finished_before <= set(resumed.skipped)
    shard_set = ShardSet.open(run_dir / "shards" / "augmented")
    assert shard_set.episodes == 40 and not shard_set.verify()
    # ... and the next run took the lock over, said so in the run's log, and released it.
    assert resumed.lock_taken_over is not None and resumed.lock_taken_over.pid == process.pid
    log = (run_dir / "logs" / "run.log").read_text()
    assert f"took over the lock of a run that was killed (host {socket.gethostname()}" in log
    assert f"pid {process.pid} is not running" in log
    assert not (run_dir / "run.lock").exists()


def test_killing_a_worker_during_training_still_completes(
    tmp_path: Path, minari_root: Path
) -> None:
    started = Cluster(tmp_path, workers=2)
    try:
        workflow = _workflow(tmp_path, train={"steps": 3000})
        run_dir = tmp_path / "run"
        killed: list[bool] = []

        def kill_during_training() -> None:
            stages_file = run_dir / "stages.json"
            deadline = time.time() + 300
            while time.time() < deadline:
                if stages_file.is_file() and '"rollout"' in stages_file.read_text():
                    time.sleep(0.5)
                    started.workers[0].send_signal(signal.SIGKILL)
                    killed.append(True)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_during_training)
        killer.start()
        run_workflow(workflow, run_dir, scheduler=started.address)
        killer.join()
        assert killed
        metrics = json.loads((run_dir / "metrics.json").read_text())
        # The equal-steps plain arm: BC's 60 steps and the augmented arm's 3,000.
        assert set(metrics["training"]) == {"bc-plain", "bc-augmented", "bc-baseline[3060]"}
        for name in ("bc-plain", "bc-augmented"):
            assert (
                load_checkpoint(run_dir / "models" / name / "checkpoint.pt").extra["step"] == 3000
            )
    finally:
        started.close()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    yield mount
    import gc

    gc.collect()  # memory maps of files on the tmpfs keep it busy
    if subprocess.run(["umount", str(mount)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_gives_a_clear_error_and_leaves_nothing_corrupt(
    make_test_dataset, tiny_disk: Path
) -> None:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    small = data.slice(0, 50)
    write_shard_set(small, tiny_disk / "kept")
    before = ShardSet.open(tiny_disk / "kept").load()
    big = data.take(np.resize(np.arange(len(data)), 20_000))
    with pytest.raises(OSError) as info:
        write_shard_set(big, tiny_disk / "kept", overwrite=True)
    assert "No space" in str(info.value) or info.value.errno == 28
    # The old set is intact, nothing half-written is left beside it.
    assert ShardSet.open(tiny_disk / "kept").load().equals(before)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["kept"]
    del before


class _Exploit:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/offaug-pwned",))


def test_a_pickle_payload_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    marker = Path("/tmp/offaug-pwned")
    marker.unlink(missing_ok=True)
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "state": _Exploit()}, path)
    with pytest.raises(CheckpointError, match=r"refused|cannot load"):
        load_checkpoint(path)
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError):
        load_checkpoint(raw)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: x\nsource: {dataset: a-v0}\ntrain: !!python/object/apply:os.system ['true']\n",
            "not valid YAML",
        ),
        (
            "name: x\nsource: {dataset: a-v0}\ntrain: {algorithms: [os.system]}\n",
            "train.algorithms.0",
        ),
        ("name: x\nsource: {dataset: a-v0}\nrollout: {episodes: -5}\n", "rollout.episodes"),
        ("name: x\nsource: {dataset: a-v0}\nrollout: {episodes: many}\n", "rollout.episodes"),
        ("name: x\nsource: {dataset: a-v0}\nbogus: 1\n", "bogus"),
        ("name: x\nsource: [\n", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
    ],
)
def test_malformed_workflows_name_the_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text(text)
    with pytest.raises(WorkflowError, match=expected):
        load_workflow(path)
