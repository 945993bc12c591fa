"""Build the Dask graph of a workflow's stages and compute it, skipping what is already done.

The one module that drives Dask. Stages (:mod:`offaug.pipeline.stages`) are submitted with
``client.submit`` as soon as the stages they depend on have finished and a worker thread is
free (:class:`_Graph`), so independent stages (rollout tasks, learners, each learner's
diagnostics) run in parallel and a long stage never waits behind another on a busy worker.
Stages pass small references (paths, checksums), never arrays.

**Skipping and resuming.** Every stage has a key: a hash of its name, its part of the workflow
and the keys of its inputs. A finished stage's record (key, result, seconds, worker) is written
to ``stages.json`` as soon as it finishes. On the next run a stage whose key is unchanged and
whose outputs still verify (files present, checksums equal) is not submitted at all; changing
one parameter changes the keys of that stage and of everything downstream, and nothing else.
``force`` reruns named stages (and so their dependents).

**Resilience.** Tasks are submitted with retries; a worker killed mid-task has its task
rescheduled by the scheduler. Stage outputs are written atomically under deterministic names,
so a rerun task replaces, never duplicates.

**Workers.** A worker plugin (:mod:`offaug.pipeline.workers`) pins torch and BLAS to the
worker's thread count (one per core by default) so parallel tasks do not oversubscribe the
machine, and imports torch in the background while the first stages run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from offaug.datasets.atomic import write_json_atomic
from offaug.datasets.shards import ShardRef, file_checksum
from offaug.pipeline import stages
from offaug.pipeline.layout import AugmentedRef, DatasetRef, ModelRef, RunLayout
from offaug.pipeline.rollout_tasks import RolloutShard
from offaug.pipeline.workers import WorkerSetup, run_stage
from offaug.pipeline.workflow import Workflow

RESULT_TYPES: dict[str, type[Any]] = {
    "DatasetRef": DatasetRef,
    "ModelRef": ModelRef,
    "AugmentedRef": AugmentedRef,
    "RolloutShard": RolloutShard,
    "ShardRef": ShardRef,
}


class StageFailed(RuntimeError):
    """A stage raised; the message names it."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed: {type(cause).__name__}: {cause}")
        self.stage = stage


