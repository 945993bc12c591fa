"""Fused and single-seed runs side by side, and how closely they must agree.

Shared by the fused-training test files. A member agrees with its single-seed run to
:data:`TOLERANCE` relative, not bit for bit: the fused members' layers run as batched matrix
multiplies (``bmm`` over the member axis), which round differently from the single run's
``addmm``, and the Adam step is the fused trainer's own (same formula, other rounding). Adam's
moments follow the latest gradients, which a rounding-level difference moves more (a ReLU input
or a minimum over critics that flips between the two runs), so they are held to
:data:`MOMENT_TOLERANCE`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offaug.algorithms.base import Trainer
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fused.trainer import FusedTrainer
from offaug.algorithms.training.fused_loop import build_members
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import Transitions
from offaug.datasets.sampler import stack_numpy

SMALL: dict[str, dict[str, Any]] = {
    "bc": {"hidden": [32, 32], "batch_size": 32},
    "td3bc": {"hidden": [32, 32], "batch_size": 32},
    "iql": {"hidden": [32, 32], "batch_size": 32, "actor_lr_decay_steps": 30},
    "rebrac": {"hidden": [32, 32], "batch_size": 32},
    "cql": {"hidden": [32, 32], "batch_size": 32, "n_action_samples": 4},
    "bcq": {
        "actor_hidden": [32, 32],
        "critic_hidden": [32, 32],
        "vae_hidden": [32, 32],
        "batch_size": 32,
        "n_action_samples": 4,
    },
    "discrete_cql": {"hidden": [32, 32], "batch_size": 32, "target_update_interval": 5},
    "discrete_bcq": {"hidden": [32, 32], "batch_size": 32, "target_update_interval": 5},
}
TOLERANCE = 1e-5
MOMENT_TOLERANCE = 1e-2


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_states_close(fused: Any, single: Any, path: str = "") -> None:
    """Every tensor of two state dicts within :data:`TOLERANCE` relative; the rest equal."""
    if isinstance(single, torch.Tensor):
        assert fused.shape == single.shape, path
        tolerance = MOMENT_TOLERANCE if "optimizer/state" in path else TOLERANCE
        assert relative(fused, single) <= tolerance, (path, relative(fused, single))
    elif isinstance(single, dict):
        assert fused.keys() == single.keys(), path
        for key in single:
            assert_states_close(fused[key], single[key], f"{path}/{key}")
    elif isinstance(single, float):
        assert fused == pytest.approx(single, rel=TOLERANCE), path
    elif isinstance(single, list | tuple):
        assert len(fused) == len(single), path
        for i, (x, y) in enumerate(zip(fused, single, strict=True)):
            assert_states_close(x, y, f"{path}[{i}]")
    else:
        assert fused == single, path


def parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.state_dict()
    return {
        f"{name}.{key}": value.clone()
        for name, part in state.items()
        if isinstance(part, dict) and "optimizer" not in name and name != "actor_metrics"
        for key, value in part.items()
    }


def fused_and_single_runs(
    algorithm: str,
    sources: list[list[Transitions]],
    configs: list[dict[str, Any]],
    steps: int,
    looped: bool | None = None,
    stacked: bool | None = None,
    options: TrainOptions | None = None,
) -> tuple[FusedTrainer, list[Trainer], dict[str, torch.Tensor]]:
    """``steps`` fused updates of one member per (sources, config), seeds 0, 1, ..., and each
    member's single-seed run on the same batches (each run built right before it trains, so
    it draws its noise from the global generator as ``train`` would); the last fused metrics."""
    seeds = tuple(range(len(configs)))
    options = options or TrainOptions()
    built = build_members(algorithm, sources, seeds, configs, options)
    fused = FusedTrainer(built.trainers, built.generators, seeds, looped=looped, stacked=stacked)
    batches = [[s.sample() for s in built.samplers] for _ in range(steps)]
    metrics: dict[str, torch.Tensor] = {}
    for step in batches:
        metrics = fused.update(TorchBatch.from_batch(stack_numpy(step)))
    singles = []
    for k, seed in enumerate(seeds):
        single = build_members(algorithm, sources[k], (seed,), configs[k : k + 1], options)
        for step in batches:
            single.trainers[0].update(TorchBatch.from_batch(step[k]))
        singles.append(single.trainers[0])
    return fused, singles, metrics


def assert_members_match(
    fused: FusedTrainer, singles: list[Trainer], metrics: dict[str, torch.Tensor]
) -> None:
    """No member frozen, one value per member in every metric, and each member's state that of
    its single-seed run."""
    assert fused.frozen == []
    assert all(value.shape == (len(singles),) for value in metrics.values())
    for k, single in enumerate(singles):
        assert_states_close(fused.member_state_dict(k), single.state_dict())
