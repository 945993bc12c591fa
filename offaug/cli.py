"""The ``offaug`` command line (Typer + rich).

Each command parses its arguments, calls one library function and prints the result. offaug's
documented errors become one red line naming the file and field, and a non-zero exit; anything
else is a bug and keeps its traceback. The data commands (make-dataset, inspect, shard, verify,
publish, cache) are in :mod:`offaug.cli_data`, the workflow commands (validate, run, diagnose,
report) in :mod:`offaug.cli_pipeline`; training and rollouts are here.

Commands import the library inside their bodies: importing torch, Dask and the data stack up
front would make every command, ``offaug --help`` included, wait seconds for modules it does
not use.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from offaug import cli_data, cli_pipeline, cli_tools
from offaug.algorithms.names import LEARNERS, Weighting
from offaug.cli_common import console, err_console, fail, guard, read_mapping

app = typer.Typer(
    name="offaug",
    help=(
        "Offline RL data augmentation: load Minari and D4RL datasets, roll a BC policy out with "
        "noise and importance weights, train offline learners (BC, CQL, BCQ, IQL, TD3+BC, "
        "ReBRAC, SAC; CQL and BCQ for discrete actions too), diagnose distribution shift and "
        "publish the result as a Minari dataset; `offaug run WORKFLOW` does it all on Dask and "
        "says whether augmentation helped."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Commands are listed by `offaug --help` in the order they are registered.
app.command("make-dataset")(cli_data.make_dataset)
app.command("inspect")(cli_data.inspect)
app.command("shard")(cli_data.shard)
app.command("verify")(cli_data.verify)


# What `offaug train` prints in place of the final return when it evaluated nothing.
_NOT_EVALUATED = "not evaluated (--eval-every 0 or --eval-episodes 0): no return or score"


class CompileStepKind(str, Enum):
    """``offaug train --compile-step``: whether training takes the graph-safe step."""

    auto = "auto"
    on = "on"
    off = "off"


@app.command("train")
def train_command(
    algorithm: Annotated[
        str,
        typer.Argument(help=f"One of {', '.join(LEARNERS)} (sac: offline SAC, as a reference)."),
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
    seeds: Annotated[
        str | None,
        typer.Option(
            help="Several seeds trained together in one process, e.g. 0,1,2 (OUT/seed_N each)."
        ),
    ] = None,
    mixing: Annotated[
        str | None, typer.Option(help="Share of each source per batch, e.g. 0.5,0.5.")
    ] = None,
    weighting: Annotated[
        Weighting | None,
        typer.Option(
            help="Weight augmented rows: none, behaviour (their importance_weight beta_hat/mu) or"
            " policy (pi/mu from the learner's current policy); normalised within each source.",
        ),
    ] = None,
    weights: Annotated[
        bool, typer.Option(help="Same as --weighting behaviour (kept for old scripts).")
    ] = False,
    state_noise: Annotated[
        str | None,
        typer.Option(
            help="S4RL noise on observations and next observations, KIND:SCALE with KIND"
            " gaussian or uniform and SCALE in units of each dimension's std, e.g. gaussian:0.003.",
        ),
    ] = None,
    eval_every: Annotated[
        int, typer.Option(min=0, help="Steps between evaluations (0: none, no env needed).")
    ] = 5000,
    eval_episodes: Annotated[
        int, typer.Option(min=0, help="Episodes per evaluation (0: none, no env needed).")
    ] = 5,
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
            help="torch.compile the learner where it pays (see docs/performance.md).",
        ),
    ] = False,
    compile_step: Annotated[
        CompileStepKind,
        typer.Option(
            help="The graph-safe step: captured in CUDA graphs on a GPU, compiled on a CPU;"
            " auto where it pays (see docs/training.md).",
        ),
    ] = CompileStepKind.auto,
    steps_per_call: Annotated[
        int, typer.Option(help="Steps per captured CUDA graph (graph-safe step).")
    ] = 4,
) -> None:
    """Train an offline learner; metrics, evaluations and checkpoints go to OUT."""
    from offaug.algorithms.registry import ALGORITHMS, policy_weighting_refusal
    from offaug.algorithms.training.loop import train
    from offaug.algorithms.training.options import TrainOptions
    from offaug.algorithms.training.state_noise import StateNoise

    # Before any data is read: a typo should not cost a dataset load.
    if algorithm not in ALGORITHMS:
        fail(f"unknown algorithm {algorithm!r}; choose from {', '.join(sorted(ALGORITHMS))}")
    overrides = read_mapping(config, "config fields") if config is not None else {}
    if weights and weighting not in (None, "behaviour"):
        fail(f"--weights means --weighting behaviour; it contradicts --weighting {weighting}")
    chosen: Weighting = weighting or ("behaviour" if weights else "none")
    if chosen == "policy":
        refusal = policy_weighting_refusal(algorithm, overrides)
        if refusal is not None:
            fail(f"--weighting policy: {refusal}")
    try:
        noise = StateNoise.parse(state_noise) if state_noise is not None else None
    except ValueError as exc:
        fail(f"--state-noise: {exc}")
    try:
        mixing_values = tuple(float(x) for x in mixing.split(",")) if mixing else None
    except ValueError:
        fail(f"--mixing {mixing!r}: numbers like 0.5,0.5")
    try:
        seed_values = tuple(int(x) for x in seeds.split(",")) if seeds else None
    except ValueError:
        fail(f"--seeds {seeds!r}: integers like 0,1,2")
    options = TrainOptions(
        steps=steps,
        seed=seed,
        seeds=seed_values,
        mixing=mixing_values,
        weighting=chosen,
        state_noise=noise,
        log_every=log_every,
        eval_every=eval_every,
        eval_episodes=eval_episodes,
        env_id=env,
        checkpoint_every=checkpoint_every,
        device=device,
        threads=threads,
        compile=compile,
        compile_step=compile_step.value,
        steps_per_call=steps_per_call,
    )
    if seed_values is not None:
        _train_seeds(algorithm, sources, out, overrides, options, resume)
        return
    with _TrainingProgress(algorithm, steps, out) as progress:
        # ValueError: a config field the learner does not have, or a learner that does not fit
        # the data's action space.
        result = guard(
            lambda: train(
                algorithm,
                sources,
                out,
                config=overrides,
                options=options,
                resume=resume,
                on_progress=progress.update,
            ),
            ValueError,
        )
    evaluation = result.last_evaluation
    if evaluation is not None:
        score = (
            f", normalised score {evaluation.normalised_score:.1f}"
            if evaluation.normalised_score is not None
            else ""
        )
        console.print(f"final return {evaluation.mean_return:.1f}{score}")
    elif not options.evaluates:
        console.print(_NOT_EVALUATED)
    console.print(f"checkpoint: {result.checkpoint}")


def _train_seeds(
    algorithm: str,
    sources: list[str],
    out: Path,
    overrides: dict[str, Any],
    options: Any,
    resume: bool,
) -> None:
    """``offaug train --seeds``: the seeds fused in one process, OUT/seed_N each."""
    from offaug.algorithms.training.fused_loop import train_fused

    assert options.seeds is not None
    with _TrainingProgress(algorithm, options.steps, out) as progress:
        # ValueError: as for one seed, or a learner that does not train fused, a list for a
        # config field that must be one value, or --compile where it would compile.
        result = guard(
            lambda: train_fused(
                algorithm,
                sources,
                out,
                config=overrides,
                options=options,
                resume=resume,
                on_progress=progress.update,
            ),
            ValueError,
        )
    if not options.evaluates:
        console.print(_NOT_EVALUATED)
    for seed, run in zip(options.seeds, result.runs, strict=True):
        evaluation = run.last_evaluation
        line = f"seed {seed}: checkpoint {run.checkpoint}"
        if evaluation is not None:
            line += f", final return {evaluation.mean_return:.1f}"
        console.print(line)
    if result.frozen:
        console.print(f"stopped (a loss turned NaN or infinite): seeds {result.frozen}")


class _TrainingProgress:
    """A progress bar of training steps and metrics, mirrored to TensorBoard when installed."""

    def __init__(self, algorithm: str, steps: int, out: Path) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn(f"[bold]{algorithm}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task("train", total=steps, info="")
        self.writer = _tensorboard_writer(out)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        info = ", ".join(f"{k}={v:.3g}" for k, v in metrics.items())
        self.progress.update(self.task, completed=step, info=info)
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"train/{name}", value, step)

    def __enter__(self) -> _TrainingProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(out: Path) -> Any:
    """A TensorBoard writer when tensorboard is installed, else None."""
    try:
        # Optional: torch's TensorBoard writer needs the tensorboard package.
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(out / "tensorboard"))


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
    from offaug.pipeline.rollouts.config import RolloutConfig, RolloutError
    from offaug.pipeline.rollouts.noise import NoiseSpecError, parse_noise
    from offaug.pipeline.rollouts.tasks import rollout_to_shard_set

    try:
        spec = parse_noise(noise)
    except NoiseSpecError as exc:
        err_console.print(f"[bold red]error:[/] --noise {noise!r}: {exc}")
        raise typer.Exit(code=2) from exc
    if out.exists() and not overwrite:
        err_console.print(f"[bold red]error:[/] {out} exists; pass --overwrite to replace it")
        raise typer.Exit(code=2)
    config = RolloutConfig(
        episodes=episodes,
        n_envs=envs,
        noise=spec,
        seed=seed,
        max_weight=max_weight,
        start=start.value,
        max_episode_steps=max_episode_steps,
    )
    with console.status("rolling out") as status:
        try:
            outcome = guard(
                lambda: rollout_to_shard_set(
                    source,
                    policy,
                    config,
                    out,
                    tasks=tasks,
                    env_id=env,
                    overwrite=overwrite,
                    on_task=lambda job, total: status.update(
                        f"rollout task {job.task_index + 1}/{total}"
                    ),
                )
            )
        except (RolloutError, NoiseSpecError, TypeError) as exc:
            err_console.print(f"[bold red]error:[/] rollout: {exc}")
            raise typer.Exit(code=1) from exc
    shard_set = outcome.shard_set
    stats = shard_set.params["weight_stats"]
    console.print(
        f"wrote {shard_set.episodes} episodes, {shard_set.rows} transitions in "
        f"{len(shard_set.shards)} shard(s) to {out}; ESS/N {stats['ess_fraction']:.3f}, "
        f"clipped {stats['clipped_fraction']:.3f}, max weight {stats['max_weight']:.3g}, "
        f"{outcome.faults} fault(s)"
    )


app.command("publish")(cli_data.publish)
app.command("validate")(cli_pipeline.validate)
app.command("run")(cli_pipeline.run)
app.command("diagnose")(cli_pipeline.diagnose)
app.command("report")(cli_pipeline.report)
app.command("doctor")(cli_tools.doctor)
app.command("quality")(cli_tools.quality)
app.command("render")(cli_tools.render)
app.command("rank")(cli_tools.rank)
app.command("review")(cli_tools.review)
app.add_typer(cli_data.cache_app, name="cache")


def main() -> None:
    """Entry point for ``python -m offaug``."""
    app()
