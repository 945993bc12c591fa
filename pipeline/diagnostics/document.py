"""The diagnostics' output, typed: what ``diagnostics.json`` (and ``metrics["diagnostics"]``) holds.

:class:`Diagnostics` is the whole document; each section is a TypedDict below, one documented
field each. Every number is written as a plain ``float`` or ``int`` (non-finite values as
``null``), every array as a list; a section that does not apply is ``null``.
"""

from __future__ import annotations

from typing import Any, TypedDict

from offaug.pipeline.diagnostics.policy_document import (
    DivergenceSection,
    EvaluationEntry,
    RankingEntry,
    ValueEntry,
)
from offaug.pipeline.diagnostics.quality_document import QualityReport

SCHEMA_VERSION = 1
"""Version of the :class:`Diagnostics` layout."""
QUANTILE_LEVELS: tuple[float, ...] = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
"""Quantile levels of every ``quantiles`` entry."""


# -- shared pieces --------------------------------------------------------------------------------


class Quantiles(TypedDict):
    """Quantiles of one series."""

    levels: list[float]
    """:data:`QUANTILE_LEVELS`."""
    values: list[float]
    """The series' quantile at each level (empty for no data)."""


class PairedHistogram(TypedDict):
    """Counts of the original and the augmented series over one set of edges."""

    edges: list[float]
    """``bins + 1`` bin edges shared by both series."""
    original: list[int] | None
    """Counts of the original series."""
    augmented: list[int] | None
    """Counts of the augmented series (None without augmented data)."""


# -- data -----------------------------------------------------------------------------------------


class EpisodeLength(TypedDict):
    """Episode lengths in steps (None without episodes)."""

    mean: float | None
    """Mean length."""
    min: int | None
    """Shortest episode."""
    max: int | None
    """Longest episode."""


class ReturnSummary(TypedDict):
    """Undiscounted episode returns."""

    mean: float | None
    """Mean return (None without episodes)."""
    std: float | None
    """Standard deviation of the returns."""
    quantiles: Quantiles
    """Their quantiles."""


# ``return`` is a keyword, so this one is spelled functionally; the fields, in order:
# episodes, steps, reward mean and std (None without rows), terminal and timeout counts, episode
# lengths, and undiscounted episode returns.
DataSummary = TypedDict(
    "DataSummary",
    {
        "episodes": int,
        "steps": int,
        "reward_mean": float | None,
        "reward_std": float | None,
        "terminals": int,
        "timeouts": int,
        "episode_length": EpisodeLength,
        "return": ReturnSummary,
    },
)


class DataSection(TypedDict):
    """``data``: both datasets summarised."""

    gamma: float
    """The discount of every discounted quantity."""
    effective_horizon: float
    """``1 / (1 - gamma)`` steps."""
    original: DataSummary
    """The source dataset."""
    augmented: DataSummary | None
    """The augmented data (None without it)."""
    return_histogram: PairedHistogram
    """Undiscounted episode returns of both over shared edges."""


# -- importance weights ---------------------------------------------------------------------------


class WeightSummary(TypedDict):
    """Statistics of a set of importance weights."""

    n: int
    """Transitions."""
    ess: float
    """Effective sample size (sum w)^2 / sum w^2."""
    ess_fraction: float
    """ESS / N."""
    clipped_fraction: float | None
    """Share of raw beta_hat/mu above ``max_weight`` (None without log-probabilities or clip)."""
    mean: float | None
    """Mean stored (clipped) weight (None without rows)."""
    min: float | None
    """Smallest stored weight."""
    max: float | None
    """Largest stored weight."""


class ShardWeights(TypedDict):
    """One shard's weights."""

    shard: str
    """The shard's file name."""
    n: int
    """Its transitions."""
    ess: float
    """Its effective sample size."""
    ess_fraction: float
    """ESS / N."""
    clipped_fraction: float | None
    """As in :class:`WeightSummary`."""


class WeightHistogram(TypedDict):
    """Histogram of log10 w over the positive weights."""

    edges: list[float]
    """Bin edges (log10 w)."""
    counts: list[int]
    """Transitions per bin."""
    zeros: int
    """Weights exactly 0 (not in the bins)."""


