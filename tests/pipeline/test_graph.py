"""The pipeline on real Dask processes: a scheduler and workers on 127.0.0.1.

A session-wide cluster of one ``dask scheduler`` and two ``dask worker`` processes serves
the tests; the failure test starts its own so that it can kill a worker.
"""

from __future__ import annotations

import html
import json
import os
import shutil
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
import yaml

from offaug.datasets import ShardSet
from offaug.pipeline.engine.graph import run_workflow
from offaug.pipeline.engine.stage_plan import Ref, StageSpec
from offaug.pipeline.schema.workflow import Workflow

BIN = Path(sys.executable).parent


def _workflow(tmp_path: Path, **overrides: Any) -> Workflow:
    data: dict[str, Any] = {
        "name": "graph-test",
        "seed": 0,
        "source": {
            "dataset": "graph/hopper-v0",
            "make": {"env": "Hopper-v5", "steps": 1500, "seed": 3, "max_episode_steps": 40},
        },
        "bc": {"steps": 60, "hidden": [16, 16], "batch_size": 64},
        "rollout": {
            "episodes": 8,
            "tasks": 4,
            "n_envs": 2,
            "start": "dataset",
            "noise": "gaussian:0.2",
        },
        "train": {
            "algorithms": ["bc"],
            "steps": 40,
            "configs": {"bc": {"hidden": [16, 16], "batch_size": 32}},
        },
        "evaluation": {"episodes": 1},
        "diagnostics": {"enabled": False},
    }
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return Workflow.model_validate(data)


