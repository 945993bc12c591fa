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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import (
    PolicyDensity,
    Spaces,
    Trainer,
    config_to_json,
    load_checkpoint,
    reads_sources,
    save_checkpoint,
    spaces_from_transitions,
)
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.evaluate import EvaluationResult, evaluate, make_env, reference_scores
from offaug.algorithms.fused.trainer import member_generator
from offaug.algorithms.names import Weighting
from offaug.algorithms.runtime import configure_torch, seed_everything
from offaug.algorithms.training.compiling import compile_trainer
from offaug.algorithms.training.graphed import GraphedUpdates, StepMode, graphed_updates
from offaug.algorithms.training.state_noise import StateNoise, StateNoiser, observation_std
from offaug.algorithms.training.weighting import (
    DEFAULT_MAX_WEIGHT,
    PolicyWeights,
    WeightUsage,
)
from offaug.datasets.atomic import write_bytes_atomic, write_json_atomic
from offaug.datasets.sampler import MixtureSampler
from offaug.datasets.shards import ShardSet, is_shard_set
from offaug.datasets.sources import load_transitions
from offaug.datasets.transitions import Transitions

CompileStep = Literal["auto", "on", "off"]
"""Whether training takes the graph-safe step (:attr:`TrainOptions.compile_step`)."""

GRAPH_STEP_LEARNERS = frozenset({"bc", "td3bc", "iql", "rebrac", "cql", "bcq"})
"""Learners whose update runs as the graph-safe step (continuous actions)."""

CPU_COMPILED_STEP: Mapping[str, int] = {"iql": 256, "td3bc": 256, "cql": 64}
"""Learners whose compiled step ``compile_step: auto`` takes on a CPU, and the widest hidden
layer at which it does: where ``benchmarks/bench_algorithms.py --only compiled_step`` measured a
gain (records ``train_*_compiled_step_*``): IQL and TD3+BC at 64x64 and 256x256, CQL at 64x64
only (at 256x256 its step is as fast compiled as not)."""

CPU_COMPILED_STEP_MIN_STEPS = 100_000
"""The shortest run ``auto`` compiles on a CPU: compiling takes a minute or more there, which a
small network's faster steps repay only after tens of thousands of steps."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How a training run is driven (the learner's own hyperparameters are its config)."""

    steps: int = 10_000
    """Gradient steps in total (a resumed run continues up to this number)."""
    seed: int = 0
    """Seed of initialisation, sampling and evaluation."""
    mixing: tuple[float, ...] | None = None
    """Share of each source in every batch; None samples all rows uniformly."""
    weighting: Weighting = "none"
    """How rows are weighted in the losses: ``none``, ``behaviour`` (the stored
    ``importance_weight``) or ``policy`` (pi_theta/mu from the learner's current policy;
    learners with a policy density only). See :mod:`offaug.algorithms.training.weighting`."""
    normalise_weights: bool = True
    """Normalise the weights within each source in every batch (so the mixing ratio holds);
    False uses them as they are, original rows at 1."""
    max_weight: float | None = None
    """Clip pi/mu here (``policy``); None: each source's recorded ``max_weight``."""
    state_noise: StateNoise | None = None
    """S4RL noise on observations and next observations (None: off)."""
    log_every: int = 1000
    """Steps between metric lines."""
    eval_every: int = 5000
    """Steps between evaluations (0 disables them)."""
    eval_episodes: int = 5
    """Episodes per evaluation (0 disables them)."""
    env_id: str | None = None
    """Evaluate in this env instead of the one the dataset records (unused without
    evaluations: training itself needs no environment)."""
    checkpoint_every: int = 5000
    """Steps between checkpoints (the last step always writes one)."""
    device: str | None = None
    """Torch device; default CUDA when present, else CPU."""
    threads: int | None = None
    """Torch CPU threads (1 inside Dask workers)."""
    compile: bool = False
    """``torch.compile`` the learner's parts where it pays (Gaussian BC's loss, after a few
    seconds of compiling; figures in ``benchmarks/RESULTS.md``); other learners train as without
    it."""
    compile_step: CompileStep = "auto"
    """The graph-safe step (:mod:`offaug.algorithms.training.graphed`): ``on`` trains with it
    (captured in CUDA graphs on a GPU, compiled on a CPU), ``off`` with the learner's own
    ``update``; ``auto`` where it was measured to pay (every learner it serves on a GPU; on a
    CPU, small networks in long runs: :data:`CPU_COMPILED_STEP`). Weighted runs, runs with
    state noise and ``compile`` runs train without it."""
    steps_per_call: int = 4
    """Steps captured in one CUDA graph (the graph-safe step, on a GPU)."""
    seeds: tuple[int, ...] | None = None
    """Several seeds trained together as one fused run
    (:func:`offaug.algorithms.training.fused_loop.train_fused`, each into its own run directory);
    ``seed`` is then unused."""
    init_checkpoint: str | None = None
    """Start the learner from this checkpoint's weights (of the same algorithm and spaces),
    then train ``steps`` steps: a continuation on other data, counted from 0 (its sampler,
    generators and data statistics are this run's own, but a learner that normalises by its
    data's statistics keeps the checkpoint's, which its networks learnt with)."""

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates its policy, and so needs an environment."""
        return self.eval_every > 0 and self.eval_episodes > 0


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a finished run left behind."""

    out: Path
    steps: int
    last_evaluation: EvaluationResult | None
    checkpoint: Path
    weight_ess_fraction: float | None = None
    """ESS/N over every weighted row training used (None when unweighted)."""


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


