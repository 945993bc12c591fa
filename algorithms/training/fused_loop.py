"""Several seeds of one learner trained together: ``offaug train ALGO SOURCE... --seeds 0,1,2``.

Each member is built, prepared and sampled exactly as the single-seed run of its seed
(:func:`offaug.algorithms.training.loop.train`): its own initialisation, its own
:class:`~offaug.datasets.sampler.MixtureSampler` stream, its own evaluation episodes. The members
then train as one :class:`~offaug.algorithms.fused.trainer.FusedTrainer`, and each writes its own
run directory in a single-seed run's format (config.json, metrics.jsonl, checkpoint.pt that
:func:`~offaug.algorithms.training.checkpoints.load_trainer` loads), so every later stage reads a
member as it reads any other run. ``config`` may give a list for a field of the learner's
``fused_hyperparameters``, one value per seed (a small sweep trains fused too), and ``sources`` may
give a list of sources per seed (each seed of a workflow has its own augmented data).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeAlias, TypeVar

import numpy as np
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import Spaces, Trainer, config_to_json, reads_sources
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.evaluate import EvaluationResult, evaluate, make_env, reference_scores
from offaug.algorithms.fused.graph_step import GraphStep
from offaug.algorithms.fused.specs import has_fused_spec
from offaug.algorithms.fused.trainer import FusedTrainer, member_generator
from offaug.algorithms.runtime import configure_torch, seed_everything
from offaug.algorithms.training.batches import BatchPreparation, make_sampler
from offaug.algorithms.training.checkpoints import resume_from_checkpoint, write_checkpoint
from offaug.algorithms.training.graphed import GraphedUpdates, GraphFallbackWarning
from offaug.algorithms.training.loop import (
    graph_step_mode,
    learner_spaces,
    load_source,
    next_boundary,
    trainer_device,
)
from offaug.algorithms.training.options import TrainOptions, TrainResult
from offaug.datasets.atomic import write_json_atomic
from offaug.datasets.sampler import Batch, MixtureSampler, sample_stacked
from offaug.datasets.shards import ShardSet
from offaug.datasets.transitions import Transitions

Source: TypeAlias = str | os.PathLike[str] | Transitions | ShardSet
"""One training source, as :func:`~offaug.algorithms.training.loop.train` takes it."""

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class FusedResult:
    """What a fused run left behind: one single-seed result per member."""

    runs: list[TrainResult]
    frozen: list[int]
    """Seeds of the members stopped because a loss turned NaN or infinite."""


def fusable(algorithm: str) -> bool:
    """Whether learner ``algorithm`` trains fused (:mod:`offaug.algorithms.fused.specs`)."""
    return has_fused_spec(_trainer_type(algorithm))


def fusing_pays(algorithm: str, device: torch.device | str) -> bool:
    """Whether ``algorithm``'s seeds are best trained fused on ``device`` (``fuse_seeds: auto``).

    On a GPU every fusable learner: one small seed leaves most of the device idle. On a CPU only
    those whose trainer does not set ``fuses_on_cpu = False``: CQL and BCQ score many sampled
    actions per step, so their steps are arithmetic-bound already: fused (with their member
    losses looped on the CPU, ``FusedTrainer.looped``) they gain little per seed, less than a
    cluster's workers gain by running the seeds in parallel (``bench_fused``'s records in
    benchmarks/RESULTS.md; why, in docs/performance.md, "Many seeds in one process").
    """
    if not fusable(algorithm):
        return False
    on_cpu = torch.device(device).type == "cpu"
    return not on_cpu or bool(getattr(_trainer_type(algorithm), "fuses_on_cpu", True))


def _trainer_type(algorithm: str) -> type[Any]:
    spec = registry.ALGORITHMS[algorithm]
    trainer: type[Any] = getattr(importlib.import_module(spec.module), spec.trainer)
    return trainer


def member_configs(algorithm: str, config: Mapping[str, Any], members: int) -> list[dict[str, Any]]:
    """Each member's config: a list given for a per-member field is split, one value each.

    Raises:
        ValueError: a list for a field that must be one value for all members (it changes
            shapes or the update's structure), or a list of the wrong length.
    """
    spec = registry.ALGORITHMS[algorithm]
    module = importlib.import_module(spec.module)
    allowed: tuple[str, ...] = getattr(getattr(module, spec.trainer), "fused_hyperparameters", ())
    types = {f.name: str(f.type) for f in dataclasses.fields(registry.config_type(algorithm))}
    configs: list[dict[str, Any]] = [{} for _ in range(members)]
    for name, value in config.items():
        per_member = isinstance(value, list | tuple) and not types.get(name, "").startswith("tuple")
        if not per_member:
            for member in configs:
                member[name] = value
            continue
        if name not in allowed:
            raise ValueError(
                f"{algorithm} config {name!r}: one value for all seeds; a list per seed is allowed"
                f" for {', '.join(allowed)}"
            )
        if len(value) != members:
            raise ValueError(
                f"{algorithm} config {name!r}: {len(value)} values for {members} seeds"
            )
        for member, item in zip(configs, value, strict=True):
            member[name] = item
    return configs


def member_sources(sources: Sequence[T] | Sequence[Sequence[T]], members: int) -> list[list[T]]:
    """Each member's sources: ``sources`` for all of them, or its own list when ``sources``
    holds one list (or tuple) per member.

    Raises:
        ValueError: lists mixed with single sources, or not one list per member.
    """
    lists = [isinstance(s, list | tuple) for s in sources]
    if not any(lists):
        return [list(typing.cast(Sequence[T], sources))] * members
    if not all(lists) or len(sources) != members:
        raise ValueError(f"sources: one list per seed ({members}) or one list for all seeds")
    return [list(typing.cast(Sequence[T], s)) for s in sources]


def load_member_sources(sources: Sequence[Sequence[Source]]) -> list[list[Transitions | ShardSet]]:
    """Each member's sources loaded, a source that several members name loaded once."""
    loaded: dict[Any, Transitions | ShardSet] = {}

    def load(source: Source) -> Transitions | ShardSet:
        key = os.fspath(source) if isinstance(source, str | os.PathLike) else id(source)
        if key not in loaded:
            loaded[key] = load_source(source)
        return loaded[key]

    return [[load(s) for s in member] for member in sources]


def train_fused(
    algorithm: str,
    sources: Sequence[Source] | Sequence[Sequence[Source]],
    out: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    config: Mapping[str, Any] | None = None,
    options: TrainOptions | None = None,
    resume: bool = False,
    on_progress: Callable[[int, dict[str, float]], None] | None = None,
) -> FusedResult:
    """Train ``options.seeds`` of ``algorithm`` together; member ``k`` writes a run directory.

    Args:
        sources: The sources every member trains on, or one list of sources per seed (member
            ``k`` samples its own list exactly as the single-seed run on that list does).
        out: A directory (members go to ``out/seed_<seed>``) or one run directory per seed.
        config: The learner's config fields; per-member fields may be lists, one per seed.
        options: As for :func:`~offaug.algorithms.training.loop.train`, with ``seeds`` set.
        resume: Continue every member from its ``checkpoint.pt`` (all at the same step).
        on_progress: Called with (step, the first running member's metrics) per log interval.

    Raises:
        ValueError: a learner that does not train fused, ``compile`` for a learner it would
            compile, a bad per-member config, or members' checkpoints at different steps.
    """
    options = options or TrainOptions()
    seeds = list(options.seeds or (options.seed,))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must differ: {seeds}")
    if not fusable(algorithm):
        supported = [name for name in registry.ALGORITHMS if fusable(name)]
        raise ValueError(f"{algorithm} does not train fused; these do: {', '.join(supported)}")
    run_dirs = _run_dirs(out, seeds)
    configs = member_configs(algorithm, config or {}, len(seeds))
    configure_torch(options.threads)
    per_member = member_sources(sources, len(seeds))
    datasets = load_member_sources(per_member)
    built = build_members(algorithm, datasets, seeds, configs, options, run_dirs, resume)
    spaces = built.spaces
    trainers, samplers, generators, preparations, start = (
        built.trainers,
        built.samplers,
        built.generators,
        built.preparations,
        built.start,
    )
    fused = FusedTrainer(trainers, generators, seeds)
    for k, (seed, run_dir) in enumerate(zip(seeds, run_dirs, strict=True)):
        run_dir.mkdir(parents=True, exist_ok=True)
        member_options = dataclasses.replace(options, seed=seed, seeds=None)
        write_json_atomic(
            run_dir / "config.json",
            {
                "algorithm": algorithm,
                "config": config_to_json(trainers[k].config),
                "options": dataclasses.asdict(member_options),
                "compiled": [],
                "spaces": spaces.to_json(),
                "sources": [
                    str(s) if not isinstance(s, Transitions) else "<in-memory>"
                    for s in per_member[k]
                ],
                # Trained in one process with these seeds (its numbers are this seed's own).
                "fused_seeds": seeds,
            },
        )
    meta = datasets[0][0].meta
    scores = reference_scores(meta, options.env_id)
    envs = [make_env(meta, options.env_id) for _ in seeds] if options.evaluates else []
    last: list[EvaluationResult | None] = [None] * len(seeds)
    device = fused.device
    updates = _graphed(algorithm, fused, samplers, options)
    ran = start
    pending: list[dict[str, torch.Tensor]] = []
    logs = [open(d / "metrics.jsonl", "a") for d in run_dirs]  # noqa: SIM115 - closed below
    with_sources = reads_sources(fused.trainers[0])
    started = time.perf_counter()
    try:
        for step in range(start + 1, options.steps + 1):
            if updates is None:
                raw = sample_stacked(samplers)
                batch = TorchBatch.from_batch(raw, device, with_sources=with_sources)
                _count_weights(preparations, batch, raw)
                pending.append(fused.update(batch))
            elif step > ran:
                # Up to the next step the loop reads the members at, in one run of graph calls.
                until = next_boundary(ran, options)
                updates.run(until - ran)
                ran = until
            if step % options.log_every == 0 or step == options.steps:
                rate = (step - start) / (time.perf_counter() - started)
                members = (
                    _member_means(pending, len(seeds))
                    if updates is None
                    else _graphed_means(updates)
                )
                pending.clear()
                frozen = set(fused.frozen)
                for seed, log, metrics, prepare in zip(
                    seeds, logs, members, preparations, strict=True
                ):
                    metrics.update(prepare.flush_metrics())
                    line = {"step": step, "kind": "train", **metrics, "steps_per_s": rate}
                    if seed in frozen:
                        line["frozen"] = True
                    _write(log, line)
                if on_progress is not None:
                    running = [m for s, m in zip(seeds, members, strict=True) if s not in frozen]
                    on_progress(step, (running or members)[0] | {"steps_per_s": rate})
            if envs and (step % options.eval_every == 0 or step == options.steps):
                for k, (seed, env, log) in enumerate(zip(seeds, envs, logs, strict=True)):
                    result = evaluate(
                        fused.member(k).act,
                        env,
                        episodes=options.eval_episodes,
                        seed=seed + 10_000,
                        scores=scores,
                    )
                    last[k] = result
                    _write(log, _evaluation_line(step, result))
            if step % options.checkpoint_every == 0 or step == options.steps:
                for k, run_dir in enumerate(run_dirs):
                    member = fused.member(k)
                    rng = generators[k].get_state() if generators[k].device.type == "cpu" else None
                    write_checkpoint(
                        member,
                        samplers[k],
                        preparations[k],
                        algorithm,
                        member.config,
                        spaces,
                        step,
                        run_dir,
                        rng,
                    )
    finally:
        for log in logs:
            log.close()
        for env in envs:
            env.close()
    runs = [
        TrainResult(
            d,
            options.steps,
            result,
            d / "checkpoint.pt",
            prepare.usage.ess_fraction() if prepare.usage is not None else None,
        )
        for d, result, prepare in zip(run_dirs, last, preparations, strict=True)
    ]
    return FusedResult(runs, fused.frozen)


@dataclasses.dataclass(frozen=True)
class Members:
    """The members of a fused run, each as its single-seed run builds it."""

    spaces: Spaces
    """Every member's spaces (from the first member's first source, as a single-seed run's)."""
    trainers: list[Trainer]
    samplers: list[MixtureSampler]
    generators: list[torch.Generator]
    """Each member's noise stream (:func:`~offaug.algorithms.fused.trainer.member_generator`)."""
    preparations: list[BatchPreparation]
    """Each member's batch preparation (what its checkpoints record besides the trainer)."""
    start: int
    """The step every member resumes from (0 for a fresh run)."""


def build_members(
    algorithm: str,
    datasets: Sequence[Transitions | ShardSet] | Sequence[Sequence[Transitions | ShardSet]],
    seeds: Sequence[int],
    configs: Sequence[Mapping[str, Any]],
    options: TrainOptions,
    run_dirs: Sequence[Path] = (),
    resume: bool = False,
) -> Members:
    """Build, prepare (and resume) each member exactly as its single-seed run does.

    ``datasets``: every member's sources, or one list per member (:func:`member_sources`).
    """
    per_member = member_sources(datasets, len(seeds))
    spaces = learner_spaces(per_member[0][0])
    if options.weighting == "policy" or options.state_noise is not None:
        # pi/mu weights and state noise are drawn per batch by the single-seed loop only.
        raise ValueError(
            "fused seeds train with weighting 'none' or 'behaviour' and no state noise; train "
            "these seeds one by one (offaug train without --seeds, or train.fuse_seeds: false)"
        )
    trainers, samplers, generators, starts = [], [], [], []
    preparations: list[BatchPreparation] = []
    for k, (seed, member_config, own) in enumerate(zip(seeds, configs, per_member, strict=True)):
        # A single-seed run's order of draws: seed, build, prepare, (resume).
        seed_everything(seed)
        trainer = registry.build(algorithm, spaces, dict(member_config), device=options.device)
        targets = getattr(trainer, "compile_targets", lambda: ())()
        if options.compile and targets:
            raise ValueError(f"--compile does not apply to fused {algorithm} ({targets})")
        sampler = make_sampler(
            trainer,
            own,
            mixing=options.mixing,
            use_weights=options.weighting != "none",
            normalise_weights=options.normalise_weights,
            seed=seed,
        )
        prepare = BatchPreparation(trainer, sampler, own, options, trainer_device(trainer))
        checkpoint = run_dirs[k] / "checkpoint.pt" if run_dirs else Path()
        resumes = resume and bool(run_dirs) and checkpoint.is_file()
        starts.append(
            resume_from_checkpoint(trainer, sampler, prepare, checkpoint, algorithm)
            if resumes
            else 0
        )
        preparations.append(prepare)
        trainers.append(trainer)
        samplers.append(sampler)
        generators.append(member_generator(seed, trainer_device(trainer)))
    if len(set(starts)) != 1:
        raise ValueError(f"the seeds' checkpoints are at different steps: {starts}")
    return Members(spaces, trainers, samplers, generators, preparations, starts[0])


def _count_weights(preparations: Sequence[BatchPreparation], batch: TorchBatch, raw: Batch) -> None:
    """Count each member's weights as its single-seed run does (for its ESS/N metrics)."""
    for k, prepare in enumerate(preparations):
        if prepare.usage is not None:
            set_index = torch.from_numpy(raw.set_index[k].astype(np.int64)).to(batch.weights.device)
            prepare.usage.add(batch.weights[k], set_index, None)


def _run_dirs(
    out: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], seeds: Sequence[int]
) -> list[Path]:
    if isinstance(out, str | os.PathLike):
        return [Path(out) / f"seed_{seed}" for seed in seeds]
    dirs = [Path(d) for d in out]
    if len(dirs) != len(seeds):
        raise ValueError(f"{len(dirs)} run directories for {len(seeds)} seeds")
    return dirs