class Cluster:
    """A real scheduler and workers started as processes (logs in the test's directory)."""

    def __init__(self, directory: Path, workers: int) -> None:
        self.directory = directory
        self.scheduler_file = directory / "scheduler.json"
        self.logs: list[Any] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.scheduler = subprocess.Popen(
            [
                str(BIN / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(self.scheduler_file),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log("scheduler.log"),
            env=env,
        )
        deadline = time.time() + 60
        self.address = ""
        while not self.address and time.time() < deadline:
            try:
                self.address = json.loads(self.scheduler_file.read_text())["address"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                time.sleep(0.2)
        self.workers = [
            subprocess.Popen(
                [
                    str(BIN / "dask"),
                    "worker",
                    self.address,
                    "--nthreads",
                    "1",
                    "--nworkers",
                    "1",
                    "--no-nanny",
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                    "--name",
                    f"w{i}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=self._log(f"worker{i}.log"),
                env=env,
            )
            for i in range(workers)
        ]
        from distributed import Client

        self.client = Client(self.address, timeout="60s")
        self.client.wait_for_workers(workers, timeout=120)

    def _log(self, name: str) -> Any:
        handle = open(self.directory / name, "w")  # noqa: SIM115 - closed in close()
        self.logs.append(handle)
        return handle

    def close(self) -> None:
        self.client.close()
        # Workers first, then the scheduler: when both get SIGTERM at once, a worker can
        # receive the scheduler's close while handling its own signal, hit CancelledError in
        # Worker.close and keep its event loop running (seen in distributed's logs); the
        # harness then waited 20 s per such worker before killing it.
        for group in (self.workers, [self.scheduler]):
            for process in group:
                if process.poll() is None:
                    process.terminate()
            deadline = time.monotonic() + 10
            for process in group:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for handle in self.logs:
            handle.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, minari_root: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("dask"), workers=2)
    yield started
    started.close()


def test_runs_through_a_scheduler_address_and_skips_on_rerun(
    cluster: Cluster, tmp_path: Path
) -> None:
    workflow = _workflow(tmp_path)
    run_dir = tmp_path / "run"
    first = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert "rollout" in first.executed and not first.skipped
    records = json.loads((run_dir / "stages.json").read_text())["stages"].values()
    used = {r["worker"] for r in records} - {None}
    # Every stage ran on the external cluster's worker processes (which ones is Dask's choice).
    assert used and used <= set(cluster.client.scheduler_info()["workers"])
    shard_set = ShardSet.open(run_dir / "shards" / "augmented")
    assert len(shard_set.shards) == 4 and shard_set.episodes == 8
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # bc again on the original data for the augmented arm's total: BC's 60 steps + its 40.
    assert set(metrics["training"]) == {"bc-plain", "bc-augmented", "bc-baseline[100]"}
    augmented = metrics["training"]["bc-augmented"]
    assert (augmented["steps"], augmented["own_steps"]) == (100, 40)
    assert augmented["simulator_steps"] == shard_set.rows  # no filter: every step is a row
    comparison = metrics["comparison"]
    assert comparison["augmented"]["recipe"] == "augmented"
    assert comparison["augmented"]["steps"] == 100
    # The bar is the better of BC's plain runs at 100 steps or fewer (one seed: its score).
    plains = {name: metrics["training"][f"bc-{name}"] for name in ("plain", "baseline[100]")}
    bar = max(plains, key=lambda name: plains[name]["normalised_score"])
    assert comparison["plain"]["recipe"] == bar
    assert comparison["plain"]["steps"] == plains[bar]["steps"] <= 100
    assert comparison["augmented"]["simulator_steps"] == shard_set.rows
    assert comparison["seeds"] == [0] and comparison["outcome"] == "inconclusive"
    assert len(comparison["interval"]) == 2 and 0 <= comparison["probability_of_improvement"] <= 1
    assert comparison["sentence"].startswith("Best augmented arm bc with augmented")
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    opening = page.index(html.escape(comparison["sentence"]))
    assert opening < page.index("<h2>Does augmentation help?</h2>")
    assert (run_dir / "workflow.yaml").is_file()

    again = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert again.executed == []
    assert set(again.skipped) == set(first.executed)

    # One parameter changes: only what depends on it runs again.
    noisier = _workflow(tmp_path, rollout={"noise": "gaussian:0.3"})
    third = run_workflow(noisier, run_dir, scheduler=cluster.address)
    assert {"source", "bc", "train:bc-plain"} <= set(third.skipped)
    assert {"rollout", "train:bc-augmented", "rollout:0"} <= set(third.executed)

    forced = run_workflow(noisier, run_dir, scheduler=cluster.address, force=["bc"])
    assert "bc" in forced.executed and "rollout:1" in forced.executed
    assert "source" in forced.skipped and "train:bc-plain" in forced.skipped


def test_a_corrupted_output_is_regenerated(cluster: Cluster, tmp_path: Path) -> None:
    workflow = _workflow(tmp_path)
    run_dir = tmp_path / "run"
    run_workflow(workflow, run_dir, scheduler=cluster.address)
    victim = run_dir / "models" / "bc" / "checkpoint.pt"
    victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
    rerun = run_workflow(workflow, run_dir, scheduler=cluster.address)
    assert "bc" in rerun.executed


def test_a_killed_worker_does_not_lose_or_duplicate_shards(
    minari_root: Path, tmp_path: Path
) -> None:
    started = Cluster(tmp_path, workers=2)
    try:
        workflow = _workflow(tmp_path, rollout={"episodes": 24, "tasks": 6, "n_envs": 2})
        run_dir = tmp_path / "run"
        killed: list[int] = []

        def kill_during_rollouts() -> None:
            deadline = time.time() + 240
            stages_file = run_dir / "stages.json"
            while time.time() < deadline:
                if stages_file.is_file() and '"bc"' in stages_file.read_text():
                    time.sleep(0.3)
                    started.workers[1].send_signal(signal.SIGKILL)
                    killed.append(started.workers[1].pid)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_during_rollouts)
        killer.start()
        result = run_workflow(workflow, run_dir, scheduler=started.address)
        killer.join()
        assert killed, "the worker was killed during the run"
        shard_set = ShardSet.open(run_dir / "shards" / "augmented")
        assert len(shard_set.shards) == 6
        assert shard_set.episodes == 24
        on_disk = sorted(p.name for p in (run_dir / "shards" / "augmented").glob("*.arrow"))
        assert on_disk == sorted(Path(s.path).name for s in shard_set.shards)
        assert not shard_set.verify()
        assert shard_set.load().num_episodes == 24
        assert result.executed
    finally:
        started.close()


def test_a_second_run_on_a_held_directory_stops_at_once(
    cluster: Cluster, tmp_path: Path, minari_root: Path
) -> None:
    """Two real ``offaug run`` on one ``--out``: the second stops within seconds, naming the
    first's host, pid and start time, while the first runs on and succeeds.
    """
    workflow_file = tmp_path / "wf.yaml"
    workflow_file.write_text(yaml.safe_dump(_workflow(tmp_path).model_dump(mode="json")))
    run_dir = tmp_path / "run"
    command = [str(BIN / "offaug"), "run", str(workflow_file), "--out", str(run_dir)]
    command += ["--scheduler", cluster.address]
    env = {**os.environ, "MINARI_DATASETS_PATH": str(minari_root)}
    first_log = tmp_path / "first.log"
    with first_log.open("w") as log:
        first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
    lock = run_dir / "run.lock"
    deadline = time.time() + 120
    while time.time() < deadline and not (
        lock.is_file() and f'"pid": {first.pid}' in lock.read_text()
    ):
        time.sleep(0.05)
    assert first.poll() is None, "the first run holds the lock"
    started = time.perf_counter()
    second = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    assert first.poll() is None, f"the second run waited for the first ({elapsed:.1f} s)"
    assert second.returncode == 3, second.stderr
    message = " ".join(second.stderr.split())
    holder = json.loads(lock.read_text())
    assert f"host {socket.gethostname()}, pid {first.pid}, started {holder['started']}" in message
    assert "in use by another offaug run" in message and "another --out" in message

    assert first.wait(timeout=600) == 0, first_log.read_text()
    assert not lock.exists()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # With the equal-steps plain arm: BC's 60 steps + the augmented arm's 40.
    assert set(metrics["training"]) == {"bc-plain", "bc-augmented", "bc-baseline[100]"}


def test_invalid_resources_fail_naming_the_stage(cluster: Cluster, tmp_path: Path) -> None:
    from offaug.pipeline.engine.graph import StageFailed

    workflow = _workflow(tmp_path, train={"resources": {"GPU": 1}})
    with pytest.raises(StageFailed, match="GPU"):
        run_workflow(workflow, tmp_path / "run", scheduler=cluster.address)


def test_workflow_files_validate(tmp_path: Path) -> None:
    from offaug.pipeline.schema.validation import WorkflowError
    from offaug.pipeline.schema.workflow import load_workflow

    for path in sorted(Path("workflows").glob("*.yaml")):
        load_workflow(path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"name": "x", "source": {"dataset": "a-v0"}, "rollout": {"episodes": -1, "nosie": 1}}
        )
    )
    with pytest.raises(WorkflowError) as info:
        load_workflow(bad)
    message = str(info.value)
    assert "rollout.episodes" in message and "rollout.nosie" in message and "bad.yaml:" in message


