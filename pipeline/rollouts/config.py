"""What a rollout takes and gives back, for the simulator's (:mod:`.simulator`) and the learned
dynamics' (:mod:`.dynamics`) alike: :class:`RolloutConfig`, :class:`RolloutResult` with its
:class:`Fault` records, and :class:`RolloutError` for a rollout that cannot go on."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from offaug.datasets.transitions import Transitions
from offaug.pipeline.contracts import FilterRecord
from offaug.pipeline.rollouts.data import (
    FilterKind,
    StartsKind,
)
from offaug.pipeline.rollouts.noise import DEFAULT_NOISE, NoiseSpec

StartKind = Literal["reset", "dataset"]


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """The rollout algorithm's search (:mod:`offaug.pipeline.rollouts.lookahead`): every
    ``window`` steps, ``candidates`` continuations are simulated from the same state (the
    noiseless policy and noisy windows followed by the policy) and the best is committed."""

    candidates: int = 8
    """Continuations compared at each decision point, the noiseless policy among them."""
    window: int = 10
    """Steps committed per decision; the noisy candidates perturb only these."""
    depth: int | None = None
    """Steps each continuation is simulated for, counted from the decision point (None: to the
    episode's end)."""
    bootstrap: bool = False
    """Score each continuation by its discounted return over the depth plus ``gamma^depth
    V(s_depth)`` of the rollout learner (no ``V`` after a termination or at the time limit)
    instead of its undiscounted return over the depth."""


class RolloutError(RuntimeError):
    """A rollout that cannot go on (a policy that outputs NaN, an env that never resets)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to roll a policy out."""

    episodes: int = 10
    """Episodes to collect in total (unless ``simulator_steps`` is set)."""
    simulator_steps: int | None = None
    """A budget of environment steps in place of ``episodes``: episodes start while budget is
    left, and those running when it is spent end there as truncated (None: ``episodes``)."""
    n_envs: int = 8
    """Environments stepped together (one batched policy call per step)."""
    noise: NoiseSpec = DEFAULT_NOISE
    """Parsed noise specification (see :mod:`offaug.pipeline.rollouts.noise`), in normalised
    units."""
    seed: int = 0
    """Seed of resets, noise and start-state choice."""
    max_weight: float = 100.0
    """Importance weights (and per-decision weights) are clipped at this value."""
    start: StartKind = "reset"
    """Where episodes start: environment resets, or branches from dataset states."""
    max_episode_steps: int | None = None
    """Override the environment's time limit."""
    horizon: int | None = None
    """End every episode as truncated after this many steps (None: at the time limit)."""
    starts: StartsKind = "uniform"
    """How dataset start states were weighted (the probabilities come with the states)."""
    filter: FilterKind = "none"
    """``data``: drop episodes that earn less than the data from the same start; ``policy``:
    those that do not beat the noiseless policy from the same start; ``value``: branches whose
    bootstrapped discounted return does not beat the data's from the same row."""
    filter_margin: float = 0.0
    """Reward per step an episode may fall short of its reference by and still be kept."""
    filter_tolerance: float = 0.0
    """Fraction of the reference's size an episode may fall short by and still be kept."""
    tries: int = 1
    """Episodes per start (the same reset seed, or the same dataset row), each with its own
    noise; of those the filter keeps, only the one of highest return stays (best of K)."""
    keep_reference: bool = False
    """``filter: policy`` with ``tries``: the first try of each start is the noiseless policy
    itself, its return the reference the others must beat, and it is kept where none does."""
    lookahead: Lookahead | None = None
    """Build each episode by the rollout algorithm's search instead of one noisy pass
    (:mod:`offaug.pipeline.rollouts.lookahead`); None: one noisy pass."""
    max_faults: int = 1000
    """Stop with an error after this many environment faults."""

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values, the noise as the text it was parsed from."""
        return {**dataclasses.asdict(self), "noise": self.noise.text}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One environment failure handled during a rollout."""

    kind: str
    message: str
    env_index: int
    step: int


@dataclasses.dataclass
class RolloutResult:
    """Collected transitions and what happened on the way."""

    transitions: Transitions
    faults: list[Fault]
    episode_returns: list[float]
    weight_stats: dict[str, float]
    bad_steps: list[dict[str, Any]]
    episodes_dropped: int = 0
    """Episodes the filter dropped (not in ``transitions`` or ``episode_returns``)."""
    filter_record: FilterRecord | None = None
    """Every episode's score and reference under ``filter: policy`` or ``value`` (else None)."""
    simulator_steps: int = 0
    """Environment steps taken (``env.step`` calls, failed ones and dropped episodes included)."""
