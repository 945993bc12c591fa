"""The data commands of ``offaug``: make-dataset, inspect, shard, verify, publish, cache.

:mod:`offaug.cli` registers them. Each imports the library where it runs (see
:mod:`offaug.cli`).
"""

from __future__ import annotations

import json
import shutil
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from offaug.algorithms.names import GeneratingPolicy, Level
from offaug.cli_common import StorageFormat, console, err_console, fail, guard, read_mapping


def make_dataset(
    env_id: Annotated[str, typer.Argument(help="Gymnasium env id, e.g. Hopper-v5.")],
    dataset_id: Annotated[
        str, typer.Option("--dataset-id", help="Minari id to write: [namespace/]name-vK.")
    ],
    policy: Annotated[
        GeneratingPolicy, typer.Option(help="'random', or 'sac' (trained online; see --level).")
    ] = "random",
    level: Annotated[Level, typer.Option(help="With --policy sac: the D4RL level.")] = "medium",
    train_steps: Annotated[
        int, typer.Option(help="With --policy sac: SAC environment steps (the expert).")
    ] = 100_000,
    steps: Annotated[int | None, typer.Option(help="Collect at least this many steps.")] = None,
    episodes: Annotated[int | None, typer.Option(help="Or exactly this many episodes.")] = None,
    data_format: Annotated[
        StorageFormat, typer.Option("--format", help="Minari storage format.")
    ] = StorageFormat.hdf5,
    seed: Annotated[int, typer.Option(help="Seed of resets and actions.")] = 0,
    max_episode_steps: Annotated[
        int | None, typer.Option(help="Override the env's time limit.")
    ] = None,
    root: Annotated[
        Path | None, typer.Option(help="Datasets root (default MINARI_DATASETS_PATH).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset.")] = False,
) -> None:
    """Generate a real Minari dataset by running a policy in a Gymnasium environment."""
    from offaug.algorithms.online.making import make_source_dataset
    from offaug.datasets.generate import GeneratedDataset

    if policy == "sac" and episodes is not None:
        fail("--policy sac collects --steps, not --episodes")
    if policy == "random" and (steps is None) == (episodes is None):
        fail("give exactly one of --steps and --episodes")
    doing = (
        f"training SAC on {env_id} for the {level} level"
        if policy == "sac"
        else (f"collecting {env_id} with the {policy} policy")
    )
    with console.status(doing):
        made = guard(
            lambda: make_source_dataset(
                env_id,
                dataset_id,
                policy=policy,
                level=level,
                train_steps=train_steps,
                steps=steps,
                episodes=episodes,
                data_format=data_format.value,
                seed=seed,
                max_episode_steps=max_episode_steps,
                root=root,
                overwrite=overwrite,
            )
        )
    if isinstance(made, GeneratedDataset):
        console.print(
            f"wrote [bold]{made.dataset_id}[/]: {made.episodes} episodes, {made.steps} steps, "
            f"{made.data_format} storage, at {made.path}"
        )
        return
    console.print(
        f"wrote [bold]{made.dataset.dataset_id}[/] ({level}): {made.dataset.episodes} "
        f"episodes, {made.dataset.steps} steps at {made.dataset.path}; policy return "
        f"{made.policy_return}, random {made.random_return:.1f}, expert {made.expert_return}"
    )


def _format_stats(stats: dict[str, float]) -> str:
    return f"{stats['mean']:.3g} ± {stats['std']:.3g} [{stats['min']:.3g}, {stats['max']:.3g}]"


