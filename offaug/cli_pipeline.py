"""The workflow commands of ``offaug``: validate, run, diagnose and report.

:mod:`offaug.cli` registers them. Each imports the library where it runs, so that
``offaug --help`` does not wait for Dask, torch and the data stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from offaug.cli_common import console, err_console, fail, guard
from offaug.pipeline.contracts import PLAIN, is_plain
from offaug.pipeline.rundir.lock import RunDirectoryLocked, RunLock

RUN_DIRECTORY_IN_USE = 3
"""The exit status of ``offaug run`` on a run directory another live run holds."""


def load_workflow_or_exit(path: Path) -> Any:
    """A validated workflow, or every problem printed (file:line, field) and exit 2."""
    from offaug.pipeline.schema.validation import WorkflowError
    from offaug.pipeline.schema.workflow import load_workflow

    try:
        return load_workflow(path)
    except WorkflowError as exc:
        err_console.print(f"[bold red]invalid workflow[/]\n{exc}", highlight=False)
        raise typer.Exit(code=2) from exc


def validate(
    workflow: Annotated[Path, typer.Argument(help="A workflow YAML file.")],
) -> None:
    """Check a workflow file, learner configs included, without running it."""
    loaded = load_workflow_or_exit(workflow)
    console.print(f"{workflow}: valid ({loaded.name}, hash {loaded.digest()})")


def run(
    workflow: Annotated[Path, typer.Argument(help="A workflow YAML file (see workflows/).")],
    out: Annotated[Path | None, typer.Option(help="Run directory (default runs/NAME).")] = None,
    scheduler: Annotated[
        str | None, typer.Option(help="Use this Dask scheduler (tcp://HOST:PORT).")
    ] = None,
    force: Annotated[
        list[str] | None, typer.Option(help="Rerun this stage (and what depends on it).")
    ] = None,
) -> None:
    """Run a workflow as a Dask graph: source, BC, rollouts, training, diagnostics, publish.

    One run at a time per run directory: on a directory another live run holds, this stops
    at once (exit status 3) naming that run's host, pid and start time.
    """
    # The lock first, before Dask, torch and the data layer are imported: a second run on a
    # held directory stops within a second. Without --out the directory is named after the
    # workflow, so the workflow is read first.
    loaded, run_dir = None, out
    if run_dir is None:
        loaded = load_workflow_or_exit(workflow)
        run_dir = Path("runs") / loaded.name
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except RunDirectoryLocked as exc:
        fail(str(exc), RUN_DIRECTORY_IN_USE)
    try:
        result = _run_with_progress(
            loaded or load_workflow_or_exit(workflow), run_dir, lock, scheduler, force or []
        )
    finally:
        lock.release()
    if result.dashboard:
        console.print(f"Dask dashboard was at {result.dashboard}")
    print_summary(result.run_dir)
    compute = sum(result.stage_seconds.values())
    console.print(
        f"{len(result.executed)} stage(s) run, {len(result.skipped)} up to date; wall "
        f"{result.wall_seconds:.1f} s, stage compute {compute:.1f} s; results in {result.run_dir}"
    )
    from offaug.pipeline.rundir.files import read_metrics  # after the lock: see above

    print_verdict(read_metrics(result.run_dir))


def _run_with_progress(
    workflow: Any, run_dir: Path, lock: RunLock, scheduler: str | None, force: list[str]
) -> Any:
    """``run_workflow`` under a live table of the stages' states."""
    from offaug.pipeline.engine.graph import StageFailed, run_workflow

    states: dict[str, str] = {}

    def render() -> Table:
        table = Table(title=f"offaug run {workflow.name} -> {run_dir}", show_header=True)
        table.add_column("stage")
        table.add_column("state")
        for stage, state in states.items():
            table.add_row(stage, state)
        return table

    with Live(render(), console=console, refresh_per_second=4, transient=False) as live:

        def on_event(stage: str, event: str, details: dict[str, Any]) -> None:
            if event == "finished":
                worker = details.get("worker") or "local"
                states[stage] = f"[green]done[/] {details['seconds']:.1f} s on {worker}"
            elif event == "skipped":
                states[stage] = "[cyan]up to date (skipped)[/]"
            elif event == "planned":
                states[stage] = "[dim]waiting[/]"
            else:
                states[stage] = "[yellow]running[/]"
            live.update(render())

        try:
            return run_workflow(
                workflow, run_dir, scheduler=scheduler, force=force, on_event=on_event, lock=lock
            )
        except StageFailed as exc:
            fail(str(exc), 1)