def _hash(*parts: Any) -> str:
    """A stage key: the same for equal configs however their YAML orders mapping keys."""
    text = json.dumps(parts, sort_keys=True, default=_key_default)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _key_default(value: Any) -> Any:
    # A pydantic model hashes by its JSON dump, never by str(): str() keeps the insertion order
    # of nested dicts, so the same workflow loaded from a key-sorted YAML got another key and
    # reran stages that had finished.
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "__type__": type(value).__name__,
            **{f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__type__" in value:
        kind = RESULT_TYPES.get(value["__type__"])
        fields = {k: _from_json(v) for k, v in value.items() if k != "__type__"}
        if kind is None:
            return fields
        # JSON has no tuples: restore the dataclass fields that are tuples.
        for field in dataclasses.fields(kind):
            if isinstance(fields.get(field.name), list) and "tuple" in str(field.type):
                fields[field.name] = tuple(fields[field.name])
        return kind(**fields)
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _outputs_verify(result: Any) -> bool:
    """Whether a recorded result's files are still there and unchanged."""
    if isinstance(result, ModelRef):
        return Path(result.path).is_file() and file_checksum(result.path) == result.checksum
    if isinstance(result, RolloutShard):
        shard = result.shard
        return Path(shard.path).is_file() and file_checksum(shard.path) == shard.checksum
    if isinstance(result, AugmentedRef):
        manifest = Path(result.directory) / "manifest.json"
        if not manifest.is_file() or file_checksum(manifest) != result.manifest_checksum:
            return False
        from offaug.datasets.shards import ShardSet

        return not ShardSet.open(result.directory).verify()
    if isinstance(result, DatasetRef):
        from offaug.datasets.sources import cache_key, resolve_source

        try:
            resolved = resolve_source(result.source)
        except Exception:  # a source that vanished is simply stale
            return False
        keys = {"info_keys": ["qpos", "qvel"] if result.has_simulator_state else []}
        return cache_key(resolved, keys) == result.identity
    if isinstance(result, dict) and result.get("kind") == "files":
        return all(Path(p).is_file() for p in result["paths"])
    return True


class StageRecords:
    """``stages.json``: what finished, with which key, result, duration and worker."""

    def __init__(self, layout: RunLayout) -> None:
        self.path = layout.stages
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                self.records = json.loads(self.path.read_text()).get("stages", {})
            except json.JSONDecodeError:
                self.records = {}

    def cached(self, name: str, key: str) -> Any | None:
        record = self.records.get(name)
        if record is None or record.get("key") != key:
            return None
        result = _from_json(record["result"])
        return result if _outputs_verify(result) else None

    def record(
        self,
        name: str,
        key: str,
        result: Any,
        seconds: float,
        worker: str | None,
        inputs: Sequence[str],
    ) -> None:
        self.records[name] = {
            "key": key,
            "inputs": list(inputs),
            "result": _to_json(result),
            "seconds": seconds,
            "worker": worker,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json_atomic(self.path, {"stages": self.records})


@dataclasses.dataclass
class RunResult:
    """What a run produced."""

    run_dir: Path
    results: dict[str, Any]
    skipped: list[str]
    executed: list[str]
    wall_seconds: float
    stage_seconds: dict[str, float]
    dashboard: str | None


def connect(workflow: Workflow, scheduler: str | None) -> tuple[Any, Any]:
    """A Dask client: ``scheduler`` or ``cluster.address`` if given, else a LocalCluster."""
    from distributed import Client, LocalCluster

    cluster_config = workflow.cluster
    address = scheduler or (cluster_config.address if cluster_config.kind == "address" else None)
    if address:
        return Client(address, timeout="30s"), None
    if cluster_config.kind in ("slurm", "kubernetes"):
        from offaug.pipeline.clusters import build_cluster

        cluster = build_cluster(cluster_config)
        return Client(cluster), cluster
    workers = cluster_config.workers or os.cpu_count() or 1
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=cluster_config.threads_per_worker,
        processes=True,
        memory_limit=cluster_config.memory_limit,
        dashboard_address=":0",
    )
    return Client(cluster), cluster


def run_workflow(
    workflow: Workflow,
    run_dir: str | Path,
    *,
    scheduler: str | None = None,
    force: Iterable[str] = (),
    on_event: Callable[[str, str, dict[str, Any]], None] | None = None,
    client: Any = None,
) -> RunResult:
    """Run ``workflow`` into ``run_dir`` (see the module docstring).

    Args:
        workflow: A validated workflow.
        run_dir: The run directory (created).
        scheduler: A Dask scheduler address; default the workflow's cluster settings.
        force: Stage names (or prefixes such as ``train``) to rerun even if cached.
        on_event: Called with (stage, event, details); events: planned
            (will run), skipped (up to date), submitted (running or queued), finished.
        client: An existing Dask client (tests); otherwise one is made and closed here.

    Raises:
        StageFailed: naming the stage that failed.
    """
    started = time.perf_counter()
    layout = RunLayout(
        Path(run_dir).absolute(), Path(workflow.shards).absolute() if workflow.shards else None
    )
    layout.root.mkdir(parents=True, exist_ok=True)
    layout.logs.mkdir(exist_ok=True)
    layout.workflow.write_text(yaml.safe_dump(workflow.model_dump(mode="json"), sort_keys=False))
    records = StageRecords(layout)
    forced = tuple(force)
    event = on_event or (lambda *_: None)
    own_client = client is None
    cluster = None
    if own_client:
        client, cluster = connect(workflow, scheduler)
    threads = workflow.cluster.threads_per_worker
    client.register_plugin(WorkerSetup(threads))
    dashboard = getattr(client, "dashboard_link", None)
    graph = _Graph(client, records, forced, event, threads)
    try:
        _check_resources(client, workflow)
        names = _build(graph, workflow, layout, threads)
        graph.run()
        results = {name: graph.result(name) for name in names}
    finally:
        if own_client:
            client.close()
            if cluster is not None:
                cluster.close()
    wall = time.perf_counter() - started
    return RunResult(
        layout.root, results, graph.skipped, graph.executed, wall, graph.seconds, dashboard
    )


def _check_resources(client: Any, workflow: Workflow) -> None:
    wanted = dict(workflow.train.resources)
    if not wanted:
        return
    workers = client.scheduler_info().get("workers", {})
    for info in workers.values():
        have = info.get("resources", {})
        if all(have.get(k, 0) >= v for k, v in wanted.items()):
            return
    spec = " ".join(f"{k}={v:g}" for k, v in wanted.items())
    raise StageFailed(
        "train",
        RuntimeError(
            f"train.resources asks for {wanted} but no worker offers it; start workers with "
            f'`dask worker ADDRESS --resources "{spec}"`'
        ),
    )


@dataclasses.dataclass
class _Planned:
    """A stage that will run: what to call, with which arguments, once its inputs are done."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    resources: dict[str, float] | None
    retries: int


class _Graph:
    """Runs stages on a Dask client, short-circuiting the ones whose records are still valid.

    Dispatch is client-side: a stage is submitted when its inputs have finished and a worker
    thread is free, in the order the stages were added (long baseline trainings first). Handing
    Dask the whole graph up front stranded work: a stage whose inputs finished while every
    worker was busy was assigned at once to one busy worker, and Dask's work stealing, which
    knows nothing of an hour-long task it has never timed, did not move it when the other
    worker went idle; on the quickstart one worker sat idle for 40 s of a 93 s run. A stage
    that asks for a resource (``GPU: 1``) is submitted as soon as it is ready: the scheduler
    holds it until a worker with that resource is free.
    """

    def __init__(
        self,
        client: Any,
        records: StageRecords,
        forced: tuple[str, ...],
        event: Callable[[str, str, dict[str, Any]], None],
        threads: int,
    ) -> None:
        self.client = client
        self.threads = threads
        self.records = records
        self.forced = forced
        self.event = event
        self.keys: dict[str, str] = {}
        self.values: dict[str, Any] = {}
        self.planned: dict[str, _Planned] = {}
        self.running: dict[Any, str] = {}
        self.inputs: dict[str, list[str]] = {}
        self.skipped: list[str] = []
        self.executed: list[str] = []
        self.seconds: dict[str, float] = {}

    def stage(
        self,
        name: str,
        function: Callable[..., Any],
        config: Any,
        inputs: Sequence[str],
        *args: Any,
        resources: dict[str, float] | None = None,
        retries: int = 2,
    ) -> None:
        """Add a stage: ``function(*args)`` where args may name other stages via :class:`Ref`.

        The stage is skipped (its recorded result reused) when its key is unchanged, its
        outputs verify, it is not forced and none of its inputs reruns.
        """
        key = _hash(name, _to_json(config), [self.keys[i] for i in inputs])
        self.keys[name] = key
        self.inputs[name] = list(inputs)
        rerun_upstream = any(i in self.planned for i in inputs)
        forced = any(
            name == f or name.startswith(f"{f}:") or name.split(":")[0] == f for f in self.forced
        )
        if not forced and not rerun_upstream:
            cached = self.records.cached(name, key)
            if cached is not None:
                self.values[name] = cached
                self.skipped.append(name)
                self.event(name, "skipped", {"key": key})
                return
        self.planned[name] = _Planned(function, args, resources, retries)
        self.event(name, "planned", {"key": key})

    def _value(self, arg: Any) -> Any:
        if isinstance(arg, Ref):
            return self.values[arg.name]
        if isinstance(arg, RefList):
            return [self.values[n] for n in arg.names]
        return arg

    def _submit(self, name: str) -> None:
        stage = self.planned[name]
        future = self.client.submit(
            run_stage,
            stage.function,
            self.threads,
            *[self._value(a) for a in stage.args],
            key=f"{name}-{self.keys[name]}",
            retries=stage.retries,
            resources=stage.resources or None,
            pure=False,
        )
        self.running[future] = name
        self.event(name, "submitted", {"key": self.keys[name]})

    def _free_threads(self) -> int:
        """Worker threads with nothing to run, as the scheduler sees them now.

        Asked each time: workers die, restart and join while a run goes on, and on a shared
        cluster other clients' tasks (or this run's GPU stages) hold threads too. A stage of
        this run that the scheduler has not placed yet counts as holding one.
        """
        threads: dict[str, int] = self.client.nthreads()
        processing: dict[str, Any] = self.client.processing()
        free = sum(max(0, n - len(processing.get(w, ()))) for w, n in threads.items())
        placed = {str(key) for keys in processing.values() for key in keys}
        unplaced = sum(
            1
            for future, name in self.running.items()
            if not self.planned[name].resources and str(future.key) not in placed
        )
        free -= unplaced
        if not any(not self.planned[n].resources for n in self.running.values()):
            # Nothing of ours holds a thread: submit one stage even with no worker free (or
            # none connected); the scheduler holds it until a thread is.
            free = max(free, 1)
        return free

    def _dispatch(self, waiting: list[str]) -> None:
        """Submit the waiting stages whose inputs are done, while worker threads are free."""
        free: int | None = None
        for name in list(waiting):
            if not all(i in self.values for i in self.inputs[name]):
                continue
            if self.planned[name].resources:
                self._submit(name)
            else:
                if free is None:
                    free = self._free_threads()
                if free <= 0:
                    continue
                self._submit(name)
                free -= 1
            waiting.remove(name)

    def result(self, name: str) -> Any:
        """The result of a finished or skipped stage."""
        return self.values[name]

    def _finish(self, future: Any) -> None:
        name = self.running.pop(future)
        try:
            value, seconds, worker = future.result()
        except Exception as exc:
            raise StageFailed(name, exc) from exc
        self.values[name] = value
        self.seconds[name] = seconds
        self.executed.append(name)
        self.records.record(name, self.keys[name], value, seconds, worker, self.inputs[name])
        self.event(name, "finished", {"seconds": seconds, "worker": worker})

    def run(self) -> None:
        """Run every planned stage; raise :class:`StageFailed` on the first that fails."""
        from distributed import wait

        waiting = list(self.planned)
        while waiting or self.running:
            self._dispatch(waiting)
            if not self.running:
                stuck = ", ".join(waiting)
                raise RuntimeError(f"stages {stuck} wait for inputs that never run (a bug)")
            done = wait(list(self.running), return_when="FIRST_COMPLETED").done
            for future in done:
                self._finish(future)


@dataclasses.dataclass(frozen=True)
class Ref:
    """An argument that is another stage's result."""

    name: str


