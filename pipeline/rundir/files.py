"""Reading and writing a run directory: stage records, metrics and the workflow.

The paths are :class:`~offaug.pipeline.rundir.run_layout.RunLayout`'s; this module is the one place
that reads or writes what is in them, for the graph (records as stages finish, its log), the command
line (``verify``, ``publish`` and ``run`` of a run directory) and the diagnostics (``offaug
diagnose`` reruns them from the records).

**Stage records** (``stages.json``): ``{"stages": {NAME: StageRecord}}``, one record per
finished stage, written atomically as each stage finishes. A result is stored in the JSON form
of :mod:`offaug.pipeline.rundir.keys`, so it decodes back to its dataclass.

**The lock** (``run.lock``) is :mod:`offaug.pipeline.rundir.lock`'s: one run at a time per
directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import yaml

from offaug.datasets.atomic import write_json_atomic, write_text_atomic
from offaug.datasets.errors import DataError
from offaug.datasets.shards import ShardSet, file_checksum, manifest_path
from offaug.datasets.sources import cache_key, resolve_source
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef, RolloutShard
from offaug.pipeline.rollouts.env_state import STATE_KINDS
from offaug.pipeline.rundir.keys import from_json, to_json
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.workflow import Workflow, load_workflow

T = TypeVar("T")


class StageRecord(TypedDict):
    """One finished stage in ``stages.json``."""

    key: str
    """The stage key (:func:`offaug.pipeline.rundir.keys.stage_key`) it ran with."""
    inputs: list[str]
    """The stages whose results it took."""
    result: Any
    """Its result in the JSON form of :func:`offaug.pipeline.rundir.keys.to_json`."""
    seconds: float
    """How long the stage function ran on its worker."""
    worker: str | None
    """The Dask worker's address (``None`` when it ran outside a worker)."""
    finished: str
    """When it finished, ``%Y-%m-%dT%H:%M:%S%z``."""


def outputs_verify(result: Any) -> bool:
    """Whether a recorded result's files are still there and unchanged."""
    if isinstance(result, ModelRef):
        return Path(result.path).is_file() and file_checksum(result.path) == result.checksum
    if isinstance(result, RolloutShard):
        shard = result.shard
        return Path(shard.path).is_file() and file_checksum(shard.path) == shard.checksum
    if isinstance(result, AugmentedRef):
        manifest = manifest_path(result.directory)
        if not manifest.is_file() or file_checksum(manifest) != result.manifest_checksum:
            return False
        return not ShardSet.open(result.directory).verify()
    if isinstance(result, DatasetRef):
        try:
            resolved = resolve_source(result.source)
        except Exception:  # a source that vanished is simply stale
            return False
        # The identity holds the infos keys of the state kind the source records (if any).
        kinds = [list(k.keys) for k in STATE_KINDS] if result.has_simulator_state else [[]]
        return any(cache_key(resolved, {"info_keys": k}) == result.identity for k in kinds)
    if isinstance(result, list):  # a fused training's records, one per seed
        return all(outputs_verify(r) for r in result)
    if isinstance(result, dict) and result.get("kind") == "files":
        return all(Path(p).is_file() for p in result["paths"])
    return True