class EpisodeWeights(TypedDict):
    """Per-episode cumulative weights prod_t beta_hat/mu = exp(cumulative log-ratio at the end)."""

    episodes: int
    """Episodes."""
    log_quantiles: Quantiles
    """Quantiles of the cumulative log-weight (natural log)."""
    quantiles: Quantiles
    """Quantiles of the cumulative weight (exp, capped at e^700)."""
    ess: float
    """Effective sample size over episodes."""
    ess_fraction: float
    """ESS / episodes."""


class WeightsSection(WeightSummary):
    """``weights`` (None without augmented data): the augmented data's importance weights."""

    present: bool
    """Whether every shard carries ``importance_weight`` (else the missing ones count as 1)."""
    weight_clip: float | None
    """The rollout's ``max_weight``, as its manifest records it."""
    per_shard: list[ShardWeights]
    """The same statistics per shard."""
    histogram: WeightHistogram
    """Histogram of the stored weights."""
    episodes: EpisodeWeights | None
    """Per-episode cumulative weights (None without log-probabilities)."""


# -- coverage -------------------------------------------------------------------------------------


class RangeViolation(TypedDict):
    """Augmented states outside the original's per-dimension [min, max]."""

    per_dimension: list[float]
    """Fraction outside, per state dimension."""
    any_dimension: float
    """Fraction outside in at least one dimension."""
    worst_dimension: int | None
    """The dimension with the largest fraction (None without states)."""
    worst_fraction: float
    """That fraction."""


class StateCounts(TypedDict):
    """States sampled from each dataset."""

    original: int
    """From the original data."""
    augmented: int
    """From the augmented data."""


class CoverageSection(TypedDict):
    """``coverage`` (None without augmented data): k-NN OOD score of augmented states.

    The score is the distance to the k-th nearest original state, in the state space
    standardised by the original sample's mean and std.
    """

    k: int
    """The neighbour whose distance is the score."""
    quantile: float
    """Quantile of the original states' own distances that sets the threshold."""
    threshold: float
    """That quantile of the original states' leave-one-out k-NN distances."""
    ood_fraction: float
    """Share of augmented states beyond the threshold (in-distribution: ~1 - quantile)."""
    states: StateCounts
    """States sampled from each side."""
    original_distances: Quantiles
    """Quantiles of the original states' leave-one-out distances."""
    augmented_distances: Quantiles
    """Quantiles of the augmented states' distances."""
    histogram: PairedHistogram
    """Both distance distributions over shared edges."""
    range_violation: RangeViolation
    """Augmented states outside the original's range (all rows, not the sample)."""


# -- evaluation, OPE, ranking ---------------------------------------------------------------------


class Diagnostics(TypedDict):
    """The whole document, as :func:`run_diagnostics` writes it."""

    schema_version: int
    """:data:`SCHEMA_VERSION`."""
    seed: int
    """Seed of every sample drawn."""
    config: dict[str, Any]
    """The workflow's ``diagnostics`` section (k, quantile, gamma, max_states)."""
    settings: dict[str, Any]
    """:class:`~offaug.pipeline.diagnostics.settings.DiagnosticsSettings` as a dict."""
    data: DataSection
    """Both datasets summarised."""
    weights: WeightsSection | None
    """Importance weights of the augmented data."""
    coverage: CoverageSection | None
    """OOD score of augmented states."""
    quality: dict[str, QualityReport] | None
    """The quality report of each augmented source by name: the rollout backend's
    (``simulator``, ``model``, ...) for the augmented shard set, ``state_noise`` for a noisy
    copy of the source when the recipe's learners trained with state noise (None: neither)."""
    divergence: DivergenceSection
    """Every policy against beta_hat."""
    evaluation: dict[str, EvaluationEntry] | None
    """Fresh episodes of each trained policy (None without an environment)."""
    ranking: list[RankingEntry] | None
    """The trained policies ranked, best first (None without an environment)."""
    value: dict[str, ValueEntry]
    """Value checks of every model whose trainer has ``q_values``."""
    ope: dict[str, Any]
    """``settings`` (:class:`OpeSettings`) plus one :class:`OpeEntry` per trained model."""
    timings: dict[str, float]
    """Seconds per section, and ``policy:<name>`` per policy."""
