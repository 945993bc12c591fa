"""What pipeline stages hand each other, and the run's index of them: small references, no arrays.

Every stage takes and returns these (or JSON-ready dicts): a dataset's identity and shape
(:class:`DatasetRef`), a checkpoint (:class:`ModelRef`), an augmented shard set
(:class:`AugmentedRef`), one rollout task's shard (:class:`RolloutShard`, with its filter's
:class:`FilterRecord`); :class:`RunIndex` says which stage holds which (learner, recipe, seed)
run. :data:`PLAIN` names the arm trained on the original data alone. Every sub-package of
:mod:`offaug.pipeline` may import this module; it imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NotRequired, TypedDict

from offaug.datasets.shards import ShardRef

PLAIN = "plain"
"""The recipe name of the arm trained on the original data alone (the baseline)."""
BASELINE = "baseline"
"""Recipe names of plain runs at another gradient-step budget: ``baseline[STEPS]``
(:func:`baseline_recipe`), e.g. the plain arm an augmented arm is judged against at equal total
gradient steps, or a rollout policy trained for ``rollout.policy_steps``."""
VIDEO_STAGE_PREFIX = "video:"
"""Stage names of the report's media: ``video:<model>`` per trained policy and ``video:data``."""
DATA_VIDEO_STAGE = "video:data"
BEST_VIDEO_STAGE = "video:best"
"""The stage that films the study's best policy (``report.best_video``) for the report's top."""
DOCTOR_STAGE = "doctor"
"""The dataset doctor's stage."""
STAGE_KEY_CONTEXT = "stage_key"
"""The serialisation context flag of the dump a stage key hashes: a workflow section leaves out of
that dump the fields that say only how stages are grouped, never what one computes."""
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
class FilterRecord:
    """What a filter against the policy's own reference (``rollout.filter: policy`` or
    ``value``) compared: one entry per episode rolled out, kept and dropped, in order."""

    scores: tuple[float, ...]
    """What was judged: the episode's return (``policy``), or its discounted return plus
    ``gamma^L V(s_L)`` (``value``)."""
    references: tuple[float, ...]
    """What it had to beat: the noiseless policy's return from the same start (``policy``),
    or the data's discounted return-to-go from the start row (``value``)."""
    kept: tuple[bool, ...]
    reset_seeds: tuple[int, ...]
    """The seed of the episode's ``env.reset`` (its reference reset with the same)."""
    start_rows: tuple[int, ...]
    """The dataset row the episode branched from (-1: it started at the reset)."""


@dataclasses.dataclass(frozen=True)
class RolloutShard:
    """What a rollout task produced: a shard reference and its statistics."""

    shard: ShardRef
    weight_stats: dict[str, float]
    faults: int
    episode_returns: tuple[float, ...]
    episodes_dropped: int = 0
    """Episodes the filter dropped (``episode_returns`` holds the kept ones)."""
    filter_record: FilterRecord | None = None
    """Each episode's score and reference under ``filter: policy`` or ``value`` (else None)."""
    seconds: float = 0.0
    """Wall seconds the task took to make its rows (recorded by the diffusion backend)."""
    simulator_steps: int = 0
    """Environment steps the task took (dropped episodes included; 0 for model rollouts)."""


def baseline_recipe(steps: int) -> str:
    """The recipe name of a plain run trained for ``steps`` gradient steps (not the workflow's)."""
    return f"{BASELINE}[{steps}]"


def is_plain(recipe: str) -> bool:
    """Whether ``recipe`` names a run on the original data alone (:data:`PLAIN`, or a plain
    run at another step budget)."""
    return recipe == PLAIN or (recipe.startswith(f"{BASELINE}[") and recipe.endswith("]"))


class RunEntry(TypedDict):
    """Where one (learner, recipe, seed) run's result is."""

    learner: str
    recipe: str
    seed: int
    stage: str
    """The train stage (shared by recipes that train alike)."""
    label: str
    """Its key under ``training`` in metrics.json: ``LEARNER-RECIPE`` (+ ``@sSEED``)."""
    steps: NotRequired[int]
    """Total gradient steps behind the run: its own and those of every model its training
    depends on (the BC clone and learners whose rollouts it trains on, every round, a dynamics
    ensemble, the plain run it continues from), each counted once."""
    own_steps: NotRequired[int]
    """The run's own gradient steps (``train.steps``)."""
    rollouts: NotRequired[list[str]]
    """The rollout stages (merges, every round) whose data its training depends on."""


class RecipeStages(TypedDict):
    """One recipe's stages, each by seed (as a string: JSON keys)."""

    weighting: str
    """How its augmented rows are weighted: none, behaviour or policy."""
    policy: str
    """Its rollout policy: bc, the learner whose plain run rolls out, or none (backend
    diffusion generates its rows without a policy)."""
    bc: dict[str, str]
    rollout: dict[str, str]
    diagnose: dict[str, str]
    policy_models: NotRequired[dict[str, str]]
    """The train stage whose policy the last round rolled out, where it is not the learner's
    plain run: a retrained policy (rollout rounds) or one trained for ``rollout.policy_steps``."""


class RunIndex(TypedDict):
    """Which stage holds what, for :func:`summarise`."""

    primary_seed: int
    seeds: list[int]
    runs: list[RunEntry]
    recipes: dict[str, RecipeStages]