def test_learner_configs_are_checked_against_their_config_classes(tmp_path: Path) -> None:
    """A typo in a learner's config fails validation, naming file, line and field, before BC
    and the rollouts have run; so do wrong types, unknown learners and typos under ``bc``.
    """
    from offaug.pipeline.schema.validation import WorkflowError
    from offaug.pipeline.schema.workflow import load_workflow

    path = tmp_path / "typo.yaml"
    path.write_text(
        "name: x\n"
        "source: {dataset: a/b-v0}\n"
        "train:\n"
        "  configs:\n"
        "    cql: {hiden: [64, 64], learning_rat: 3}\n"
        "    bcq:\n"
        "      batch_size: 2.5\n"
        "      actor_hidden: [64, many]\n"
        "    qlearn: {}\n"
        "bc:\n"
        "  hiden: [3]\n"
    )
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    lines = str(info.value).splitlines()

    def line_of(field: str) -> str:
        return next(line for line in lines if f": {field}: " in line)

    hiden = line_of("train.configs.cql.hiden")
    assert hiden.startswith(f"{path}:5: ") and "allowed here:" in hiden
    assert "critic_learning_rate" in hiden and "hidden" in hiden
    assert line_of("train.configs.cql.learning_rat").startswith(f"{path}:5: ")
    assert line_of("train.configs.bcq.batch_size").startswith(f"{path}:7: ")
    assert line_of("train.configs.bcq.actor_hidden.1").startswith(f"{path}:8: ")
    assert "cql, bcq" in line_of("train.configs.qlearn")
    assert line_of("bc.hiden").startswith(f"{path}:11: ")
    assert len(lines) == 6

    # The same check for a workflow built in Python, and valid configs pass untouched.
    with pytest.raises(ValueError, match=r"cql\.hiden"):
        _workflow(tmp_path, train={"configs": {"cql": {"hiden": [64, 64]}}})
    good = _workflow(tmp_path, train={"configs": {"cql": {"hidden": [64, 64], "gamma": 1}}})
    assert good.train.configs["cql"] == {"hidden": [64, 64], "gamma": 1}