class BatchPreparation:
    """What happens to a sampled batch before ``update``: conversion to torch, policy weights,
    counting the weights used, state noise (in that order: pi/mu belongs to the clean state)."""

    def __init__(
        self,
        trainer: Trainer,
        sampler: MixtureSampler,
        datasets: Sequence[Transitions | ShardSet],
        options: TrainOptions,
        device: torch.device,
    ) -> None:
        self.device = device
        self.policy_weights: PolicyWeights | None = None
        self.usage: WeightUsage | None = None
        if options.weighting == "policy":
            if not isinstance(trainer, PolicyDensity):
                raise ValueError(f"{type(trainer).__name__} has no policy_log_prob")
            max_weights = [_max_weight(d, options.max_weight) for d in datasets]
            self.policy_weights = PolicyWeights(
                trainer, max_weights, device, normalise=options.normalise_weights
            )
            self.usage = WeightUsage(sampler.sets_with_log_probs, device)
        elif options.weighting == "behaviour":
            self.usage = WeightUsage(sampler.weighted_sets, device)
        self.with_sources = self.usage is not None or reads_sources(trainer)
        self.noiser: StateNoiser | None = None
        if options.state_noise is not None:
            std = observation_std(_parts(datasets[0]))
            self.noiser = StateNoiser(options.state_noise, std, device, options.seed)

    def __call__(self, sampler: MixtureSampler) -> TorchBatch:
        batch = TorchBatch.from_batch(sampler.sample(), self.device, with_sources=self.with_sources)
        clipped = None
        if self.policy_weights is not None:
            batch, clipped = self.policy_weights(batch)
        if self.usage is not None:
            assert batch.set_index is not None  # converted with_sources
            self.usage.add(batch.weights, batch.set_index, clipped)
        if self.noiser is not None:
            batch = self.noiser(batch)
        return batch

    def flush_metrics(self) -> dict[str, float]:
        """The weights' figures since the last call (one host sync)."""
        if self.usage is None:
            return {}
        return self.usage.flush(clipping=self.policy_weights is not None)


def _max_weight(data: Transitions | ShardSet, override: float | None) -> float:
    if override is not None:
        return override
    recorded = data.params.get("max_weight") if isinstance(data, ShardSet) else None
    return float(recorded) if recorded is not None else DEFAULT_MAX_WEIGHT


def _parts(data: Transitions | ShardSet) -> Iterable[Transitions]:
    return data.iter_shards() if isinstance(data, ShardSet) else [data]


