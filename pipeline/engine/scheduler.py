"""The client-side scheduler: submit each stage to Dask once its inputs have finished.

:class:`StageScheduler` takes a plan's stages one by one, each with its key
(:meth:`StageScheduler.add`; both from :class:`~offaug.pipeline.engine.stage_plan.Plan`), skips
those whose records are still valid, and runs the rest (:meth:`StageScheduler.run`), submitting a
stage with ``client.submit`` as soon as the stages it depends on have finished and a worker
thread is free. Each finished stage is recorded in ``stages.json`` at once, so a killed run
resumes from what had finished.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from distributed import Client, Future, wait

from offaug.pipeline.engine.stage_plan import Ref, RefList, StageSpec
from offaug.pipeline.engine.workers import run_stage
from offaug.pipeline.rundir.files import StageRecords

EventCallback = Callable[[str, str, dict[str, Any]], None]
"""Called with (stage, event, details); events: planned (will run), skipped (up to date),
submitted (running or queued), finished."""


class StageFailed(RuntimeError):
    """A stage raised; the message names it."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed: {type(cause).__name__}: {cause}")
        self.stage = stage


@dataclasses.dataclass
class _Planned:
    """A stage that will run: what to call, with which arguments, once its inputs are done."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    resources: dict[str, float] | None
    retries: int


class StageScheduler:
    """Runs stages on a Dask client, short-circuiting the ones whose records are still valid.

    Dispatch is client-side: a stage is submitted when its inputs have finished and a worker
    thread is free, in the order the stages were added (long baseline trainings first). Handing
    Dask the whole graph up front stranded work: a stage whose inputs finished while every
    worker was busy was assigned at once to one busy worker, and Dask's work stealing, which
    knows nothing of an hour-long task it has never timed, did not move it when the other
    worker went idle. A stage that asks for a resource (``GPU: 1``) is submitted as soon as it
    is ready: the scheduler holds it until a worker with that resource is free.
    """

    def __init__(
        self,
        client: Client,
        records: StageRecords,
        forced: tuple[str, ...],
        event: EventCallback,
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
        self.running: dict[Future[Any], str] = {}
        self.inputs: dict[str, list[str]] = {}
        self.skipped: list[str] = []
        self.executed: list[str] = []
        self.seconds: dict[str, float] = {}

    def add(self, spec: StageSpec, key: str, retries: int = 2) -> None:
        """Add a planned stage under its plan's ``key``.

        The stage is skipped (its recorded result reused) when its recorded key equals ``key``,
        its outputs verify, it is not forced (under its name or one of its aliases) and none of
        its inputs reruns.
        """
        name, inputs = spec.name, spec.inputs
        self.keys[name] = key
        self.inputs[name] = list(inputs)
        rerun_upstream = any(i in self.planned for i in inputs)
        forced = any(self._forced(n) for n in (name, *spec.aliases))
        if not forced and not rerun_upstream:
            cached = self.records.cached(name, key)
            if cached is not None:
                self.values[name] = cached
                self.skipped.append(name)
                self.event(name, "skipped", {"key": key})
                return
        self.planned[name] = _Planned(spec.function, spec.args, spec.resources, retries)
        self.event(name, "planned", {"key": key})

    def _forced(self, name: str) -> bool:
        # A name or its family: "rollout" forces rollout:0, rollout[RECIPE]@s1, ...
        family = re.split(r"[:\[@]", name, maxsplit=1)[0]
        return any(name == f or name.startswith(f"{f}:") or family == f for f in self.forced)

    def result(self, name: str) -> Any:
        """The result of a finished or skipped stage."""
        return self.values[name]

    def run(self) -> None:
        """Run every planned stage; raise :class:`StageFailed` on the first that fails."""
        waiting = list(self.planned)
        while waiting or self.running:
            self._dispatch(waiting)
            if not self.running:
                stuck = ", ".join(waiting)
                raise RuntimeError(f"stages {stuck} wait for inputs that never run (a bug)")
            done = wait(list(self.running), return_when="FIRST_COMPLETED").done
            for future in done:
                self._finish(future)

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

    def _finish(self, future: Future[Any]) -> None:
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
