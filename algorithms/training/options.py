"""How a training run is driven (:class:`TrainOptions`) and what it leaves behind
(:class:`TrainResult`); the learner's own hyperparameters are its config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from offaug.algorithms.evaluate import EvaluationResult
from offaug.algorithms.names import Weighting
from offaug.algorithms.training.state_noise import StateNoise

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