def test_stage_keys_ignore_yaml_key_order_but_not_values(tmp_path: Path) -> None:
    """A workflow written out by ``yaml.safe_dump`` (keys sorted) and read back keeps its stage
    keys, so ``offaug run`` on that file resumes a run started in-process; a changed value
    changes the key.
    """
    from offaug.pipeline.engine.plan import plan_workflow
    from offaug.pipeline.rundir.run_layout import RunLayout

    workflow = _workflow(
        tmp_path, train={"configs": {"bc": {"hidden": [16, 16], "batch_size": 32}}}
    )
    reloaded = Workflow.model_validate(
        yaml.safe_load(yaml.safe_dump(workflow.model_dump(mode="json"), sort_keys=True))
    )
    assert list(reloaded.train.configs["bc"]) != list(workflow.train.configs["bc"])
    changed = _workflow(tmp_path, train={"configs": {"bc": {"hidden": [16, 16], "batch_size": 33}}})

    def key(w: Workflow) -> str:
        return plan_workflow(w, RunLayout(tmp_path / "run"), 1).keys["train:bc-plain"]

    assert key(reloaded) == key(workflow)
    assert key(changed) != key(workflow)


def _sleep_stage(name: str, seconds: float, after: str | None = None) -> StageSpec:
    """A stage that sleeps ``seconds``, once the stage ``after`` (if any) has finished."""

    # Defined here, not at the top level: cloudpickle then ships it by value, and the workers
    # need not import this test module.
    def sleep(seconds: float, *_after: Any) -> None:
        time.sleep(seconds)

    return StageSpec(name, sleep, {"seconds": seconds}, (seconds, *([Ref(after)] if after else [])))


def test_a_ready_stage_goes_to_the_worker_that_frees_up(cluster: Cluster, tmp_path: Path) -> None:
    """Two stages become ready while one of the two workers is busy: the first runs on the free
    worker, the second waits for a free worker and runs on the one that frees up, not queued
    behind the first (the stranding that left a worker idle for 40 s of the quickstart).
    """
    from offaug.pipeline.engine.scheduler import StageScheduler
    from offaug.pipeline.rundir.files import StageRecords
    from offaug.pipeline.rundir.run_layout import RunLayout

    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir(parents=True)
    events: list[tuple[str, str]] = []
    graph = StageScheduler(
        cluster.client,
        StageRecords(layout),
        (),
        lambda stage, event, _: events.append((stage, event)),
        1,
    )
    for spec in (
        _sleep_stage("long", 1.5),
        _sleep_stage("short", 0.1),
        _sleep_stage("first", 2.0, after="short"),
        _sleep_stage("second", 0.5, after="short"),
    ):
        graph.add(spec, spec.name)
    graph.run()

    workers = {n: r["worker"] for n, r in json.loads(layout.stages.read_text())["stages"].items()}
    assert workers["long"] != workers["short"]
    assert workers["first"] == workers["short"]
    assert workers["second"] == workers["long"]
    assert events.index(("second", "submitted")) > events.index(("long", "finished"))
    assert sorted(graph.executed) == ["first", "long", "second", "short"]