def make_sampler(
    trainer: Trainer,
    sets: Sequence[Transitions | ShardSet],
    *,
    mixing: Sequence[float] | None = None,
    use_weights: bool = False,
    normalise_weights: bool = True,
    rollout_log_prob: bool = False,
    seed: int = 0,
) -> MixtureSampler:
    """The sampler ``trainer`` trains from, with the trainer prepared on its data.

    Batches carry ``next_actions`` for a trainer that ``uses_next_actions`` (ReBRAC); a trainer
    with ``prepare(sampler)`` (TD3+BC, ReBRAC, IQL) takes its data statistics from it here. A
    resumed run then loads the statistics its checkpoint stored.
    """
    sampler = MixtureSampler(
        sets,
        trainer.config.batch_size,
        mixing=mixing,
        use_weights=use_weights,
        normalise_weights=normalise_weights,
        rollout_log_prob=rollout_log_prob,
        seed=seed,
        next_actions=bool(getattr(trainer, "uses_next_actions", False)),
    )
    prepare = getattr(trainer, "prepare", None)
    if callable(prepare):
        prepare(sampler)
    return sampler


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


def write_checkpoint(
    trainer: Trainer,
    sampler: MixtureSampler,
    prepare: BatchPreparation,
    algorithm: str,
    config: Any,
    spaces: Spaces,
    step: int,
    run_dir: Path,
    torch_rng: torch.Tensor | None = None,
) -> None:
    """Write ``run_dir/checkpoints/step_<step>.pt`` and copy it to ``run_dir/checkpoint.pt``.

    Beside the trainer's state it records what a resumed run needs to continue as if never
    stopped: the sampler's and the state noise's generators, the weights used so far, and
    ``torch_rng`` (default torch's global generator state).
    """
    extra: dict[str, Any] = {
        "step": step,
        "sampler_rng": sampler.rng_state(),
    }
    rng = torch.get_rng_state() if torch_rng is None else torch_rng
    state = {**trainer.state_dict(), "torch_rng": rng}
    if prepare.usage is not None:
        extra["weight_usage"] = prepare.usage.run_totals
    if prepare.noiser is not None:
        state[_STATE_NOISE_RNG] = prepare.noiser.get_state()
    path = save_checkpoint(
        run_dir / "checkpoints" / f"step_{step}.pt",
        algorithm=algorithm,
        config=config,
        spaces=spaces,
        state=state,
        extra=extra,
    )
    # The latest checkpoint is a copy under a fixed name, replaced atomically.
    write_bytes_atomic(run_dir / "checkpoint.pt", path.read_bytes())


_STATE_NOISE_RNG = "state_noise_rng"
"""Checkpoint state key of the state-noise generator (beside ``torch_rng``, not the learner's)."""


def resume_from_checkpoint(
    trainer: Trainer,
    sampler: MixtureSampler,
    prepare: BatchPreparation,
    path: Path,
    algorithm: str,
) -> int:
    """Restore what :func:`write_checkpoint` wrote at ``path``; return the step it was at."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != algorithm:
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint cannot resume {algorithm}")
    state = dict(checkpoint.state)
    torch.set_rng_state(state.pop("torch_rng"))
    noise_state = state.pop(_STATE_NOISE_RNG, None)
    if prepare.noiser is not None and noise_state is not None:
        prepare.noiser.set_state(noise_state)
    trainer.load_state_dict(state)
    sampler.set_rng_state(checkpoint.extra["sampler_rng"])
    if prepare.usage is not None and "weight_usage" in checkpoint.extra:
        prepare.usage.run_totals = [float(x) for x in checkpoint.extra["weight_usage"]]
    return int(checkpoint.extra["step"])


def load_weights(trainer: Trainer, path: str | os.PathLike[str], algorithm: str) -> None:
    """Load the learner state of the checkpoint at ``path`` into ``trainer`` (not the
    generators a resumed run restores: the run that starts from it draws its own)."""
    checkpoint = load_checkpoint(path)
    if checkpoint.algorithm != algorithm:
        raise ValueError(f"{path}: a {checkpoint.algorithm} checkpoint cannot start {algorithm}")
    trainer.load_state_dict(_learner_state(checkpoint.state))


def _learner_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in ("torch_rng", _STATE_NOISE_RNG)}


def load_trainer(path: str | os.PathLike[str], *, device: str | None = None) -> Trainer:
    """A trainer restored from a checkpoint (for ``act`` and ``log_prob``)."""
    checkpoint = load_checkpoint(path)
    trainer = registry.build(
        checkpoint.algorithm, checkpoint.spaces, checkpoint.config, device=device
    )
    trainer.load_state_dict(_learner_state(checkpoint.state))
    return trainer
