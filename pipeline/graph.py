"""Build the Dask graph of a workflow's stages and compute it, skipping what is already done.

The one module that imports Dask. Stages (:mod:`offaug.pipeline.stages`) are submitted with
``client.submit``; a stage's inputs are the futures (or recorded results) of the stages it
depends on, so Dask runs independent stages (rollout tasks, learners) in parallel.

**Skipping and resuming.** Every stage has a key: a hash of its name, its part of the workflow
and the keys of its inputs. A finished stage's record (key, result, seconds, worker) is written
to ``stages.json`` as soon as it finishes. On the next run a stage whose key is unchanged and
whose outputs still verify (files present, checksums equal) is not submitted at all; changing
one parameter changes the keys of that stage and of everything downstream, and nothing else.
``force`` reruns named stages (and so their dependents).

**Resilience.** Tasks are submitted with retries; a worker killed mid-task has its task
rescheduled by the scheduler. Stage outputs are written atomically under deterministic names,
so a rerun task replaces, never duplicates.

**Workers.** A worker plugin pins torch and BLAS to the worker's thread count (one per core by
default) so parallel tasks do not oversubscribe the machine.
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
from distributed.diagnostics.plugin import WorkerPlugin
from pydantic import BaseModel

from offaug.datasets.shards import ShardRef, file_checksum, write_json_atomic
from offaug.pipeline import stages
from offaug.pipeline.layout import AugmentedRef, DatasetRef, ModelRef, RunLayout
from offaug.pipeline.rollout import RolloutShard
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
    if isinstance(result, dict) and "path" in result and result.get("kind") == "file":
        return Path(result["path"]).is_file()
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


def _timed(function: Callable[..., Any], *args: Any) -> tuple[Any, float, str | None]:
    """Run a stage function, returning its result, seconds and the worker's address."""
    start = time.perf_counter()
    result = function(*args)
    worker: str | None = None
    try:
        from distributed import get_worker

        worker = get_worker().address
    except ValueError:
        worker = None
    return result, time.perf_counter() - start, worker


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


class WorkerSetup(WorkerPlugin):
    """A Dask worker plugin: pin torch and BLAS threads, flush denormals."""

    name = "offaug-worker-setup"

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, worker: Any) -> None:
        from threadpoolctl import threadpool_limits

        from offaug.algorithms.base import configure_torch

        configure_torch(self.threads)
        threadpool_limits(limits=self.threads)


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
        on_event: Called with (stage, event, details); events: submitted, skipped, finished.
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
    graph = _Graph(client, records, forced, event, workflow)
    try:
        _check_resources(client, workflow)
        names = _build(graph, workflow, layout, threads)
        graph.wait_all()
        results = {name: graph.result(name) for name in names}
        metrics = summarise(workflow, results)
        write_json_atomic(layout.metrics, metrics)
        _write_report(metrics, layout)
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


def summarise(workflow: Workflow, results: dict[str, Any]) -> dict[str, Any]:
    """metrics.json: scores per learner and data, weight statistics, diagnostics."""
    training: dict[str, Any] = {}
    for name, result in results.items():
        if name.startswith("train:") and isinstance(result, ModelRef):
            evaluation = result.metrics.get("eval") or {}
            training[name.removeprefix("train:")] = {
                "return": evaluation.get("return"),
                "normalised_score": evaluation.get("normalised_score"),
                "checkpoint": result.path,
            }
    augmented = results.get("rollout")
    source = results.get("source")
    metrics: dict[str, Any] = {
        "workflow": workflow.name,
        "workflow_hash": workflow.digest(),
        "source": {"dataset": source.source, "rows": source.rows, "episodes": source.episodes}
        if isinstance(source, DatasetRef)
        else None,
        "augmented": {
            "rows": augmented.rows,
            "episodes": augmented.episodes,
            "shards": augmented.shards,
            "faults": augmented.faults,
        }
        if isinstance(augmented, AugmentedRef)
        else None,
        "weights": augmented.weight_stats if isinstance(augmented, AugmentedRef) else None,
        "training": training,
    }
    if "diagnose" in results:
        metrics["diagnostics"] = results["diagnose"]
    if "publish" in results:
        metrics["publish"] = results["publish"]
    return metrics


def _write_report(metrics: dict[str, Any], layout: RunLayout) -> None:
    try:
        from offaug.pipeline.report import write_report
    except ImportError:
        return
    write_report(metrics, layout.report)


class _Graph:
    """Submits stages, short-circuiting the ones whose records are still valid."""

    def __init__(
        self,
        client: Any,
        records: StageRecords,
        forced: tuple[str, ...],
        event: Callable[[str, str, dict[str, Any]], None],
        workflow: Workflow,
    ) -> None:
        self.client = client
        self.records = records
        self.forced = forced
        self.event = event
        self.workflow = workflow
        self.keys: dict[str, str] = {}
        self.values: dict[str, Any] = {}
        self.futures: dict[str, Any] = {}
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
        priority: int | None = None,
    ) -> None:
        """Add a stage: ``function(*args)`` where args may name other stages via :class:`Ref`.

        ``priority``: higher runs first when workers are scarce. By default stages keep their
        submission order, which starts the long baseline trainings first: measured on the
        quickstart, putting the short critical path (BC, rollouts) first left one worker idle
        at the end and made the run 12% longer.
        """
        if priority is None:
            priority = 0
        key = _hash(name, _to_json(config), [self.keys[i] for i in inputs])
        self.keys[name] = key
        self.inputs[name] = list(inputs)
        rerun_upstream = any(i in self.futures for i in inputs)
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
        resolved = [self._resolve(a) for a in args]
        future = self.client.submit(
            _timed,
            function,
            *resolved,
            key=f"{name}-{key}",
            retries=retries,
            resources=resources or None,
            priority=priority,
            pure=False,
        )
        self.futures[name] = future
        self.event(name, "submitted", {"key": key})

    def _resolve(self, arg: Any) -> Any:
        if isinstance(arg, Ref):
            if arg.name in self.futures:
                return self.client.submit(
                    _first,
                    self.futures[arg.name],
                    key=f"result-{arg.name}-{self.keys[arg.name]}",
                    pure=False,
                )
            return self.values[arg.name]
        if isinstance(arg, RefList):
            return [self._resolve(Ref(n)) for n in arg.names]
        return arg

    def result(self, name: str) -> Any:
        """The result of a finished stage (waiting for it if needed)."""
        if name not in self.values:
            self.wait(name)
        return self.values[name]

    def wait(self, name: str) -> None:
        future = self.futures[name]
        try:
            value, seconds, worker = future.result()
        except Exception as exc:
            raise StageFailed(name, exc) from exc
        self.values[name] = value
        self.seconds[name] = seconds
        self.executed.append(name)
        self.records.record(name, self.keys[name], value, seconds, worker, self.inputs[name])
        self.event(name, "finished", {"seconds": seconds, "worker": worker})

    def wait_all(self) -> None:
        from distributed import as_completed

        pending = {f: n for n, f in self.futures.items() if n not in self.values}
        for future in as_completed(list(pending)):
            self.wait(pending[future])


def _first(value: tuple[Any, float, str | None]) -> Any:
    return value[0]


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
        diag_out = str(layout.root / "diagnostics.json")
        inputs = ["source", "rollout", "bc", *model_names]
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
        )
        names.append("diagnose")
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
    return names
