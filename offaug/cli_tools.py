"""The practitioner's commands: ``doctor`` (dataset pitfalls), ``quality`` (augmented data
against its source and env), ``render`` (videos), ``rank`` (weighted policy ranking) and
``review`` (pick rollouts by eye, keep them as labelled data).

As in :mod:`offaug.cli`, the library is imported inside each command so that ``--help`` does not
wait for torch, Dask or the data stack.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from offaug.cli_common import console, err_console, guard
from offaug.cli_pipeline import load_workflow_or_exit

_SEVERITY_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


def doctor(
    source: Annotated[
        str, typer.Argument(help="Minari id or directory, D4RL .hdf5, or shard set.")
    ],
    workflow: Annotated[
        Path | None, typer.Option(help="Also check this workflow's rollout horizon.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    gamma: Annotated[
        float | None,
        typer.Option(help="The learner's discount (default the workflow's, else 0.99)."),
    ] = None,
    download: Annotated[bool, typer.Option(help="Download a missing Minari dataset.")] = False,
) -> None:
    """Check a dataset for offline-RL pitfalls; exit 0 (clean), 1 (warnings) or 2 (errors)."""
    from offaug.pipeline.stages.doctor import doctor_source

    if gamma is not None and not 0.0 < gamma < 1.0:
        raise typer.BadParameter(f"must lie in (0, 1), got {gamma}", param_hint="--gamma")
    loaded = load_workflow_or_exit(workflow) if workflow is not None else None
    report = guard(lambda: doctor_source(source, workflow=loaded, gamma=gamma, download=download))
    if as_json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
        raise typer.Exit(code=report.exit_code)
    facts = report.facts
    table = Table(
        title=f"{source}: {facts['episodes']} episodes, {facts['steps']} steps, "
        f"gamma {facts['gamma']:g} (T_eff {facts['t_eff']:.1f})"
    )
    table.add_column("severity", no_wrap=True)
    table.add_column("code", no_wrap=True)
    table.add_column("what it saw", overflow="fold")
    table.add_column("what to do", overflow="fold")
    for finding in report.findings:
        style = _SEVERITY_STYLE[finding.severity]
        table.add_row(
            f"[{style}]{finding.severity}[/]", finding.code, finding.message, finding.advice
        )
    console.print(table)
    raise typer.Exit(code=report.exit_code)


def quality(
    augmented: Annotated[
        str,
        typer.Argument(
            help="Augmented data: a shard set (rollouts, generated samples) or any dataset."
        ),
    ],
    source: Annotated[
        str, typer.Option(help="The data it was made from: Minari id or directory, D4RL .hdf5.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    out: Annotated[Path | None, typer.Option(help="Also write the report as JSON here.")] = None,
    env: Annotated[
        str | None, typer.Option(help="Gymnasium env id (default: the source's own).")
    ] = None,
    max_rows: Annotated[
        int, typer.Option(min=1, help="Augmented rows replayed in the env.")
    ] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the row samples.")] = 0,
) -> None:
    """Check augmented transitions against their source data and its environment."""
    from offaug.datasets import load_transitions
    from offaug.datasets.atomic import write_json_atomic
    from offaug.pipeline.diagnostics.quality import QualitySettings, quality_report
    from offaug.pipeline.rollouts.env_state import load_with_states

    def check() -> dict[str, Any]:
        # Recorded states (infos/qpos, infos/qvel or infos/state) where the data has them.
        rows, _ = load_with_states(augmented)
        data = load_transitions(source)
        settings = QualitySettings(max_rows=max_rows, seed=seed)
        return dict(quality_report(rows, data, env_id=env, settings=settings))

    report = guard(check)
    if out is not None:
        write_json_atomic(out, report)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return
    console.print(quality_table(augmented, report))


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def quality_table(name: str, report: dict[str, Any]) -> Table:
    """The report's headline figures as a rich table."""
    state = report["state"]
    table = Table(title=f"{name}: {report['rows']} rows against {report['source_rows']}")
    table.add_column("check", no_wrap=True)
    table.add_column("value", overflow="fold")
    kind = state["kind"] + (f" ({state['reason']})" if state["reason"] else "")
    rows = [
        ("state", kind),
        ("rows replayed (unset)", f"{state['rows_checked']} ({state['rows_unset']})"),
        ("state error, median (σ units)", _cell((report.get("state_error") or {}).get("median"))),
        ("state error, p95", _cell((report.get("state_error") or {}).get("p95"))),
        ("dynamics error, median (σ units)", _cell((report["dynamics_error"] or {}).get("median"))),
        ("dynamics error, p95", _cell((report["dynamics_error"] or {}).get("p95"))),
        ("reward error, mean", _cell((report["reward_error"] or {}).get("mean"))),
        ("terminal mismatch", _cell(report["terminal_mismatch"])),
        ("novelty, median", _cell((report["novelty"] or {}).get("median"))),
        ("OOD share", _cell((report["ood"] or {}).get("share"))),
    ]
    returns, terminal = report["returns"], report["terminal_rate"]
    for label, augmented, source in (
        ("terminal rate", terminal["augmented"], terminal["source"]),
        *(
            (label, returns["augmented"][field], returns["source"][field])
            for label, field in (
                ("episode return", "mean_return"),
                ("reward per step", "reward_per_step"),
            )
        ),
    ):
        rows.append((f"{label} (augmented / data)", f"{_cell(augmented)} / {_cell(source)}"))
    for label, value in rows:
        table.add_row(label, value)
    return table