def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with stages.json).")],
) -> None:
    """Distribution-shift diagnostics of a finished run; updates RUN_DIR/metrics.json."""
    from offaug.pipeline.diagnostics import diagnose_run
    from offaug.pipeline.rundir.files import read_metrics
    from offaug.pipeline.schema.validation import WorkflowError

    with console.status(f"diagnosing {run_dir}"):
        result = guard(lambda: diagnose_run(run_dir), WorkflowError)
    print_headline(read_metrics(run_dir), f"{run_dir}: diagnostics")
    seconds = sum(result.get("timings", {}).values())
    console.print(
        f"wrote {run_dir / 'diagnostics.json'} and the diagnostics of "
        f"{run_dir / 'metrics.json'} in {seconds:.1f} s"
    )


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with metrics.json).")],
) -> None:
    """Write RUN_DIR/report.html, a self-contained HTML report, and print its headline."""
    from offaug.pipeline.report import report_run
    from offaug.pipeline.rundir.files import read_metrics

    path = guard(lambda: report_run(run_dir))
    metrics = read_metrics(run_dir)
    print_headline(metrics, str(run_dir))
    console.print(f"report: {path}")
    print_verdict(metrics)


def print_summary(run_dir: Path) -> None:
    """Each learner's scores per recipe and the weights' health."""
    from offaug.pipeline.rundir.files import read_metrics

    metrics = read_metrics(run_dir)
    if not metrics:
        return
    console.print(_scores_table(metrics.get("training", {})))
    weights = metrics.get("weights") or {}
    if weights:
        console.print(
            f"importance weights: ESS/N {weights.get('ess_fraction', 0):.3f}, clipped "
            f"{weights.get('clipped_fraction', 0):.3f}, max {weights.get('max_weight', 0):.3g}"
        )
    if metrics.get("diagnostics"):
        print_headline(metrics, "distribution shift")


def _scores_table(training: dict[str, Any]) -> Table:
    """Learner by recipe (plain first), each cell every seed's score."""
    cells: dict[str, dict[str, list[str]]] = {}
    recipes: list[str] = [PLAIN]
    for name, entry in training.items():
        learner = entry.get("learner") or name.rsplit("-", 1)[0]
        recipe = entry.get("recipe") or name.rsplit("-", 1)[-1]
        if recipe not in recipes:
            recipes.append(recipe)
        if entry.get("return") is None:
            text = "-"
        else:
            score = entry.get("normalised_score")
            text = f"{score:.1f}" if score is not None else "n/a"
            text = f"{text} ({entry['return']:.1f})"
        cells.setdefault(learner, {}).setdefault(recipe, []).append(text)
    table = Table(title="scores (normalised; return in brackets; one per seed)")
    table.add_column("learner")
    for recipe in recipes:
        if recipe == PLAIN:
            table.add_column("original")
        else:
            table.add_column(recipe if is_plain(recipe) else f"original + {recipe}")
    for learner, row in cells.items():
        table.add_row(learner, *[", ".join(row.get(recipe, ["-"])) for recipe in recipes])
    return table


def print_verdict(metrics: dict[str, Any]) -> None:
    """The verdict's headline (does augmentation help, per learner, with its interval), then
    the study's answer: the best augmented arm against the best plain arm at equal steps."""
    line = metrics.get("verdict_headline")
    if line:
        console.print(f"[bold]verdict:[/] {line}", highlight=False)
    best = (metrics.get("comparison") or {}).get("sentence")
    if best:
        console.print(f"[bold]best vs best:[/] {best}", highlight=False)


def print_headline(metrics: dict[str, Any], title: str) -> None:
    """The report's headline rows (:func:`offaug.pipeline.report.headline`) as a table."""
    from offaug.pipeline.report import headline

    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for label, value in headline(metrics):
        table.add_row(label, value)
    console.print(table)
