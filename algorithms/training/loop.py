"""The offline training loop behind ``offaug train``.

It samples from one or many transition sets (with a mixing ratio and optional importance
weights: :mod:`offaug.algorithms.training.weighting`), perturbs the batch's states when asked
(:mod:`offaug.algorithms.training.state_noise`), calls ``trainer.update`` and, at fixed intervals,
logs metrics as JSON lines, evaluates the greedy policy in the dataset's environment and writes a
checkpoint. The first source is the original data (state noise is scaled by its std). A run
directory holds::

    config.json        the resolved learner config and run options (weighting, state noise)
    metrics.jsonl      one line per log interval (training, with the ESS/N of the weights
                       used) and per evaluation
    checkpoint.pt      the latest checkpoint (resume from it)
    checkpoints/       step_<N>.pt at every checkpoint interval
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import (
    Spaces,
    Trainer,
    config_to_json,
    spaces_from_transitions,
)
from offaug.algorithms.evaluate import EvaluationResult, evaluate, make_env, reference_scores
from offaug.algorithms.fused.trainer import member_generator
from offaug.algorithms.runtime import configure_torch, seed_everything
from offaug.algorithms.training.batches import BatchPreparation, make_sampler
from offaug.algorithms.training.checkpoints import (
    load_weights,
    resume_from_checkpoint,
    write_checkpoint,
)
from offaug.algorithms.training.compiling import compile_trainer
from offaug.algorithms.training.graphed import GraphedUpdates, StepMode, graphed_updates
from offaug.algorithms.training.options import (
    CPU_COMPILED_STEP,
    CPU_COMPILED_STEP_MIN_STEPS,
    GRAPH_STEP_LEARNERS,
    TrainOptions,
    TrainResult,
)
from offaug.datasets.atomic import write_json_atomic
from offaug.datasets.shards import ShardSet, is_shard_set
from offaug.datasets.sources import load_transitions
from offaug.datasets.transitions import Transitions


def load_source(source: str | os.PathLike[str] | Transitions | ShardSet) -> Transitions | ShardSet:
    """A training source as data: a shard set directory opened, anything else
    :func:`load_transitions` takes loaded, transitions and shard sets as they are."""
    if isinstance(source, (Transitions, ShardSet)):
        return source
    if is_shard_set(source):
        return ShardSet.open(source)
    return load_transitions(source)


def learner_spaces(data: Transitions | ShardSet) -> Spaces:
    """The spaces a learner trained on ``data`` (its first source) has: from its metadata and
    its first part's shapes and actions (a shard set's first shard)."""
    first = data.read(data.shards[0]) if isinstance(data, ShardSet) else data
    return spaces_from_transitions(data.meta, int(np.prod(first.observation_shape)), first.actions)


def train(
    algorithm: str,
    sources: Sequence[str | os.PathLike[str] | Transitions | ShardSet],
    out: str | os.PathLike[str],
    *,
    config: Mapping[str, Any] | None = None,
    options: TrainOptions | None = None,
    resume: bool = False,
    on_progress: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train ``algorithm`` on ``sources`` and write the run directory ``out``.

    Args:
        algorithm: A name from :data:`registry.ALGORITHMS`.
        sources: Datasets (anything :func:`load_transitions` takes), shard sets or transitions.
        out: Run directory (created).
        config: Overrides of the learner's config fields.
        options: Steps, seed, mixing, logging and evaluation.
        resume: Continue from ``out/checkpoint.pt`` if it exists.
        on_progress: Called with (step, latest metrics) at every log interval.
    """
    options = options or TrainOptions()
    if options.seeds is not None:
        raise ValueError(
            "several seeds train with offaug.algorithms.training.fused_loop.train_fused"
        )
    run_dir = Path(out)
    run_dir.mkdir(parents=True, exist_ok=True)
    configure_torch(options.threads)
    seed_everything(options.seed)
    datasets = [load_source(s) for s in sources]
    spaces = learner_spaces(datasets[0])
    if options.weighting == "policy":
        refusal = registry.policy_weighting_refusal(algorithm, config)
        if refusal is not None:
            raise ValueError(refusal)
    trainer = registry.build(algorithm, spaces, dict(config or {}), device=options.device)
    compiled = compile_trainer(trainer) if options.compile else ()
    resolved_config = trainer.config
    sampler = make_sampler(
        trainer,
        datasets,
        mixing=options.mixing,
        use_weights=options.weighting == "behaviour",
        normalise_weights=options.normalise_weights,
        rollout_log_prob=options.weighting == "policy",
        seed=options.seed,
    )
    device = trainer_device(trainer)
    prepare = BatchPreparation(trainer, sampler, datasets, options, device)
    checkpoint_path = run_dir / "checkpoint.pt"
    start = 0
    if resume and checkpoint_path.is_file():
        start = resume_from_checkpoint(trainer, sampler, prepare, checkpoint_path, algorithm)
    elif options.init_checkpoint is not None:
        load_weights(trainer, options.init_checkpoint, algorithm)
    write_json_atomic(
        run_dir / "config.json",
        {
            "algorithm": algorithm,
            "config": config_to_json(resolved_config),
            "options": dataclasses.asdict(options),
            # The learner's methods that torch.compile wraps (empty where it would not pay).
            "compiled": list(compiled),
            "spaces": spaces.to_json(),
            "sources": [
                str(s) if not isinstance(s, Transitions) else "<in-memory>" for s in sources
            ],
        },
    )
    mode = graph_step_mode(algorithm, options, device, getattr(trainer.config, "hidden", ()))
    updates: GraphedUpdates | None = None
    if mode is not None:
        updates = graphed_updates(
            [trainer],
            [member_generator(options.seed, device)],
            [options.seed],
            [sampler],
            mode=mode,
            steps_per_call=options.steps_per_call,
        )
        if updates.mode != mode:
            updates = None  # it warned: the learner's own update is the faster eager step
    ran = start
    env = None
    meta = datasets[0].meta
    scores = reference_scores(meta, options.env_id)
    if options.evaluates:
        env = make_env(meta, options.env_id)
    last_eval: EvaluationResult | None = None
    pending: list[dict[str, torch.Tensor]] = []
    started = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "a") as log:
        for step in range(start + 1, options.steps + 1):
            if updates is None:
                pending.append(trainer.update(prepare(sampler)))
            elif step > ran:
                # Up to the next step the loop reads the trainer at, in one run of graph calls.
                until = next_boundary(ran, options)
                updates.run(until - ran)
                ran = until
            if updates is not None and reads_trainer(step, options):
                updates.step.fused.member(0)  # the trainer's own tensors, for act and checkpoints
            if step % options.log_every == 0 or step == options.steps:
                metrics = _mean_metrics(pending) if updates is None else _graphed_metrics(updates)
                metrics.update(prepare.flush_metrics())
                pending.clear()
                metrics["steps_per_s"] = (step - start) / (time.perf_counter() - started)
                log.write(json.dumps({"step": step, "kind": "train", **metrics}) + "\n")
                log.flush()
                if on_progress is not None:
                    on_progress(step, metrics)
            if env is not None and (step % options.eval_every == 0 or step == options.steps):
                last_eval = evaluate(
                    trainer.act,
                    env,
                    episodes=options.eval_episodes,
                    seed=options.seed + 10_000,
                    scores=scores,
                )
                log.write(
                    json.dumps(
                        {
                            "step": step,
                            "kind": "eval",
                            "return": last_eval.mean_return,
                            "normalised_score": last_eval.normalised_score,
                            "returns": list(last_eval.returns),
                        }
                    )
                    + "\n"
                )
                log.flush()
            if step % options.checkpoint_every == 0 or step == options.steps:
                write_checkpoint(
                    trainer,
                    sampler,
                    prepare,
                    algorithm,
                    resolved_config,
                    spaces,
                    step,
                    run_dir,
                    _noise_state(updates),
                )
    if env is not None:
        env.close()
    ess = prepare.usage.ess_fraction() if prepare.usage is not None else None
    return TrainResult(run_dir, options.steps, last_eval, checkpoint_path, ess)


