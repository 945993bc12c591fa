"""A learner through the workflow's stages on a tiny real dataset: train, then diagnose.

Shared by the learner test files that check a learner works in workflows as CQL does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offaug.algorithms.base import Spaces, spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.datasets import MixtureSampler, Transitions, load_transitions
from offaug.pipeline.contracts import DatasetRef
from offaug.pipeline.schema.run_sections import DiagnosticsModel, EvaluationModel
from offaug.pipeline.schema.sections import BCConfigModel, TrainModel
from offaug.pipeline.stages.learning import diagnose_policy_stage, train_bc, train_offline


def train_and_diagnose(
    algorithm: str, config: dict[str, Any], dataset_id: str, out: Path
) -> dict[str, Any]:
    """Train ``algorithm`` for 10 steps with the workflow's stage and diagnose the policy."""
    data = load_transitions(dataset_id)
    ref = DatasetRef(dataset_id, len(data), data.num_episodes, "", False, dict(data.meta))
    bc = train_bc(ref, BCConfigModel(steps=10, hidden=(32, 32), batch_size=32), str(out / "bc"), 0)
    train_config = TrainModel(algorithms=(algorithm,), steps=10, configs={algorithm: config})
    model = train_offline(
        algorithm, ref, None, train_config, EvaluationModel(episodes=1), str(out / "train"), 0
    )
    return diagnose_policy_stage(ref, bc, model, DiagnosticsModel(max_states=200), 0, 0)


SMALL = {"hidden": (32, 32), "batch_size": 32}
"""Network and batch sizes that keep the new learners' tests fast."""


def spaces_of(data: Transitions) -> Spaces:
    """The learner spaces of a dataset."""
    return spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)


def sample_batches(
    data: Transitions, n: int, seed: int = 0, *, next_actions: bool = False
) -> list[TorchBatch]:
    """``n`` torch batches of 32 rows from ``data``."""
    sampler = MixtureSampler([data], 32, seed=seed, next_actions=next_actions)
    return [TorchBatch.from_batch(sampler.sample()) for _ in range(n)]
