"""The ``offaug`` command line (Typer + rich).

Every command turns offaug's documented errors into one red line naming the file and field,
and a non-zero exit; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="offaug",
    help=(
        "Offline RL data augmentation: load Minari and D4RL datasets, roll a BC policy out with "
        "noise and importance weights, train CQL, BCQ and BC, diagnose distribution shift and "
        "publish the result as a Minari dataset; `offaug run WORKFLOW` does it all on Dask."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="The cache of converted datasets (OFFAUG_CACHE_DIR).")
app.add_typer(cache_app, name="cache")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")


class StorageFormat(str, Enum):
    """Minari storage formats offaug writes."""

    hdf5 = "hdf5"
    arrow = "arrow"


def _run(action: Callable[[], T]) -> T:
    from offaug.datasets.errors import DataError

    try:
        return action()
    except (DataError, FileExistsError, FileNotFoundError) as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from exc


@app.command("make-dataset")
def make_dataset_command(
    env_id: Annotated[str, typer.Argument(help="Gymnasium env id, e.g. Hopper-v5.")],
    dataset_id: Annotated[
        str, typer.Option("--dataset-id", help="Minari id to write: [namespace/]name-vK.")
    ],
    policy: Annotated[
        str, typer.Option(help="'random', or 'sac' (trained online; see --level).")
    ] = "random",
    level: Annotated[
        str, typer.Option(help="With --policy sac: random, medium, expert or medium-replay.")
    ] = "medium",
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
    from offaug.datasets.generate import make_dataset

    if policy == "sac":
        from offaug.algorithms.levels import make_level_dataset

        if episodes is not None:
            err_console.print("[bold red]error:[/] --policy sac collects --steps, not --episodes")
            raise typer.Exit(code=2)
        with console.status(f"training SAC on {env_id} for the {level} level"):
            made = _run(
                lambda: make_level_dataset(
                    env_id,
                    dataset_id,
                    level,  # type: ignore[arg-type]
                    train_steps=train_steps,
                    steps=steps,
                    seed=seed,
                    data_format=data_format.value,
                    root=root,
                    overwrite=overwrite,
                    max_episode_steps=max_episode_steps,
                )
            )
        console.print(
            f"wrote [bold]{made.dataset.dataset_id}[/] ({level}): {made.dataset.episodes} "
            f"episodes, {made.dataset.steps} steps at {made.dataset.path}; policy return "
            f"{made.policy_return}, random {made.random_return:.1f}, expert {made.expert_return}"
        )
        return
    if (steps is None) == (episodes is None):
        err_console.print("[bold red]error:[/] give exactly one of --steps and --episodes")
        raise typer.Exit(code=2)
    with console.status(f"collecting {env_id} with the {policy} policy"):
        result = _run(
            lambda: make_dataset(
                env_id,
                dataset_id,
                policy=policy,
                steps=steps,
                episodes=episodes,
                data_format=data_format.value,
                seed=seed,
                max_episode_steps=max_episode_steps,
                root=root,
                overwrite=overwrite,
            )
        )
    console.print(
        f"wrote [bold]{result.dataset_id}[/]: {result.episodes} episodes, {result.steps} steps, "
        f"{result.data_format} storage, at {result.path}"
    )


def _format_stats(stats: dict[str, float]) -> str:
    return f"{stats['mean']:.3g} ± {stats['std']:.3g} [{stats['min']:.3g}, {stats['max']:.3g}]"


@app.command()
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

    transitions = _run(
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


@app.command()
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

    transitions = _run(lambda: load_transitions(source, download=download))
    shard_set = _run(
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


@app.command()
def verify(
    directory: Annotated[Path, typer.Argument(help="A shard-set directory.")],
) -> None:
    """Check every shard of a shard set against its manifest; list the bad ones."""
    from offaug.datasets.shards import ShardSet

    if (directory / "checksums.json").is_file() and not (directory / "manifest.json").is_file():
        from offaug.datasets.publish import verify_published

        problems = _run(lambda: verify_published(directory))
        for name, problem in problems:
            err_console.print(f"[bold red]bad file[/] {directory / name}: {problem}")
        if problems:
            raise typer.Exit(code=1)
        console.print(f"{directory}: every file matches checksums.json")
        return
    if (directory / "stages.json").is_file():
        directory = Path(
            json.loads((directory / "stages.json").read_text())["stages"]["rollout"]["result"][
                "directory"
            ]
        )
    shard_set = _run(lambda: ShardSet.open(directory))
    bad = shard_set.verify()
    for ref, problem in bad:
        err_console.print(f"[bold red]bad shard[/] {ref.path}: {problem}", highlight=False)
    if bad:
        raise typer.Exit(code=1)
    console.print(f"{len(shard_set.shards)} shard(s), {shard_set.rows} rows: all checksums match")


@app.command("train")
def train_command(
    algorithm: Annotated[
        str,
        typer.Argument(
            help="bc, cql, bcq, discrete_cql, discrete_bcq, or sac (offline SAC, as a reference)."
        ),
    ],
    sources: Annotated[
        list[str], typer.Argument(help="Datasets: Minari ids/dirs, D4RL files, shard sets.")
    ],
    out: Annotated[Path, typer.Option(help="Run directory.")] = Path("runs/train"),
    config: Annotated[
        Path | None, typer.Option(help="YAML mapping of the learner's config fields.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Gradient steps in total.")] = 10_000,
    seed: Annotated[int, typer.Option(help="Seed of init, sampling, evaluation.")] = 0,
    mixing: Annotated[
        str | None, typer.Option(help="Share of each source per batch, e.g. 0.5,0.5.")
    ] = None,
    weights: Annotated[bool, typer.Option(help="Weight losses by importance_weight.")] = False,
    eval_every: Annotated[int, typer.Option(help="Steps between evaluations (0: none).")] = 5000,
    eval_episodes: Annotated[int, typer.Option(help="Episodes per evaluation.")] = 5,
    env: Annotated[
        str | None, typer.Option(help="Evaluate in this env id instead of the dataset's.")
    ] = None,
    log_every: Annotated[int, typer.Option(help="Steps between metric lines.")] = 1000,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = 5000,
    resume: Annotated[bool, typer.Option(help="Continue from OUT/checkpoint.pt.")] = False,
    device: Annotated[str | None, typer.Option(help="Torch device (default cuda if any).")] = None,
    threads: Annotated[int | None, typer.Option(help="Torch CPU threads.")] = None,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile where it pays (Gaussian BC: 1.1-1.4x after 3-11 s of compiling).",
        ),
    ] = False,
) -> None:
    """Train an offline learner; metrics, evaluations and checkpoints go to OUT."""
    import yaml
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from offaug.algorithms.registry import ALGORITHMS
    from offaug.algorithms.train import TrainOptions, train

    # Before any data is read: a typo should not cost a dataset load.
    if algorithm not in ALGORITHMS:
        choices = ", ".join(sorted(ALGORITHMS))
        err_console.print(
            f"[bold red]error:[/] unknown algorithm {algorithm!r}; choose from {choices}"
        )
        raise typer.Exit(code=2)
    overrides: dict[str, Any] = {}
    if config is not None:
        try:
            loaded = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError) as exc:
            err_console.print(f"[bold red]error:[/] {config}: cannot read YAML ({exc})")
            raise typer.Exit(code=2) from exc
        if loaded is not None and not isinstance(loaded, dict):
            err_console.print(f"[bold red]error:[/] {config}: must be a mapping of config fields")
            raise typer.Exit(code=2)
        overrides = loaded or {}
    mixing_values = None
    if mixing is not None:
        try:
            mixing_values = tuple(float(x) for x in mixing.split(","))
        except ValueError as exc:
            err_console.print(f"[bold red]error:[/] --mixing {mixing!r}: numbers like 0.5,0.5")
            raise typer.Exit(code=2) from exc
    options = TrainOptions(
        steps=steps,
        seed=seed,
        mixing=mixing_values,
        use_weights=weights,
        log_every=log_every,
        eval_every=eval_every,
        eval_episodes=eval_episodes,
        env_id=env,
        checkpoint_every=checkpoint_every,
        device=device,
        threads=threads,
        compile=compile,
    )
    writer = _tensorboard_writer(out)
    with Progress(
        TextColumn(f"[bold]{algorithm}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("train", total=steps, info="")

        def on_progress(step: int, metrics: dict[str, float]) -> None:
            info = ", ".join(f"{k}={v:.3g}" for k, v in metrics.items())
            progress.update(task, completed=step, info=info)
            if writer is not None:
                for name, value in metrics.items():
                    writer.add_scalar(f"train/{name}", value, step)

        def run() -> Any:
            try:
                return train(
                    algorithm,
                    sources,
                    out,
                    config=overrides,
                    options=options,
                    resume=resume,
                    on_progress=on_progress,
                )
            except ValueError as exc:
                from offaug.datasets.errors import DataError

                if isinstance(exc, DataError):
                    raise
                raise DataError(str(exc)) from exc

        result = _run(run)
    if writer is not None:
        writer.close()
    evaluation = result.last_evaluation
    if evaluation is not None:
        score = (
            f", normalised score {evaluation.normalised_score:.1f}"
            if evaluation.normalised_score is not None
            else ""
        )
        console.print(f"final return {evaluation.mean_return:.1f}{score}")
    console.print(f"checkpoint: {result.checkpoint}")


class StartKind(str, Enum):
    """Where rollout episodes start."""

    reset = "reset"
    dataset = "dataset"


@app.command("rollout")
def rollout_command(
    source: Annotated[str, typer.Argument(help="The dataset the BC policy was trained on.")],
    policy: Annotated[Path, typer.Option(help="BC checkpoint (offaug train bc ...).")],
    out: Annotated[Path, typer.Option(help="Shard-set directory to write.")],
    noise: Annotated[
        str, typer.Option(help="gaussian:SIGMA, ou:SIGMA[:THETA], uniform, +epsilon:EPS, mixtures.")
    ] = "gaussian:0.1",
    episodes: Annotated[int, typer.Option(help="Episodes in total.")] = 100,
    tasks: Annotated[int, typer.Option(help="Shards (units of parallel work).")] = 1,
    envs: Annotated[int, typer.Option(help="Environments stepped together per task.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of resets, noise and start states.")] = 0,
    start: Annotated[StartKind, typer.Option(help="reset, or branch from dataset states.")] = (
        StartKind.reset
    ),
    max_weight: Annotated[float, typer.Option(help="Clip importance weights here.")] = 100.0,
    env: Annotated[str | None, typer.Option(help="Env id instead of the dataset's.")] = None,
    max_episode_steps: Annotated[int | None, typer.Option(help="Override the time limit.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing shard set.")] = False,
) -> None:
    """Roll the BC policy out with noise; every transition carries its importance weight."""
    from offaug.pipeline.noise import NoiseSpecError, parse_noise
    from offaug.pipeline.rollout import (
        RolloutConfig,
        RolloutError,
        merge_rollout_shards,
        run_rollout_task,
        split_tasks,
    )

    try:
        parse_noise(noise)
    except NoiseSpecError as exc:
        err_console.print(f"[bold red]error:[/] --noise {noise!r}: {exc}")
        raise typer.Exit(code=2) from exc
    if out.exists() and not overwrite:
        err_console.print(f"[bold red]error:[/] {out} exists; pass --overwrite to replace it")
        raise typer.Exit(code=2)
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    config = RolloutConfig(
        episodes=episodes,
        n_envs=envs,
        noise=noise,
        seed=seed,
        max_weight=max_weight,
        start=start.value,
        max_episode_steps=max_episode_steps,
    )
    jobs = split_tasks(source, str(policy), config, staging, tasks, env_id=env)
    results = []
    with console.status("rolling out") as status:
        for job in jobs:
            status.update(f"rollout task {job.task_index + 1}/{len(jobs)}")
            try:
                results.append(_run(lambda job=job: run_rollout_task(job)))  # type: ignore[misc]
            except (RolloutError, TypeError) as exc:
                shutil.rmtree(staging, ignore_errors=True)
                err_console.print(f"[bold red]error:[/] rollout task {job.task_index}: {exc}")
                raise typer.Exit(code=1) from exc
    shard_set = merge_rollout_shards(
        staging, results, {"noise": noise, "max_weight": max_weight, "episodes": episodes}
    )
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    stats = shard_set.params["weight_stats"]
    faults = sum(r.faults for r in results)
    console.print(
        f"wrote {shard_set.episodes} episodes, {shard_set.rows} transitions in "
        f"{len(results)} shard(s) to {out}; ESS/N {stats['ess_fraction']:.3f}, "
        f"clipped {stats['clipped_fraction']:.3f}, max weight {stats['max_weight']:.3g}, "
        f"{faults} fault(s)"
    )


@app.command()
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
        str, typer.Option(help="For a run directory: original, augmented or both.")
    ] = "both",
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
    import functools

    import yaml

    from offaug.datasets.publish import publish_dataset
    from offaug.datasets.shards import ShardSet
    from offaug.datasets.sources import load_transitions, resolve_source

    if include not in ("original", "augmented", "both"):
        err_console.print(f"[bold red]error:[/] --include {include!r}: original, augmented or both")
        raise typer.Exit(code=2)
    expanded: list[str] = []
    extra: dict[str, Any] = {}
    for source in sources:
        stages_file = Path(source) / "stages.json"
        if stages_file.is_file():
            # A run directory: its source dataset and/or its augmented shard set.
            records = json.loads(stages_file.read_text()).get("stages", {})
            if include in ("original", "both"):
                expanded.append(records["source"]["result"]["source"])
            if include in ("augmented", "both"):
                expanded.append(records["rollout"]["result"]["directory"])
            workflow_file = Path(source) / "workflow.yaml"
            if workflow_file.is_file():
                from offaug.pipeline.workflow import load_workflow

                flow = load_workflow(workflow_file)
                extra.update({"workflow": flow.name, "workflow_hash": flow.digest()})
        else:
            expanded.append(source)
    parts: list[Any] = []
    recorded: list[dict[str, Any]] = []
    for source in expanded:
        resolved = _run(functools.partial(resolve_source, source))
        if resolved.kind == "shards":
            shard_set = _run(functools.partial(ShardSet.open, resolved.path))
            parts.append(shard_set)
            recorded.append(
                {
                    "name": source,
                    "kind": "shards",
                    "source": dict(shard_set.source),
                    "checksums": [ref.checksum for ref in shard_set.shards],
                }
            )
        else:
            parts.append(
                _run(functools.partial(load_transitions, source, info_keys=info_key or ()))
            )
            recorded.append({"name": source, "kind": resolved.kind, "path": str(resolved.path)})
    if provenance is not None:
        try:
            loaded = yaml.safe_load(provenance.read_text())
        except (OSError, yaml.YAMLError) as exc:
            err_console.print(f"[bold red]error:[/] {provenance}: cannot read YAML/JSON ({exc})")
            raise typer.Exit(code=2) from exc
        if not isinstance(loaded, dict):
            err_console.print(f"[bold red]error:[/] {provenance}: must be a mapping")
            raise typer.Exit(code=2)
        extra.update(loaded)
    published = _run(
        functools.partial(
            publish_dataset,
            parts,
            dataset_id,
            root=root,
            data_format=data_format.value,
            overwrite=overwrite,
            description=description,
            author=author,
            author_email=author_email,
            code_permalink=code_permalink,
            provenance={"sources": recorded, **extra},
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
        err_console.print(
            f"[bold red]error:[/] could not upload {dataset_id} ({type(exc).__name__}: {exc}); "
            "the local dataset is intact. Check the network and HF_TOKEN, then run "
            f"`minari upload {dataset_id}`."
        )
        raise typer.Exit(code=1) from exc
    console.print(f"uploaded {dataset_id}")


def _load_workflow(path: Path) -> Any:
    """A validated workflow, or every problem printed (file:line, field) and exit 2."""
    from offaug.pipeline.workflow import WorkflowError, load_workflow

    try:
        return load_workflow(path)
    except WorkflowError as exc:
        err_console.print(f"[bold red]invalid workflow[/]\n{exc}", highlight=False)
        raise typer.Exit(code=2) from exc


@app.command()
def validate(
    workflow: Annotated[Path, typer.Argument(help="A workflow YAML file.")],
) -> None:
    """Check a workflow file without running it."""
    loaded = _load_workflow(workflow)
    console.print(f"{workflow}: valid ({loaded.name}, hash {loaded.digest()})")


@app.command()
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
    """Run a workflow as a Dask graph: source, BC, rollouts, training, diagnostics, publish."""
    from rich.live import Live

    from offaug.pipeline.graph import StageFailed, run_workflow

    loaded = _load_workflow(workflow)
    run_dir = out or Path("runs") / loaded.name
    states: dict[str, str] = {}

    def render() -> Table:
        table = Table(title=f"offaug run {loaded.name} -> {run_dir}", show_header=True)
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
            result = run_workflow(
                loaded, run_dir, scheduler=scheduler, force=force or (), on_event=on_event
            )
        except StageFailed as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(code=1) from exc
    if result.dashboard:
        console.print(f"Dask dashboard was at {result.dashboard}")
    _print_summary(result.run_dir)
    compute = sum(result.stage_seconds.values())
    console.print(
        f"{len(result.executed)} stage(s) run, {len(result.skipped)} up to date; wall "
        f"{result.wall_seconds:.1f} s, stage compute {compute:.1f} s; results in {result.run_dir}"
    )


def _print_summary(run_dir: Path) -> None:
    metrics_path = run_dir / "metrics.json"
    if not metrics_path.is_file():
        return
    metrics = json.loads(metrics_path.read_text())
    table = Table(title="scores (normalised; return in brackets)")
    table.add_column("learner")
    table.add_column("original")
    table.add_column("original + augmented")
    training = metrics.get("training", {})
    learners = sorted({name.rsplit("-", 1)[0] for name in training})

    def cell(entry: dict[str, Any] | None) -> str:
        if not entry or entry.get("return") is None:
            return "-"
        score = entry.get("normalised_score")
        text = f"{score:.1f}" if score is not None else "n/a"
        return f"{text} ({entry['return']:.1f})"

    for learner in learners:
        table.add_row(
            learner,
            cell(training.get(f"{learner}-original")),
            cell(training.get(f"{learner}-augmented")),
        )
    console.print(table)
    weights = metrics.get("weights") or {}
    if weights:
        console.print(
            f"importance weights: ESS/N {weights.get('ess_fraction', 0):.3f}, clipped "
            f"{weights.get('clipped_fraction', 0):.3f}, max {weights.get('max_weight', 0):.3g}"
        )
    if metrics.get("diagnostics"):
        _print_headline(metrics, "distribution shift")


def _print_headline(metrics: dict[str, Any], title: str) -> None:
    from offaug.pipeline.report import headline

    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for label, value in headline(metrics):
        table.add_row(label, value)
    console.print(table)


def _read_metrics(run_dir: Path) -> dict[str, Any]:
    metrics: dict[str, Any] = json.loads((run_dir / "metrics.json").read_text())
    return metrics


@app.command("diagnose")
def diagnose_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with stages.json).")],
) -> None:
    """Distribution-shift diagnostics of a finished run; updates RUN_DIR/metrics.json."""
    from offaug.pipeline.diagnostics import diagnose_run
    from offaug.pipeline.workflow import WorkflowError

    def run() -> dict[str, Any]:
        try:
            return diagnose_run(run_dir)
        except WorkflowError as exc:
            from offaug.datasets.errors import DataError

            raise DataError(str(exc)) from exc

    with console.status(f"diagnosing {run_dir}"):
        result = _run(run)
    _print_headline(_read_metrics(run_dir), f"{run_dir}: diagnostics")
    seconds = sum(result.get("timings", {}).values())
    console.print(
        f"wrote {run_dir / 'diagnostics.json'} and the diagnostics of "
        f"{run_dir / 'metrics.json'} in {seconds:.1f} s"
    )


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with metrics.json).")],
) -> None:
    """Write RUN_DIR/report.html, a self-contained HTML report, and print its headline."""
    from offaug.pipeline.report import report_run

    path = _run(lambda: report_run(run_dir))
    _print_headline(_read_metrics(run_dir), str(run_dir))
    console.print(f"report: {path}")


def _tensorboard_writer(out: Path) -> Any:
    """A TensorBoard writer when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(out / "tensorboard"))


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


