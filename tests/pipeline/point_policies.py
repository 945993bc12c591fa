"""Three real BC checkpoints of known quality on offaug/PointGoal-v0, and a run directory that
holds checkpoints, for ranking and review.

Each is a deterministic BC policy trained on states of the point test dataset, relabelled with
the actions of a hand-written controller: ``toward`` (step to the goal: the best), ``still``
(stand still) and ``away`` (step away from the goal: the worst). Reward is minus the distance
to the goal, so the order of mean returns is toward > still > away.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import Transitions, load_transitions
from offaug.pipeline.contracts import DatasetRef, ModelRef
from offaug.pipeline.engine.graph import StageRecords
from offaug.pipeline.rundir.run_layout import RunLayout

QUALITY_ORDER = ("toward", "still", "away")
"""Best first."""
_DIRECTION = {"toward": 1.0, "still": 0.0, "away": -1.0}


@dataclasses.dataclass(frozen=True)
class PointPolicies:
    """The three checkpoints and the data they learnt from."""

    checkpoints: dict[str, Path]
    """``name -> checkpoint.pt``, in :data:`QUALITY_ORDER`."""
    data: Transitions
    """The point test dataset (its ``meta`` names the env)."""


def relabelled(data: Transitions, direction: float) -> Transitions:
    """``data`` with the controller's actions: ``direction`` times the step to the goal."""
    # Flattened Dict observation, keys in order: achieved_goal, desired_goal, observation.
    observations = np.asarray(data.observations)
    step = observations[:, 2:4] - observations[:, 0:2]
    actions = np.clip(direction * step, -0.2, 0.2).astype(np.float32)
    return dataclasses.replace(data, actions=actions, extras={})


def train_point_policies(dataset_id: str, root: Path, steps: int = 400) -> PointPolicies:
    """Train the three policies under ``root/<name>`` (one CPU thread each, no evaluation)."""
    data = load_transitions(dataset_id)
    checkpoints = {}
    for name in QUALITY_ORDER:
        result = train(
            "bc",
            [relabelled(data, _DIRECTION[name])],
            root / name,
            config={"policy": "deterministic", "hidden": (32, 32), "batch_size": 128},
            options=TrainOptions(steps=steps, eval_every=0, log_every=steps, threads=1),
        )
        checkpoints[name] = result.checkpoint
    return PointPolicies(checkpoints, data)


def make_run(data: Transitions, models: dict[str, Path], root: Path) -> Path:
    """A run directory whose ``stages.json`` (written by the pipeline's own ``StageRecords``)
    names ``data``'s dataset as the source and ``models`` (``stage name -> checkpoint``, one of
    them ``bc``) as its models, each named after its checkpoint's folder."""
    root.mkdir(parents=True, exist_ok=True)
    records = StageRecords(RunLayout(root))
    source = DatasetRef(
        source=str(data.meta["dataset_id"]),
        rows=len(data),
        episodes=data.num_episodes,
        identity="test",
        has_simulator_state=False,
        meta=dict(data.meta),
    )
    records.record("source", "key", source, 0.0, None, [])
    for stage, path in models.items():
        model = ModelRef(name=path.parent.name, path=str(path), checksum="", metrics={})
        records.record(stage, "key", model, 0.0, None, [])
    return root
