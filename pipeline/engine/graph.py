"""Run a workflow's plan on Dask, skipping what is already done.

:func:`run_workflow` is the whole pipeline: it locks the run directory
(:class:`~offaug.pipeline.rundir.lock.RunLock`), connects to a cluster
(:func:`~offaug.pipeline.engine.clusters.connect`), hands every stage that
:func:`~offaug.pipeline.engine.plan.plan_workflow` planned (the report's media, the doctor and the
report included) to a :class:`~offaug.pipeline.engine.scheduler.StageScheduler` and runs them.
This module plans nothing itself. Independent stages (rollout tasks, learners, each learner's
diagnostics) run in parallel; stages pass small references (paths, checksums), never arrays.

**Skipping and resuming.** Every stage has one key, the plan's
(:mod:`offaug.pipeline.engine.stage_plan`): a hash of its function, its part of the workflow and
the keys of its inputs. A finished stage's record (key, result, seconds, worker) is written to
``stages.json`` as soon as it finishes. On the next run a stage whose key is unchanged and whose
outputs still verify (files present, checksums equal) is not submitted at all; changing one
parameter changes the keys of that stage and of everything downstream, and nothing else. ``force``
reruns named stages (and so their dependents).

**Resilience.** Tasks are submitted with retries; a worker killed mid-task has its task
rescheduled by the scheduler. Stage outputs are written atomically under deterministic names,
so a rerun task replaces, never duplicates. One run at a time holds a run directory: a second
stops at once naming the first, and a run killed outright leaves a lock the next run takes over.

**Workers.** A worker plugin (:mod:`offaug.pipeline.engine.workers`) pins torch and BLAS to the
worker's thread count (one per core by default) so parallel tasks do not oversubscribe the
machine, and imports torch in the background while the first stages run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distributed import Client

from offaug.pipeline.engine.clusters import connect, disconnect, prepare_workers
from offaug.pipeline.engine.plan import plan_workflow
from offaug.pipeline.engine.scheduler import EventCallback, StageFailed, StageScheduler
from offaug.pipeline.engine.stage_plan import Plan
from offaug.pipeline.rundir.files import StageRecords, append_log, write_workflow
from offaug.pipeline.rundir.lock import LockHolder, RunDirectoryLocked, RunLock, describe_takeover
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.workflow import Workflow

__all__ = ["RunDirectoryLocked", "RunResult", "StageFailed", "run_workflow"]

log = logging.getLogger(__name__)


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
    lock_taken_over: LockHolder | None = None
    """The holder recorded by a killed run whose lock this run took over."""


def run_workflow(
    workflow: Workflow,
    run_dir: str | Path,
    *,
    scheduler: str | None = None,
    force: Iterable[str] = (),
    on_event: EventCallback | None = None,
    client: Client | None = None,
    lock: RunLock | None = None,
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
        lock: The lock of ``run_dir``, already acquired by the caller, who releases it
            (``offaug run`` takes it before loading anything heavy); otherwise it is taken
            and released here.

    Raises:
        RunDirectoryLocked: another live run holds ``run_dir`` (nothing was started).
        StageFailed: naming the stage that failed.
    """
    started = time.perf_counter()
    layout = RunLayout(
        Path(run_dir).absolute(), Path(workflow.shards).absolute() if workflow.shards else None
    )
    with contextlib.ExitStack() as stack:
        if lock is None:
            lock = stack.enter_context(RunLock(layout.root))
        elif lock.path.absolute() != layout.lock:
            raise ValueError(f"the lock given is {lock.path}, not {layout.lock}")
        if lock.taken_over is not None:
            message = describe_takeover(lock.taken_over)
            log.warning("%s: %s", layout.root, message)
            append_log(layout, message)
        append_log(layout, f"run of {workflow.name} ({workflow.digest()}) started")
        result = _run_locked(workflow, layout, scheduler, tuple(force), on_event, client)
        append_log(layout, f"run finished: {len(result.executed)} stage(s) run")
    result.wall_seconds = time.perf_counter() - started
    result.lock_taken_over = lock.taken_over
    return result


def _run_locked(
    workflow: Workflow,
    layout: RunLayout,
    scheduler: str | None,
    forced: tuple[str, ...],
    on_event: EventCallback | None,
    client: Client | None,
) -> RunResult:
    layout.logs.mkdir(exist_ok=True)
    write_workflow(layout, workflow)
    records = StageRecords(layout)
    event = on_event or (lambda *_: None)
    cluster = None
    own_client = client is None
    threads = workflow.cluster.threads_per_worker
    if client is None:
        client, cluster = connect(workflow.cluster, scheduler)
    else:
        prepare_workers(client, threads)
    dashboard = getattr(client, "dashboard_link", None)
    graph = StageScheduler(client, records, forced, event, threads)
    try:
        _check_resources(client, workflow)
        names = _schedule(graph, plan_workflow(workflow, layout, threads))
        graph.run()
        results = {name: graph.result(name) for name in names}
    finally:
        if own_client:
            disconnect(client, cluster)
    return RunResult(
        layout.root, results, graph.skipped, graph.executed, 0.0, graph.seconds, dashboard
    )


def _check_resources(client: Client, workflow: Workflow) -> None:
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


def _schedule(graph: StageScheduler, plan: Plan) -> list[str]:
    """Add every planned stage to the graph under its plan's key; return the names in order."""
    for spec in plan.stages.values():
        graph.add(spec, plan.keys[spec.name])
    return plan.names
