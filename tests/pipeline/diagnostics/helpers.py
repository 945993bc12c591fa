"""What the diagnostics tests share: the hopper test dataset's checkpoints and made-up data."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from offaug.algorithms import registry
from offaug.algorithms.base import save_checkpoint, spaces_from_transitions
from offaug.datasets import Transitions, write_shard_set
from offaug.pipeline import diagnostics as diag
from offaug.pipeline.contracts import AugmentedRef, DatasetRef, ModelRef
from offaug.pipeline.schema.run_sections import DiagnosticsModel

# Small sizes; the hopper test dataset has ~800 rows, all used.
FAST = diag.DiagnosticsSettings(evaluation_episodes=2, fqe_steps=50, scatter_points=50)
NOISE_CLIP = 1e4
CONFIG = DiagnosticsModel(k=5, quantile=0.95, gamma=0.99, max_states=2000)


@dataclasses.dataclass(frozen=True)
class Hopper:
    """The hopper test dataset, its record, and untrained checkpoints made from it."""

    data: Transitions
    ref: DatasetRef
    bc: ModelRef
    critic: ModelRef | None
    """A CQL checkpoint (None when the registry has no ``cql``)."""
    root: Path


def checkpoint(name: str, data: Transitions, path: Path, config: dict[str, Any]) -> ModelRef:
    """An untrained learner saved as a checkpoint: enough for every diagnostic."""
    spaces = spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)
    trainer = registry.build(name, spaces, config, device="cpu")
    save_checkpoint(
        path, algorithm=name, config=trainer.config, spaces=spaces, state=trainer.state_dict()
    )
    return ModelRef(name=path.parent.name, path=str(path), checksum="", metrics={})


def augmented_ref(transitions: Transitions, directory: Path, **params: Any) -> AugmentedRef:
    shard_set = write_shard_set(
        transitions, directory, rows_per_shard=max(1, len(transitions) // 2), params=params
    )
    return AugmentedRef(
        directory=shard_set.directory,
        rows=shard_set.rows,
        episodes=shard_set.episodes,
        shards=len(shard_set.shards),
        manifest_checksum="",
        weight_stats={},
        faults=0,
    )


def plain_copy(data: Transitions) -> Transitions:
    """The original rows as augmented data: every weight exactly 1, no log-probabilities."""
    return Transitions(
        observations=np.array(data.observations),
        actions=np.array(data.actions),
        rewards=np.array(data.rewards),
        next_observations=np.array(data.next_observations),
        terminals=np.array(data.terminals),
        timeouts=np.array(data.timeouts),
        episode_ids=np.array(data.episode_ids),
        importance_weight=np.ones(len(data), dtype=np.float32),
        meta=dict(data.meta),
    )


def noise_copy(data: Transitions, seed: int = 0) -> Transitions:
    """Pure noise: states uniform far outside the data, random actions, log-normal weights."""
    rng = np.random.default_rng(seed)
    n = len(data)
    scale = np.abs(np.asarray(data.observations)).max()
    observations = rng.uniform(5 * scale, 50 * scale, size=data.observations.shape)
    signs = rng.choice([-1.0, 1.0], size=observations.shape)
    observations = (observations * signs).astype(np.float32)
    log_ratio = rng.normal(0.0, 4.0, size=n)
    return Transitions(
        observations=observations,
        actions=rng.uniform(-1, 1, size=data.actions.shape).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32),
        next_observations=observations,
        terminals=np.array(data.terminals),
        timeouts=np.array(data.timeouts),
        episode_ids=np.array(data.episode_ids),
        rollout_log_prob=np.zeros(n, dtype=np.float32),
        behaviour_log_prob=log_ratio.astype(np.float32),
        importance_weight=np.exp(np.minimum(log_ratio, math.log(NOISE_CLIP))).astype(np.float32),
        meta=dict(data.meta),
    )