@dataclasses.dataclass(frozen=True)
class RefList:
    """An argument that is the list of several stages' results."""

    names: tuple[str, ...]


def _build(graph: _Graph, workflow: Workflow, layout: RunLayout, threads: int) -> list[str]:
    """Add every stage of the workflow to the graph; return the stage names in order."""
    seed = workflow.seed
    graph.stage("source", stages.prepare_source, workflow.source, [], workflow.source)
    train = workflow.train
    model_names: list[str] = []

    def add_training(algorithm: str, label: str) -> None:
        name = f"train:{algorithm}-{label}"
        augmented = Ref("rollout") if label == "augmented" else None
        inputs = ["source"] + (["rollout"] if augmented is not None else [])
        config = {"train": train, "evaluation": workflow.evaluation, "algorithm": algorithm}
        out = str(layout.model(f"{algorithm}-{label}"))
        resources = dict(train.resources) or None
        graph.stage(
            name,
            stages.train_offline,
            config,
            inputs,
            algorithm,
            Ref("source"),
            augmented,
            train,
            workflow.evaluation,
            out,
            seed,
            threads,
            resources=resources,
        )
        model_names.append(name)

    # Baselines on the original data need neither BC nor rollouts: they start at once.
    if train.baseline:
        for algorithm in train.algorithms:
            add_training(algorithm, "original")
    graph.stage(
        "bc",
        stages.train_bc,
        workflow.bc,
        ["source"],
        Ref("source"),
        workflow.bc,
        str(layout.model("bc")),
        seed,
    )
    rollout = workflow.rollout
    augmented_dir = str(layout.augmented)
    task_names = [f"rollout:{i}" for i in range(rollout.tasks)]
    if rollout.backend == "model":
        graph.stage(
            "dynamics",
            stages.train_dynamics_stage,
            rollout.dynamics,
            ["source"],
            Ref("source"),
            rollout,
            str(layout.models / "dynamics.pt"),
            seed,
        )
    for index, name in enumerate(task_names):
        if rollout.backend == "simulator":
            graph.stage(
                name,
                stages.rollout_shard,
                {"rollout": rollout, "index": index},
                ["source", "bc"],
                Ref("source"),
                Ref("bc"),
                rollout,
                augmented_dir,
                seed,
                index,
            )
        else:
            shard = str(Path(augmented_dir) / f"shard-{index:05d}.arrow")
            graph.stage(
                name,
                stages.model_rollout_task,
                {"rollout": rollout, "index": index},
                ["source", "bc", "dynamics"],
                Ref("source"),
                Ref("bc"),
                Ref("dynamics"),
                rollout,
                shard,
                index,
                seed,
            )
    graph.stage(
        "rollout",
        stages.merge_rollouts,
        {"rollout": rollout},
        task_names,
        RefList(tuple(task_names)),
        augmented_dir,
        rollout,
    )
    for algorithm in train.algorithms:
        add_training(algorithm, "augmented")
    names = ["source", "bc", *task_names, "rollout", *model_names]
    if workflow.diagnostics.enabled:
        # Each trained policy's checks start as soon as it is trained; the merge is short.
        parts = [f"diagnose:{name.removeprefix('train:')}" for name in model_names]
        for index, (part, model) in enumerate(zip(parts, model_names, strict=True)):
            graph.stage(
                part,
                stages.diagnose_policy_stage,
                {"diagnostics": workflow.diagnostics, "index": index},
                ["source", "bc", model],
                Ref("source"),
                Ref("bc"),
                Ref(model),
                workflow.diagnostics,
                seed,
                index,
            )
        diag_out = str(layout.root / "diagnostics.json")
        inputs = ["source", "rollout", "bc", *model_names, *parts]
        graph.stage(
            "diagnose",
            stages.diagnose_stage,
            workflow.diagnostics,
            inputs,
            Ref("source"),
            Ref("rollout"),
            Ref("bc"),
            RefList(tuple(model_names)),
            workflow.diagnostics,
            diag_out,
            seed,
            RefList(tuple(parts)),
        )
        names.extend([*parts, "diagnose"])
    if workflow.publish is not None:
        provenance = {"workflow": workflow.name, "workflow_hash": workflow.digest()}
        graph.stage(
            "publish",
            stages.publish_stage,
            workflow.publish,
            ["source", "rollout"],
            Ref("source"),
            Ref("rollout"),
            workflow.publish,
            provenance,
        )
        names.append("publish")
    # metrics.json and report.html: a stage like the others (a worker renders the plots while
    # the client only waits), rerun when any result or the workflow changes.
    graph.stage(
        "report",
        stages.report_stage,
        workflow.digest(),
        names,
        workflow,
        tuple(names),
        RefList(tuple(names)),
        str(layout.metrics),
        str(layout.report),
    )
    names.append("report")
    return names