def _graphed(
    algorithm: str, fused: FusedTrainer, samplers: Sequence[MixtureSampler], options: TrainOptions
) -> GraphedUpdates | None:
    """The members' graph-safe steps where ``options`` take them, else None."""
    hidden = getattr(fused.trainers[0].config, "hidden", ())
    mode = graph_step_mode(algorithm, options, fused.device, hidden)
    if mode is None:
        return None
    try:
        updates = GraphedUpdates.build(
            GraphStep(fused), samplers, mode=mode, steps_per_call=options.steps_per_call
        )
    except ValueError as exc:  # members on data of their own: one device table holds one set
        warnings.warn(
            f"the graph-safe step is not used ({exc}); the members train eagerly",
            GraphFallbackWarning,
            stacklevel=3,
        )
        return None
    # After a failed compile or capture (it warned), the fused trainer's own step is faster.
    return updates if updates.mode == mode else None


def _graphed_means(updates: GraphedUpdates) -> list[dict[str, float]]:
    # One host sync per log interval, as _member_means.
    means = updates.flush_metrics()
    names = list(means)
    rows = torch.stack([means[n].float() for n in names]).t().tolist()  # (K, metrics)
    return [dict(zip(names, (float(v) for v in row), strict=True)) for row in rows]


def _member_means(pending: list[dict[str, torch.Tensor]], members: int) -> list[dict[str, float]]:
    # One host sync per log interval, as in the single-seed loop.
    names = list(pending[0])
    stacked = torch.stack([torch.stack([m[n].float() for n in names]) for m in pending])
    means = stacked.mean(0).t().tolist()  # (K, metrics)
    return [dict(zip(names, (float(v) for v in row), strict=True)) for row in means]


def _evaluation_line(step: int, result: EvaluationResult) -> dict[str, Any]:
    return {
        "step": step,
        "kind": "eval",
        "return": result.mean_return,
        "normalised_score": result.normalised_score,
        "returns": list(result.returns),
    }


def _write(log: IO[str], line: dict[str, Any]) -> None:
    log.write(json.dumps(line) + "\n")
    log.flush()