class StageRecords:
    """``stages.json``: what finished, with which key, result, duration and worker.

    A missing or unreadable file holds no records (every stage then runs);
    :func:`read_stage_records` is the strict reader for a finished run.
    """

    def __init__(self, layout: RunLayout) -> None:
        self.path = layout.stages
        self.records: dict[str, StageRecord] = {}
        if self.path.is_file():
            try:
                self.records = json.loads(self.path.read_text()).get("stages", {})
            except json.JSONDecodeError:
                self.records = {}

    def __contains__(self, name: object) -> bool:
        return name in self.records

    def names(self, prefix: str = "") -> list[str]:
        """The recorded stage names that start with ``prefix``, sorted."""
        return sorted(name for name in self.records if name.startswith(prefix))

    def cached(self, name: str, key: str) -> Any | None:
        """Stage ``name``'s result if it finished with ``key`` and its outputs still verify."""
        record = self.records.get(name)
        if record is None or record.get("key") != key:
            return None
        result = from_json(record["result"])
        return result if outputs_verify(result) else None

    def result(self, name: str, kind: type[T]) -> T:
        """The recorded result of stage ``name``, a ``kind``.

        Raises:
            DataError: no finished stage ``name`` (or its result is not a ``kind``).
        """
        record = self.records.get(name)
        if record is None:
            raise DataError(
                f"no finished {name!r} stage", path=self.path, hint="run the workflow first"
            )
        result = from_json(record["result"])
        if isinstance(result, dict) and dataclasses.is_dataclass(kind):
            # A record written without its type name: take the fields the type has.
            names = {f.name for f in dataclasses.fields(kind)}
            result = kind(**{k: v for k, v in result.items() if k in names})
        if not isinstance(result, kind):
            raise DataError(
                f"stage {name!r} recorded a {type(result).__name__}, not a {kind.__name__}",
                path=self.path,
            )
        return result

    def results(self, prefix: str, kind: type[T]) -> list[T]:
        """The results of every recorded stage whose name starts with ``prefix``, by name."""
        return [self.result(name, kind) for name in self.names(prefix)]

    def record(
        self,
        name: str,
        key: str,
        result: Any,
        seconds: float,
        worker: str | None,
        inputs: list[str],
    ) -> None:
        """Record a finished stage and rewrite ``stages.json`` atomically."""
        self.records[name] = {
            "key": key,
            "inputs": list(inputs),
            "result": to_json(result),
            "seconds": seconds,
            "worker": worker,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json_atomic(self.path, {"stages": self.records})


def is_run_directory(path: str | Path) -> bool:
    """Whether ``path`` is a run directory (it has stage records)."""
    return RunLayout(Path(path)).stages.is_file()


def read_stage_records(run_dir: str | Path) -> StageRecords:
    """The stage records of a run directory.

    Raises:
        FileNotFoundError: no ``stages.json`` (the workflow never ran there).
    """
    layout = RunLayout(Path(run_dir))
    if not layout.stages.is_file():
        raise FileNotFoundError(f"{layout.stages}: no stage records; run the workflow first")
    return StageRecords(layout)


@dataclasses.dataclass(frozen=True)
class RunRecords:
    """The results a finished run recorded: its source, BC, augmented set and trained models."""

    data: DatasetRef
    bc: ModelRef
    augmented: AugmentedRef | None
    models: list[ModelRef]


def read_run_records(run_dir: str | Path) -> RunRecords:
    """The ``source``, ``bc``, ``rollout`` and ``train:*`` results of a run directory.

    Raises:
        FileNotFoundError: no ``stages.json``.
        DataError: a stage that every run has (``source``, ``bc``) is not recorded.
    """
    records = read_stage_records(run_dir)
    return RunRecords(
        data=records.result("source", DatasetRef),
        bc=records.result("bc", ModelRef),
        augmented=records.result("rollout", AugmentedRef) if "rollout" in records else None,
        models=records.results("train:", ModelRef),
    )


def augmented_directory(run_dir: str | Path) -> Path:
    """The augmented shard set a run directory's ``rollout`` stage wrote.

    Raises:
        FileNotFoundError: no stage records.
        DataError: no finished ``rollout`` stage.
    """
    return Path(read_stage_records(run_dir).result("rollout", AugmentedRef).directory)


def read_workflow(run_dir: str | Path) -> Workflow | None:
    """The resolved workflow a run recorded (``workflow.yaml``), or ``None`` without one."""
    layout = RunLayout(Path(run_dir))
    return load_workflow(layout.workflow) if layout.workflow.is_file() else None


def write_workflow(layout: RunLayout, workflow: Workflow) -> None:
    """Record the resolved workflow (every default filled in) as ``workflow.yaml``."""
    text = yaml.safe_dump(workflow.model_dump(mode="json"), sort_keys=False)
    write_text_atomic(layout.workflow, text)


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    """``metrics.json`` of a run directory; empty when there is none yet."""
    path = RunLayout(Path(run_dir)).metrics
    if not path.is_file():
        return {}
    metrics: dict[str, Any] = json.loads(path.read_text())
    return metrics


def write_metrics(run_dir: str | Path, metrics: dict[str, Any]) -> Path:
    """Replace ``metrics.json`` of a run directory atomically; return its path."""
    path = RunLayout(Path(run_dir)).metrics
    write_json_atomic(path, metrics)
    return path


def append_log(layout: RunLayout, line: str) -> None:
    """Append a timestamped line to ``logs/run.log``."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    with (layout.logs / "run.log").open("a") as handle:
        handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {line}\n")
