"""The practitioner's commands: ``doctor`` (dataset pitfalls) and ``render`` (videos).

As in :mod:`offaug.cli`, the library is imported inside each command so that ``--help`` does not
wait for torch, Dask or the data stack.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

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
    from offaug.pipeline.doctor import doctor_source

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
    from offaug.pipeline.render import (
        RenderUnavailable,
        VideoOptions,
        default_video_path,
        render_checkpoint,
    )
    from offaug.pipeline.video import video_format, write_video

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