def graph_step_mode(
    algorithm: str, options: TrainOptions, device: torch.device, hidden: Sequence[int] = ()
) -> StepMode | None:
    """How a run takes the graph-safe step (None: the learner's own ``update``); ``hidden``,
    the learner's hidden widths, decide ``auto`` on a CPU (:data:`CPU_COMPILED_STEP`)."""
    if options.compile_step == "off":
        return None
    # Weighted runs count the weights they use per batch on the host's side (WeightUsage).
    supported = (
        algorithm in GRAPH_STEP_LEARNERS
        and options.weighting == "none"
        and options.state_noise is None
        and not options.compile
    )
    if not supported:
        if options.compile_step == "on":
            raise ValueError(
                f"--compile-step on: {algorithm} with weighting {options.weighting!r}, state"
                f" noise {options.state_noise} and compile {options.compile} has no graph-safe"
                f" step (learners: {', '.join(sorted(GRAPH_STEP_LEARNERS))}; weighting none; no"
                " state noise; no --compile)"
            )
        return None
    if device.type == "cuda":
        return "captured"
    if options.compile_step == "on":
        return "compiled"
    widest = CPU_COMPILED_STEP.get(algorithm, 0)
    small = bool(hidden) and max(hidden) <= widest
    return "compiled" if small and options.steps >= CPU_COMPILED_STEP_MIN_STEPS else None


def next_boundary(done: int, options: TrainOptions) -> int:
    """The first step after ``done`` at which the loop logs, evaluates or checkpoints."""
    step = done + 1
    while step < options.steps and not (
        step % options.log_every == 0 or reads_trainer(step, options)
    ):
        step += 1
    return step


def reads_trainer(step: int, options: TrainOptions) -> bool:
    """Whether the loop evaluates or checkpoints the trainer after ``step``."""
    evaluates = options.eval_every > 0 and step % options.eval_every == 0
    return evaluates or step % options.checkpoint_every == 0 or step == options.steps


def _noise_state(updates: GraphedUpdates | None) -> torch.Tensor | None:
    """On a CPU, the graph-safe step's noise stream, which a resumed run continues from the
    checkpoint's ``torch_rng`` (None: the global generator's, as the learner's ``update``)."""
    if updates is None:
        return None
    generator = updates.step.fused.generators[0]
    return generator.get_state() if generator.device.type == "cpu" else None


def _graphed_metrics(updates: GraphedUpdates) -> dict[str, float]:
    # One host sync per log interval, as _mean_metrics.
    means = updates.flush_metrics()
    names = list(means)
    values = torch.stack([means[n][0] for n in names]).tolist()
    return dict(zip(names, (float(v) for v in values), strict=True))


def trainer_device(trainer: Trainer) -> torch.device:
    """The device a trainer computes on."""
    device: torch.device = getattr(trainer, "device", torch.device("cpu"))
    return device


def _mean_metrics(pending: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    # One host sync per log interval: stack each metric's tensors, then a single .tolist().
    if not pending:
        return {}
    names = list(pending[0])
    stacked = torch.stack([torch.stack([m[n].float() for n in names]) for m in pending])
    means = stacked.mean(0).tolist()
    return dict(zip(names, (float(v) for v in means), strict=True))