def test_worker_side_modules_do_not_import_torch() -> None:
    """Unpickling a stage or the worker plugin imports these modules on every worker before
    the first stage runs; torch (seconds to import) is imported in the background instead.
    """
    code = (
        "import sys, offaug.pipeline.stages.learning, offaug.pipeline.engine.workers; "
        "print(sorted(m for m in ('torch', 'scipy.stats') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_threads_busy_with_another_clients_work_are_not_counted_free(
    cluster: Cluster, tmp_path: Path
) -> None:
    """On a shared cluster another client's task holds one of the two threads: both stages of
    this run go to the free worker one after the other instead of one queueing behind it.
    """
    from distributed import Client

    from offaug.pipeline.engine.scheduler import StageScheduler
    from offaug.pipeline.rundir.files import StageRecords
    from offaug.pipeline.rundir.run_layout import RunLayout

    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir(parents=True)
    with Client(cluster.address, timeout="30s") as other:
        busy = other.submit(time.sleep, 8.0, pure=False)
        deadline = time.time() + 30
        while not any(other.processing().values()) and time.time() < deadline:
            time.sleep(0.05)
        occupied = next(w for w, keys in other.processing().items() if keys)
        graph = StageScheduler(cluster.client, StageRecords(layout), (), lambda *_: None, 1)
        for spec in (_sleep_stage("a", 0.3), _sleep_stage("b", 0.3)):
            graph.add(spec, spec.name)
        started = time.perf_counter()
        graph.run()
        elapsed = time.perf_counter() - started
        assert not busy.done(), f"the other client's task ended first ({elapsed:.1f} s)"
        busy.result()  # leave the cluster idle for the next test
    workers = {n: r["worker"] for n, r in json.loads(layout.stages.read_text())["stages"].items()}
    assert workers["a"] == workers["b"] != occupied


