"""The quality report's output, typed: what ``offaug quality`` prints and the diagnostics'
``quality`` section holds (:func:`offaug.pipeline.diagnostics.quality.quality_report` makes it).

Every number is a plain ``float`` or ``int`` (non-finite values as ``null``); an entry that
cannot be computed is ``null``, and ``state.reason`` says why for the dynamics checks.
"""

from __future__ import annotations

from typing import Literal, TypedDict

StateSource = Literal["recorded", "rebuilt", "not available"]
"""Where the simulator state of an augmented row comes from for the dynamics checks."""


class StateCheck(TypedDict):
    """How the augmented rows were put back into the true environment."""

    kind: StateSource
    """``recorded``: the rows carry ``infos/qpos``/``infos/qvel`` or ``infos/state``;
    ``rebuilt``: from the observation (``offaug.pipeline.rollouts.env_state.rebuild_states``);
    ``not available``: neither (no dynamics, reward or terminal checks)."""
    reason: str | None
    """Why the state is not available (None when it is)."""
    env: str | None
    """The env id the rows were stepped in."""
    rows_checked: int
    """Augmented rows sampled and stepped."""
    rows_unset: int
    """Sampled rows whose set state did not give back the row's observation (left out of the
    errors: a state rebuilt wrongly, or an env unlike the data's)."""


class ErrorSummary(TypedDict):
    """A per-row error over the checked rows: its mean, median, 95th percentile and maximum."""

    mean: float
    median: float
    p95: float
    max: float


class RewardError(ErrorSummary):
    """``|r_env - r|`` per checked row, in the data's reward units."""

    relative: float | None
    """``mean`` over the source rewards' std (None for constant rewards)."""


class Novelty(TypedDict):
    """Distance of each augmented transition to its nearest source transition, in units of the
    source's own typical nearest-neighbour distance."""

    unit: float
    """The median distance of a source transition to its nearest other source transition
    (standardised (s, a, s') space): novelty 1 is as far as real transitions lie apart."""
    mean: float
    median: float
    p95: float
    max: float
    share_above_one: float
    """Share of augmented transitions farther from the data than the unit."""


class OODShare(TypedDict):
    """The coverage check's k-NN OOD score of the augmented states (``coverage.py``)."""

    share: float
    """Share of augmented states whose k-th neighbour distance exceeds the threshold."""
    k: int
    quantile: float
    threshold: float
    """The ``quantile`` of the source states' own leave-one-out k-NN distances."""


class Rates(TypedDict):
    """One share in both datasets."""

    augmented: float | None
    source: float | None


class EpisodeReturns(TypedDict):
    """Undiscounted episode returns of one dataset (None without episodes)."""

    episodes: int
    mean_return: float | None
    mean_length: float | None
    reward_per_step: float | None


class Returns(TypedDict):
    """Episode returns of augmented episodes against the data's."""

    reward: Literal["raw_reward", "rewards"]
    """The augmented column summed: a model rollout's unpenalised ``raw_reward`` where present."""
    augmented: EpisodeReturns
    source: EpisodeReturns


class QualityReport(TypedDict):
    """Augmented transitions checked against the source data and its environment."""

    rows: int
    """Augmented transitions."""
    source_rows: int
    """Source transitions."""
    state: StateCheck
    state_error: ErrorSummary | None
    """Per checked row, the RMS over dimensions of ``(o_env - o) / sigma``: the observation of
    the state the row was put into against the row's own. 0 where the env can be in the row's
    state; rows above ``QualitySettings.observation_tolerance`` are ``state.rows_unset``."""
    dynamics_error: ErrorSummary | None
    """Per checked row, the RMS over dimensions of ``(s'_env - s') / sigma``, with sigma each
    observation dimension's std over the source: 0 for transitions the env would make."""
    reward_error: RewardError | None
    terminal_mismatch: float | None
    """Share of checked rows whose terminal flag differs from the env's termination."""
    novelty: Novelty | None
    ood: OODShare | None
    terminal_rate: Rates
    """Share of rows that end by termination."""
    returns: Returns
