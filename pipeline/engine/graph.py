"""Wire a workflow's stages into a graph and run it on Dask, skipping what is already done.

:func:`run_workflow` is the whole pipeline: it locks the run directory
(:class:`~offaug.pipeline.rundir.lock.RunLock`), connects to a cluster
(:func:`~offaug.pipeline.engine.clusters.connect`), adds every stage of
:mod:`offaug.pipeline.stages.learning` to a
:class:`~offaug.pipeline.engine.scheduler.StageScheduler` with its inputs (:func:`_build`, the
wiring) and runs them. Independent stages (rollout tasks, learners, each learner's diagnostics) run
in parallel; stages pass small references (paths, checksums), never arrays.

**Skipping and resuming.** Every stage has a key (:mod:`offaug.pipeline.rundir.keys`): a hash of its
name, its part of the workflow and the keys of its inputs. A finished stage's record (key,
result, seconds, worker) is written to ``stages.json`` as soon as it finishes. On the next run
a stage whose key is unchanged and whose outputs still verify (files present, checksums equal)
is not submitted at all; changing one parameter changes the keys of that stage and of
everything downstream, and nothing else. ``force`` reruns named stages (and so their
dependents).

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

from offaug.pipeline.contracts import DATA_VIDEO_STAGE, DOCTOR_STAGE, VIDEO_STAGE_PREFIX
from offaug.pipeline.engine.clusters import connect, disconnect, prepare_workers
from offaug.pipeline.engine.plan import plan_workflow
from offaug.pipeline.engine.scheduler import (
    EventCallback,
    Ref,
    RefList,
    StageFailed,
    StageScheduler,
)
from offaug.pipeline.rundir.files import StageRecords, append_log, write_workflow
from offaug.pipeline.rundir.lock import LockHolder, RunDirectoryLocked, RunLock, describe_takeover
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.workflow import Workflow
from offaug.pipeline.stages import learning as stages
from offaug.pipeline.stages import media as media_stages
from offaug.pipeline.stages.doctor import doctor_stage

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
        names = _build(graph, workflow, layout, threads)
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


def _build(graph: StageScheduler, workflow: Workflow, layout: RunLayout, threads: int) -> list[str]:
    """Add every stage of the workflow to the graph (:func:`plan_workflow`, then the report);
    return the stage names in order."""
    plan = plan_workflow(workflow, layout, threads)
    for spec in plan.stages.values():
        graph.stage(
            spec.name,
            spec.function,
            spec.config,
            spec.inputs,
            *spec.args,
            resources=spec.resources,
            aliases=spec.aliases,
        )
    names = plan.names
    # Videos and the dataset doctor for the primary seed's runs and first augmented set.
    primary = str(plan.index["primary_seed"])
    models = [r["stage"] for r in plan.index["runs"] if str(r["seed"]) == primary]
    rollouts = [
        stages_by_seed[primary]
        for stages_by_seed in (r["rollout"] for r in plan.index["recipes"].values())
        if primary in stages_by_seed
    ]
    names.extend(
        _add_media(
            graph, workflow, list(dict.fromkeys(models)), rollouts[0] if rollouts else None, layout
        )
    )
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
        plan.index,
    )
    names.append("report")
    return names


def _add_media(
    graph: StageScheduler,
    workflow: Workflow,
    model_names: list[str],
    rollout: str | None,
    layout: RunLayout,
) -> list[str]:
    """The report's videos (one stage per trained policy, one for the data) and the dataset
    doctor, each on a worker as soon as its inputs are done; return their stage names."""
    report = workflow.report
    names = []
    if report.videos:
        videos = str(layout.root / "videos")
        for model in model_names:
            name = f"{VIDEO_STAGE_PREFIX}{model.removeprefix('train:')}"
            graph.stage(
                name,
                media_stages.render_policy_stage,
                {"report": report, "seed": workflow.seed},
                ["source", model],
                Ref("source"),
                Ref(model),
                report,
                videos,
                workflow.seed,
            )
            names.append(name)
        graph.stage(
            DATA_VIDEO_STAGE,
            media_stages.render_data_stage,
            {"report": report, "seed": workflow.seed},
            ["source", *([rollout] if rollout else [])],
            Ref("source"),
            Ref(rollout) if rollout else None,
            report,
            videos,
            workflow.seed,
        )
        names.append(DATA_VIDEO_STAGE)
    if report.doctor:
        gamma = workflow.diagnostics.gamma
        graph.stage(
            DOCTOR_STAGE,
            doctor_stage,
            {"gamma": gamma, "rollout": workflow.rollout},
            ["source", *([rollout] if rollout else [])],
            Ref("source"),
            Ref(rollout) if rollout else None,
            gamma,
            workflow,
        )
        names.append(DOCTOR_STAGE)
    return names