@pytest.mark.slow
def test_seeds_and_recipes_run_as_planned_and_give_a_verdict(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two seeds x two recipes on real workers: the stages of the plan ran (the rollout shared
    by the recipes that differ only in training once per seed), and metrics.json carries every
    run and the verdict, which the report shows first."""
    workflow = _workflow(
        tmp_path,
        seeds=[0, 1],
        rollout={"episodes": 4, "tasks": 2},
        # One training stage per seed (the fused seeds are test_fused_seeds_match_...'s).
        train={"fuse_seeds": False},
        recipes={"augmented": {}, "mixed": {"train": {"mixing": [0.8, 0.2]}}},
        diagnostics={"enabled": True, "max_states": 200, "k": 3},
        evaluation={"episodes": 2},
    )
    run_dir = tmp_path / "run"
    result = run_workflow(workflow, run_dir, scheduler=cluster.address)
    stages = json.loads((run_dir / "stages.json").read_text())["stages"]
    expected = {
        "bc",
        "bc@s1",
        "rollout:0",
        "rollout:1",
        "rollout",
        "rollout:0@s1",
        "rollout@s1",
        "train:bc-plain",
        "train:bc-plain@s1",
        "train:bc-augmented",
        "train:bc-augmented@s1",
        "train:bc-mixed",
        "train:bc-mixed@s1",
        "diagnose",
        "diagnose[mixed]",
        "report",
    }
    assert expected <= set(stages) and set(result.executed) == set(stages)
    assert not any(name.startswith("rollout[mixed]") for name in stages)
    assert stages["train:bc-mixed@s1"]["inputs"] == ["source", "rollout@s1"]
    assert (run_dir / "shards" / "augmented@s1" / "manifest.json").is_file()
    assert (run_dir / "diagnostics" / "diagnose[mixed].json").is_file()

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["seeds"] == [0, 1]
    entry = metrics["training"]["bc-mixed@s1"]
    assert {"learner", "recipe", "seed", "return", "normalised_score", "checkpoint"} <= set(entry)
    assert (entry["learner"], entry["recipe"], entry["seed"]) == ("bc", "mixed", 1)
    assert set(metrics["training"]) == {
        f"bc-{recipe}{suffix}"
        for recipe in ("plain", "augmented", "mixed", "baseline[100]")
        for suffix in ("", "@s1")
    }
    verdicts = {v["recipe"]: v for v in metrics["verdict"]}
    assert set(verdicts) == {"augmented", "mixed"}
    for verdict in verdicts.values():
        assert verdict["seeds"] == [0, 1] and verdict["learner"] == "bc"
        assert verdict["outcome"] in ("helps", "hurts", "inconclusive")
        assert len(verdict["interval"]) == 2 and 0 <= verdict["probability_of_improvement"] <= 1
    assert metrics["verdict_headline"].startswith("bc with ")
    recipe = metrics["recipes"]["mixed"]
    assert recipe["rollout"] == "rollout" and recipe["weighting"] == "behaviour"
    assert 0 < recipe["ess_fraction"] <= 1 and recipe["ood_share"] is not None
    assert recipe["augmented_reward_per_step"] is not None
    # One noise per seed (the rollout default, uncalibrated); no filter, so no kept counts.
    assert recipe["noise"] == [workflow.rollout.noise.text] * 2 and not recipe["calibrated"]
    assert recipe["episodes_kept"] is None
    # Beside the verdict, the quality of the recipe's rollouts: simulator rollouts of Hopper
    # replay in the env from states rebuilt from their observations.
    quality = recipe["quality"]["simulator"]
    assert quality["state"]["kind"] == "rebuilt" and quality["dynamics_error"]["max"] < 1e-4
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert page.index("<h2>Does augmentation help?</h2>") < page.index("<h2>Headline</h2>")
    assert "bc with mixed" in page
    assert "<td>mixed</td><td>simulator</td><td>rebuilt</td>" in page


@pytest.mark.slow
def test_fused_seeds_match_one_stage_per_seed(cluster: Cluster, tmp_path: Path) -> None:
    """Two seeds of td3bc trained fused (one stage per recipe) and one stage per seed leave
    the same files in every seed's model directory and the same final returns (to float32
    rounding: batched matrix multiplies round differently); a rerun reuses the fused stages,
    and forcing one seed's train stage reruns its fused stage."""
    train = {"algorithms": ["td3bc"], "configs": {"td3bc": {"hidden": [16, 16], "batch_size": 32}}}
    sections: dict[str, Any] = {"seeds": [0, 1], "rollout": {"episodes": 4, "tasks": 2}}
    fused_workflow = _workflow(tmp_path, train=train, **sections)
    run_dir = tmp_path / "run"
    fused = run_workflow(fused_workflow, run_dir, scheduler=cluster.address)
    assert {
        "fused:td3bc-plain",
        "fused:td3bc-augmented",
        "fused:td3bc-baseline[100]",
    } <= set(fused.executed)
    stages = json.loads((run_dir / "stages.json").read_text())["stages"]
    assert stages["fused:td3bc-augmented"]["inputs"] == ["source", "rollout", "rollout@s1"]
    assert stages["train:td3bc-augmented@s1"]["inputs"] == ["fused:td3bc-augmented"]
    labels = [f"td3bc-{r}{s}" for r in ("plain", "augmented", "baseline[100]") for s in ("", "@s1")]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(metrics["training"]) == set(labels)
    assert {e["seed"] for e in metrics["training"].values()} == {0, 1}
    assert {v["recipe"]: v["seeds"] for v in metrics["verdict"]} == {"augmented": [0, 1]}
    kept = tmp_path / "fused-models"
    shutil.copytree(run_dir / "models", kept)

    again = run_workflow(fused_workflow, run_dir, scheduler=cluster.address)
    assert again.executed == [] and "fused:td3bc-augmented" in again.skipped
    forced = run_workflow(
        fused_workflow, run_dir, scheduler=cluster.address, force=["train:td3bc-augmented@s1"]
    )
    assert {"fused:td3bc-augmented", "train:td3bc-augmented"} <= set(forced.executed)
    assert "fused:td3bc-plain" in forced.skipped

    apart_train = {**train, "fuse_seeds": False}
    apart = run_workflow(
        _workflow(tmp_path, train=apart_train, **sections), run_dir, scheduler=cluster.address
    )
    assert not any(name.startswith("fused:") for name in apart.executed)
    assert {"bc@s1", "rollout@s1"} <= set(apart.skipped)  # the same data, reused
    apart_metrics = json.loads((run_dir / "metrics.json").read_text())
    for label in labels:
        mine, theirs = kept / label, run_dir / "models" / label
        assert {p.relative_to(mine) for p in mine.rglob("*")} == {
            p.relative_to(theirs) for p in theirs.rglob("*")
        }, label
        lines = [json.loads(x) for x in (mine / "metrics.jsonl").read_text().splitlines()]
        reference = [json.loads(x) for x in (theirs / "metrics.jsonl").read_text().splitlines()]
        assert [list(x) for x in lines] == [list(x) for x in reference], label
        fused_return = metrics["training"][label]["return"]
        assert fused_return == pytest.approx(apart_metrics["training"][label]["return"], rel=1e-4)