def inspect(
    source: Annotated[
        str, typer.Argument(help="Minari id or directory, D4RL .hdf5, or shard set.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    download: Annotated[bool, typer.Option(help="Download a missing Minari dataset.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Bypass the shard cache.")] = False,
) -> None:
    """Episodes, steps, spaces, returns, terminal/timeout and NaN counts of a dataset."""
    from offaug.datasets.inspect import summarize
    from offaug.datasets.sources import load_transitions

    transitions = guard(
        lambda: load_transitions(source, download=download, cache=not no_cache, check_finite=False)
    )
    summary = summarize(transitions)
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        return
    table = Table(title=f"{source}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows: list[tuple[str, Any]] = [
        ("format", summary["format"]),
        ("episodes", summary["episodes"]),
        ("steps", summary["steps"]),
        ("observation", f"{summary['observation_shape']} {summary['observation_dtype']}"),
        ("action", f"{summary['action_shape']} {summary['action_dtype']}"),
        ("observation space", summary["observation_space"]),
        ("action space", summary["action_space"]),
        ("episode length", _format_stats(summary["episode_length"])),
        ("episode return", _format_stats(summary["episode_return"])),
        ("terminals / timeouts", f"{summary['terminals']} / {summary['timeouts']}"),
        ("NaN/inf", ", ".join(f"{k}={v}" for k, v in summary["nan_or_inf"].items())),
        ("reference scores", f"{summary['ref_min_score']} .. {summary['ref_max_score']}"),
    ]
    if summary["observation_keys"]:
        rows.insert(6, ("observation keys", ", ".join(summary["observation_keys"])))
    for name, value in rows:
        table.add_row(name, "" if value is None else str(value))
    console.print(table)


def shard(
    source: Annotated[str, typer.Argument(help="Minari id or directory, or D4RL .hdf5 file.")],
    out: Annotated[Path, typer.Option(help="Shard-set directory to write.")],
    rows_per_shard: Annotated[
        int | None, typer.Option(help="Aim for shards of this many rows (cut at episodes).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing shard set.")] = False,
    download: Annotated[bool, typer.Option(help="Download a missing Minari dataset.")] = False,
) -> None:
    """Convert a dataset to an offaug shard set (Arrow IPC + manifest with checksums)."""
    from offaug.datasets.shards import write_shard_set
    from offaug.datasets.sources import load_transitions

    transitions = guard(lambda: load_transitions(source, download=download))
    shard_set = guard(
        lambda: write_shard_set(
            transitions,
            out,
            rows_per_shard=rows_per_shard,
            source={"name": source},
            params={"rows_per_shard": rows_per_shard},
            overwrite=overwrite,
        )
    )
    console.print(
        f"wrote {len(shard_set.shards)} shard(s), {shard_set.rows} rows, "
        f"{shard_set.episodes} episodes to {shard_set.directory}"
    )


def verify(
    directory: Annotated[
        Path, typer.Argument(help="A shard set, a published dataset or a run directory.")
    ],
) -> None:
    """Check every file against its recorded checksum; list the bad ones.

    A run directory stands for its augmented shard set.
    """
    from offaug.datasets.publish import verify_published
    from offaug.datasets.shards import ShardSet, is_shard_set
    from offaug.pipeline.rundir.files import augmented_directory, is_run_directory

    if (directory / "checksums.json").is_file() and not is_shard_set(directory):
        problems = guard(lambda: verify_published(directory))
        for name, problem in problems:
            err_console.print(f"[bold red]bad file[/] {directory / name}: {problem}")
        if problems:
            raise typer.Exit(code=1)
        console.print(f"{directory}: every file matches checksums.json")
        return
    shards = guard(lambda: augmented_directory(directory)) if is_run_directory(directory) else None
    shard_set = guard(lambda: ShardSet.open(shards or directory))
    bad = shard_set.verify()
    for ref, problem in bad:
        err_console.print(f"[bold red]bad shard[/] {ref.path}: {problem}", highlight=False)
    if bad:
        raise typer.Exit(code=1)
    console.print(f"{len(shard_set.shards)} shard(s), {shard_set.rows} rows: all checksums match")


class Include(str, Enum):
    """What a run directory contributes to a published dataset."""

    original = "original"
    augmented = "augmented"
    both = "both"


def publish(
    sources: Annotated[
        list[str],
        typer.Argument(
            help="Parts in order: Minari ids/dirs, D4RL files, shard sets, or a run directory."
        ),
    ],
    dataset_id: Annotated[
        str, typer.Option("--dataset-id", help="Minari id to write: [namespace/]name-vK.")
    ],
    include: Annotated[
        Include, typer.Option(help="For a run directory: original, augmented or both.")
    ] = Include.both,
    data_format: Annotated[
        StorageFormat, typer.Option("--format", help="Minari storage format.")
    ] = StorageFormat.hdf5,
    root: Annotated[
        Path | None, typer.Option(help="Datasets root (default MINARI_DATASETS_PATH).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset.")] = False,
    info_key: Annotated[
        list[str] | None,
        typer.Option("--info-key", help="Also publish infos/KEY of Minari/D4RL sources."),
    ] = None,
    description: Annotated[str | None, typer.Option(help="Minari description.")] = None,
    author: Annotated[str | None, typer.Option(help="Minari author.")] = None,
    author_email: Annotated[str | None, typer.Option(help="Minari author email.")] = None,
    code_permalink: Annotated[str | None, typer.Option(help="Minari code permalink.")] = None,
    provenance: Annotated[
        Path | None, typer.Option(help="YAML/JSON mapping kept as provenance.")
    ] = None,
    card: Annotated[
        Path | None, typer.Option(help="Markdown appended to the dataset card.")
    ] = None,
    push: Annotated[
        bool, typer.Option(help="Upload with Minari's upload path (needs a network).")
    ] = False,
) -> None:
    """Publish original and/or augmented data as one Minari dataset (HDF5 or Arrow)."""
    from offaug.pipeline.stages.publishing import publish_sources

    extra = read_mapping(provenance, "provenance") if provenance is not None else {}
    published = guard(
        lambda: publish_sources(
            sources,
            dataset_id,
            include=include.value,
            info_keys=info_key or (),
            provenance=extra,
            root=root,
            data_format=data_format.value,
            overwrite=overwrite,
            description=description,
            author=author,
            author_email=author_email,
            code_permalink=code_permalink,
            card=card.read_text() if card is not None else None,
        )
    )
    console.print(
        f"published [bold]{published.dataset_id}[/]: {published.episodes} episodes, "
        f"{published.steps} steps, {published.data_format} storage, at {published.path} "
        f"(checksum {published.checksum})"
    )
    if push:
        _push(published.dataset_id, root)


def _push(dataset_id: str, root: Path | None) -> None:
    """Upload with Minari's own upload path; the local dataset stays as it is on failure."""
    import os

    import minari

    token = os.environ.get("HF_TOKEN")
    try:
        if root is not None:
            os.environ["MINARI_DATASETS_PATH"] = str(root)
        minari.upload_dataset(dataset_id, token)
    except Exception as exc:
        # Deliberately broad: the HTTP stack's errors are not part of Minari's API.
        fail(
            f"could not upload {dataset_id} ({type(exc).__name__}: {exc}); the local dataset is "
            f"intact. Check the network and HF_TOKEN, then run `minari upload {dataset_id}`.",
            1,
        )
    console.print(f"uploaded {dataset_id}")


cache_app = typer.Typer(help="The cache of converted datasets (OFFAUG_CACHE_DIR).")


@cache_app.command("info")
def cache_info() -> None:
    """Where the cache is and how much it holds."""
    from offaug.datasets.paths import cache_root

    root = cache_root()
    entries = list((root / "transitions").glob("*")) if root.exists() else []
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    console.print(f"{root}: {len(entries)} entries, {size / 2**20:.1f} MiB")


@cache_app.command("clear")
def cache_clear() -> None:
    """Delete every cached conversion."""
    from offaug.datasets.paths import cache_root

    target = cache_root() / "transitions"
    shutil.rmtree(target, ignore_errors=True)
    console.print(f"cleared {target}")