def render(
    policy: Annotated[Path, typer.Argument(help="A checkpoint (.pt) or a training run directory.")],
    episodes: Annotated[int, typer.Option(min=1, help="Evaluation episodes to film.")] = 1,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Video file (.gif, .mp4 or .webm); several episodes add -0, -1, ... to its "
            "name. Default: videos/episode.gif in the run directory."
        ),
    ] = None,
    fps: Annotated[
        float | None, typer.Option(min=0.1, help="Playback rate (default: real time).")
    ] = None,
    size: Annotated[str, typer.Option(help="Frame size WIDTHxHEIGHT.")] = "160x120",
    frame_skip: Annotated[int, typer.Option(min=1, help="Film every k-th step.")] = 4,
    max_frames: Annotated[int, typer.Option(min=1, help="At most this many frames.")] = 120,
    seed: Annotated[int, typer.Option(help="Reset seed of the first episode.")] = 0,
    env: Annotated[
        str | None, typer.Option(help="Gymnasium env id (default: the run's own).")
    ] = None,
) -> None:
    """Film a policy's evaluation episodes offscreen into GIF/MP4/WebM files."""
    from offaug.algorithms.base import CheckpointError
    from offaug.pipeline.media.render import (
        RenderUnavailable,
        VideoOptions,
        default_video_path,
        render_checkpoint,
    )
    from offaug.pipeline.media.video import video_format, write_video

    width, _, height = size.lower().partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise typer.BadParameter(f"expected WIDTHxHEIGHT, got {size!r}", param_hint="--size")
    options = VideoOptions(int(width), int(height), frame_skip, max_frames)
    out = out or default_video_path(policy)
    try:
        video_format(out)
        filmed = guard(
            lambda: render_checkpoint(
                policy, episodes=episodes, seed=seed, options=options, env_id=env
            )
        )
    except (RenderUnavailable, CheckpointError, ValueError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from exc
    table = Table(title=f"{policy}: {episodes} episode(s)")
    table.add_column("file", overflow="fold")
    for column in ("return", "steps", "frames", "KiB", "render s"):
        table.add_column(column, justify="right")
    for index, episode in enumerate(filmed):
        path = out if episodes == 1 else out.with_name(f"{out.stem}-{index}{out.suffix}")
        write_video(episode.frames, path, fps or episode.fps)
        table.add_row(
            str(path),
            f"{episode.episode_return:.1f}",
            str(episode.length),
            str(len(episode.frames)),
            f"{path.stat().st_size / 1024:.0f}",
            f"{episode.render_seconds:.1f}",
        )
    console.print(table)


def rank(
    checkpoints: Annotated[
        list[Path], typer.Argument(help="Checkpoints or training run directories to rank.")
    ],
    starts: Annotated[int, typer.Option(min=1, help="Start states (reset seeds SEED + i).")] = 10,
    metric: Annotated[
        str,
        typer.Option(
            help=(
                "Weighted metrics NAME:WEIGHT,...; NAME is return, success or length (longer is "
                "better), -NAME for lower is better, e.g. return:0.6,success:0.3,length:0.1."
            )
        ),
    ] = "return:1.0",
    env: Annotated[
        str | None, typer.Option(help="Env id (default: the first checkpoint's training env).")
    ] = None,
    seed: Annotated[int, typer.Option(help="First reset seed; also seeds the bootstrap.")] = 0,
    scheduler: Annotated[
        str | None, typer.Option(help="Dask scheduler address (default: a LocalCluster).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="LocalCluster workers (default: one per policy).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the ranking as JSON.")] = False,
) -> None:
    """Rank policies by greedy episodes from the same start states, on a weighted score."""
    import os

    from offaug.pipeline.diagnostics import rank_checkpoints
    from offaug.pipeline.engine.clusters import connected
    from offaug.pipeline.media.render import resolve_policy
    from offaug.pipeline.schema.rank_metric import RankMetricError, parse_rank_metric
    from offaug.pipeline.schema.run_sections import ClusterModel

    try:
        weights = parse_rank_metric(metric)
    except RankMetricError as exc:
        err_console.print(f"[bold red]error:[/] --metric: {exc}", highlight=False)
        raise typer.Exit(code=2) from exc
    targets = [guard(lambda p=p: resolve_policy(p, env_id=env)) for p in checkpoints]  # type: ignore[misc]
    first = targets[0]
    envs = {t.env_id or str(t.meta.get("eval_env_spec") or t.meta.get("env_spec")) for t in targets}
    if len(envs) > 1:
        err_console.print(
            "[bold red]error:[/] the policies were trained in different environments; pass "
            "--env ID to roll them all out in one"
        )
        raise typer.Exit(code=2)
    paths = [str(t.checkpoint) for t in targets]
    local = ClusterModel(workers=workers or min(len(paths), os.cpu_count() or 1))
    with (
        connected(local, scheduler) as client,
        console.status(f"rolling {len(paths)} policies from {starts} start states"),
    ):
        ranking = rank_checkpoints(
            paths,
            first.meta,
            starts,
            [seed],
            client,
            metric=weights,
            env_id=first.env_id,
            bootstrap_seed=seed,
        )
    if json_output:
        from offaug.pipeline.diagnostics import jsonable

        print(json.dumps(jsonable(ranking), indent=2))
        return
    table = Table(title=f"ranked by {weights} over {starts} start state(s)")
    for column in ("rank", "policy", "score [95% CI]", "return", "success", "length"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for entry in ranking:
        scored = entry["weighted"]
        assert scored is not None  # ranked by a metric
        table.add_row(
            str(entry["rank"]),
            str(entry["name"]),
            f"{scored['score']:.3f} [{scored['low']:.3f}, {scored['high']:.3f}]",
            f"{entry['mean_return']:.2f}",
            f"{entry['success_rate']:.2f}",
            f"{entry['mean_length']:.1f}",
        )
    console.print(table)


def review(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with stages.json).")],
    starts: Annotated[int, typer.Option(min=1, help="Start states, one row each.")] = 3,
    top: Annotated[int, typer.Option(min=1, help="Candidates per start state, by return.")] = 3,
    out: Annotated[
        Path | None, typer.Option(help="Review directory (default RUN_DIR/review).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Start states are reset seeds SEED + 30000 + i.")] = 0,
    animations: Annotated[
        bool, typer.Option(help="Film candidates where the env renders offscreen.")
    ] = True,
    apply: Annotated[
        Path | None,
        typer.Option(help="A choices.json saved by the page: write REVIEW_DIR/labelled."),
    ] = None,
) -> None:
    """Write a page of each start state's best rollouts to pick from, or apply the picks."""
    from offaug.pipeline.outcome.review import ReviewOptions, apply_choices, review_dir, review_run

    directory = review_dir(run_dir, out)
    if apply is not None:
        labelled = guard(lambda: apply_choices(apply, directory))
        rows = labelled.load()
        chosen = int(rows.extras["label"].sum())
        console.print(
            f"wrote {labelled.episodes} episodes ({labelled.rows} rows, {chosen} chosen) to "
            f"{labelled.directory}; train on it as another source, e.g. "
            f"offaug train bc SOURCE {labelled.directory} --mixing 0.8,0.2"
        )
        return
    options = ReviewOptions(starts=starts, top=top, seed=seed, animations=animations)
    with console.status(f"rolling the policies of {run_dir} from {starts} start states"):
        result = guard(lambda: review_run(run_dir, options, out=out))
    if result.media_note:
        console.print(result.media_note, highlight=False)
    console.print(
        f"{len(result.candidates)} candidates: open {result.page}, pick one per start state, "
        f"save choices.json, then: offaug review {run_dir} --apply choices.json"
    )