def test_rollout_rounds_run_on_workers_and_score_the_last_policy(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two rounds: TD3+BC's plain run rolls out, TD3+BC retrained on the data and those
    rollouts rolls out again, and the recipe trains on the second round's rollouts."""
    td3bc = {"hidden": [16, 16], "batch_size": 32}
    workflow = _workflow(
        tmp_path,
        rollout={"episodes": 4, "tasks": 2, "policy": "td3bc", "rounds": 2},
        train={"configs": {"bc": {"hidden": [16, 16], "batch_size": 32}, "td3bc": td3bc}},
    )
    run_dir = tmp_path / "run"
    result = run_workflow(workflow, run_dir, scheduler=cluster.address)
    stages = json.loads((run_dir / "stages.json").read_text())["stages"]
    assert {"train:td3bc-plain", "rollout[round1]", "train:td3bc-augmented.round1"} <= set(
        result.executed
    )
    assert stages["train:td3bc-augmented.round1"]["inputs"] == ["source", "rollout[round1]"]
    assert stages["rollout:0"]["inputs"] == ["source", "bc", "train:td3bc-augmented.round1"]
    assert stages["train:bc-augmented"]["inputs"] == ["source", "rollout"]
    assert (run_dir / "shards" / "augmented[round1]" / "manifest.json").is_file()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # Only the recipe's learner is a run of the recipe; the retrained policy is not. bc's
    # equal-steps plain run: BC 60 + td3bc's plain 40 + the retrained td3bc 40 + bc's own 40.
    assert set(metrics["training"]) == {
        "bc-plain",
        "bc-augmented",
        "td3bc-plain",
        "bc-baseline[180]",
    }
    assert metrics["training"]["bc-augmented"]["steps"] == 180
    retrained = json.loads(
        (run_dir / "models" / "td3bc-augmented.round1" / "metrics.jsonl")
        .read_text()
        .splitlines()[-1]
    )
    assert metrics["recipes"]["augmented"]["policy"] == "td3bc"
    assert metrics["recipes"]["augmented"]["rollout_policy_score"] == pytest.approx(
        retrained["normalised_score"]
    )


@pytest.mark.slow
def test_mobile_model_rollouts_run_on_workers_with_the_learners_critics(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Model rollouts with MOBILE's penalty: TD3+BC's plain run is the rollout policy whose
    critics value the ensemble's next states; the recipe's quality report is the model's."""
    dynamics = {"members": 3, "hidden": [16], "steps": 30, "starts": 20}
    workflow = _workflow(
        tmp_path,
        rollout={
            "backend": "model",
            "policy": "td3bc",
            "tasks": 1,
            "horizon": 2,
            "dynamics": {**dynamics, "penalty": "mobile", "mobile_samples": 2},
        },
        train={"configs": {"bc": {"hidden": [16, 16]}, "td3bc": {"hidden": [16, 16]}}},
        diagnostics={"enabled": True, "max_states": 200, "k": 3},
    )
    run_dir = tmp_path / "run"
    run_workflow(workflow, run_dir, scheduler=cluster.address)
    stages = json.loads((run_dir / "stages.json").read_text())["stages"]
    assert stages["rollout:0"]["inputs"] == ["source", "bc", "dynamics", "train:td3bc-plain"]
    shards = ShardSet.open(run_dir / "shards" / "augmented")
    rows = shards.load()
    assert len(rows) > 0 and rows.meta["penalty"] == "mobile"
    np.testing.assert_allclose(
        rows.rewards, rows.extras["raw_reward"] - rows.extras["model_uncertainty"], atol=1e-5
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    quality = metrics["recipes"]["augmented"]["quality"]["model"]
    # Model rollouts of Hopper: states rebuilt from the observations, with a model's error.
    assert quality["state"]["kind"] == "rebuilt" and quality["dynamics_error"]["median"] > 0