def main() -> None:
    """Entry point for ``python -m offaug``."""
    app()


_SEVERITY_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


@app.command("doctor")
def doctor_command(
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
    loaded = _load_workflow(workflow) if workflow is not None else None
    report = _run(lambda: doctor_source(source, workflow=loaded, gamma=gamma, download=download))
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


@app.command("render")
def render_command(
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
        filmed = _run(
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


@app.command("rank")
def rank_command(
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

    from distributed import Client, LocalCluster

    from offaug.pipeline.diagnostics import rank_checkpoints
    from offaug.pipeline.rank_metric import RankMetricError, parse_rank_metric
    from offaug.pipeline.render import resolve_policy

    try:
        weights = parse_rank_metric(metric)
    except RankMetricError as exc:
        err_console.print(f"[bold red]error:[/] --metric: {exc}", highlight=False)
        raise typer.Exit(code=2) from exc
    targets = [_run(lambda p=p: resolve_policy(p, env_id=env)) for p in checkpoints]  # type: ignore[misc]
    first = targets[0]
    envs = {t.env_id or str(t.meta.get("eval_env_spec") or t.meta.get("env_spec")) for t in targets}
    if len(envs) > 1:
        err_console.print(
            "[bold red]error:[/] the policies were trained in different environments; pass "
            "--env ID to roll them all out in one"
        )
        raise typer.Exit(code=2)
    paths = [str(t.checkpoint) for t in targets]
    cluster = None
    if scheduler is None:
        # Dask's client API is untyped (mypy: no-untyped-call on these two calls).
        cluster = LocalCluster(  # type: ignore[no-untyped-call]
            n_workers=workers or min(len(paths), os.cpu_count() or 1),
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
        )
    with Client(cluster or scheduler, timeout="30s") as client:  # type: ignore[no-untyped-call]
        try:
            with console.status(f"rolling {len(paths)} policies from {starts} start states"):
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
        finally:
            if cluster is not None:
                cluster.close()
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


@app.command("review")
def review_command(
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
    from offaug.pipeline.review import ReviewOptions, apply_choices, review_dir, review_run

    directory = review_dir(run_dir, out)
    if apply is not None:
        labelled = _run(lambda: apply_choices(apply, directory))
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
        result = _run(lambda: review_run(run_dir, options, out=out))
    if result.media_note:
        console.print(result.media_note, highlight=False)
    console.print(
        f"{len(result.candidates)} candidates: open {result.page}, pick one per start state, "
        f"save choices.json, then: offaug review {run_dir} --apply choices.json"
    )
