"""What pipeline stages hand each other, and the run's index of them: small references, no arrays.

Every stage takes and returns these (or JSON-ready dicts): a dataset's identity and shape
(:class:`DatasetRef`), a checkpoint (:class:`ModelRef`), an augmented shard set
(:class:`AugmentedRef`), one rollout task's shard (:class:`RolloutShard`); :class:`RunIndex` says
which stage holds which (learner, recipe, seed) run. :data:`PLAIN` names the arm trained on the
original data alone. Every sub-package of :mod:`offaug.pipeline` may import this module; it
imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NotRequired, TypedDict

from offaug.datasets.shards import ShardRef

PLAIN = "plain"
"""The recipe name of the arm trained on the original data alone (the baseline)."""
VIDEO_STAGE_PREFIX = "video:"
"""Stage names of the report's media: ``video:<model>`` per trained policy and ``video:data``."""
DATA_VIDEO_STAGE = "video:data"
DOCTOR_STAGE = "doctor"
"""The dataset doctor's stage."""
REPORT_STAGE = "report"
"""The stage that writes metrics.json and report.html from every other stage's result."""


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """The source dataset, ready to load with ``load_transitions``."""

    source: str
    """Minari id, Minari directory or D4RL file, as the workflow names it."""
    rows: int
    episodes: int
    identity: str
    """Cache key of the source's content and loader options."""
    has_simulator_state: bool
    """Whether it records states to branch from (infos/qpos + infos/qvel, or infos/state)."""
    meta: dict[str, Any]
    """Spaces, env spec and reference scores."""


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A trained model's checkpoint."""

    name: str
    path: str
    checksum: str
    metrics: dict[str, Any]
    """Final training metrics and evaluation."""


@dataclasses.dataclass(frozen=True)
class AugmentedRef:
    """The augmented shard set."""

    directory: str
    rows: int
    episodes: int
    shards: int
    manifest_checksum: str
    weight_stats: dict[str, Any]
    faults: int
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The rollout's own figures: its policy, the filter's kept/dropped episodes, mean return."""


@dataclasses.dataclass(frozen=True)
class RolloutShard:
    """What a rollout task produced: a shard reference and its statistics."""

    shard: ShardRef
    weight_stats: dict[str, float]
    faults: int
    episode_returns: tuple[float, ...]
    episodes_dropped: int = 0
    """Episodes the filter dropped (``episode_returns`` holds the kept ones)."""


class RunEntry(TypedDict):
    """Where one (learner, recipe, seed) run's result is."""

    learner: str
    recipe: str
    seed: int
    stage: str
    """The train stage (shared by recipes that train alike)."""
    label: str
    """Its key under ``training`` in metrics.json: ``LEARNER-RECIPE`` (+ ``@sSEED``)."""


class RecipeStages(TypedDict):
    """One recipe's stages, each by seed (as a string: JSON keys)."""

    weighting: str
    """How its augmented rows are weighted: none, behaviour or policy."""
    policy: str
    """Its rollout policy: bc, or the learner whose plain run rolls out."""
    bc: dict[str, str]
    rollout: dict[str, str]
    diagnose: dict[str, str]
    policy_models: NotRequired[dict[str, str]]
    """With rollout rounds: the train stage whose policy the last round rolled out."""


class RunIndex(TypedDict):
    """Which stage holds what, for :func:`summarise`."""

    primary_seed: int
    seeds: list[int]
    runs: list[RunEntry]
    recipes: dict[str, RecipeStages]
