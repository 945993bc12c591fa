"""The diagnostics schema, per-policy part: evaluation episodes, OPE, ranking (TypedDicts).

The rest of the document is in :mod:`offaug.pipeline.diagnostics.schema`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # schema imports this module: the two names are for the type checker
    from offaug.pipeline.diagnostics.schema import PolicyDivergence, ValueEntry

SCHEMA_VERSION = 1
"""Version of the :class:`Diagnostics` layout."""
QUANTILE_LEVELS: tuple[float, ...] = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
"""Quantile levels of every ``quantiles`` entry."""


# -- shared pieces --------------------------------------------------------------------------------


class EpisodeRecords(TypedDict):
    """Evaluation episodes of one policy."""

    returns: list[float]
    """Undiscounted return per episode."""
    lengths: list[int]
    """Steps per episode."""
    discounted_returns: list[float]
    """Discounted return per episode."""
    successes: list[bool]
    """``info["success"]`` at the last step, else "ran to the time limit"."""
    mean_return: float | None
    """Mean return (None without episodes)."""
    mean_discounted_return: float | None
    """Mean discounted return."""
    mean_length: float | None
    """Mean length."""
    success_rate: float | None
    """Share of successful episodes."""


class EvaluationEntry(EpisodeRecords):
    """``evaluation[model]``: fresh episodes of a trained policy from fixed reset seeds."""

    normalised_score: float | None
    """D4RL-normalised mean return (None without reference scores)."""


class CheckpointEvaluation(EpisodeRecords):
    """:func:`evaluate_checkpoint`'s result."""

    name: str
    """The checkpoint path."""
    path: str
    """The checkpoint path."""


class OpeEntry(TypedDict):
    """``ope[model]``: off-policy estimates of the policy's value against the truth."""

    fqe: float
    """Fitted-Q evaluation from the dataset's episode starts."""
    wpdis: float | None
    """Weighted per-decision importance sampling."""
    wpdis_ess_fraction: float | None
    """ESS / episodes of WPDIS's final weights."""
    true_discounted_return: float | None
    """Mean discounted return of the evaluation episodes (None without an environment)."""
    fqe_error: float | None
    """FQE minus the truth."""
    wpdis_error: float | None
    """WPDIS minus the truth."""


class OpeSettings(TypedDict):
    """``ope["settings"]``: how the estimates were made."""

    target_sigma: float
    """Std of the Gaussian standing in for a deterministic policy."""
    target_epsilon: float
    """Epsilon standing in for a discrete greedy policy."""
    fqe_steps: int
    """Adam steps of FQE."""
    fqe_tau: float
    """Polyak rate of FQE's target."""
    episodes: int
    """Dataset episodes in the shared sample."""
    transitions: int
    """Rows in the shared sample."""
    evaluation_max_length: int | None
    """Longest evaluation episode (FQE reads high against episodes cut by a time limit)."""


class WpdisResult(TypedDict):
    """:func:`weighted_per_decision_is`'s result."""

    estimate: float | None
    """The estimate (None without rows)."""
    episodes: int
    """Episodes used."""
    ess_fraction: float | None
    """ESS / episodes of the final weights."""


RankBy = TypedDict("RankBy", {"return": int, "success": int, "length": int})
"""A policy's rank on each criterion alone (1 is best; ties share the best rank)."""


class WeightedRanking(TypedDict):
    """A policy's weighted score (see :mod:`offaug.pipeline.rank_metric` and
    :func:`~offaug.pipeline.diagnostics.ranking.weighted_scores`)."""

    metric: str
    """The weighting, normalised: e.g. ``return:0.6,success:0.3,length:0.1``."""
    score: float
    """Mean over start states of the weighted sum of the episode's scaled metrics (0 to 1)."""
    low: float
    """Lower end of the 95 % bootstrap interval (start states resampled)."""
    high: float
    """Upper end of that interval."""
    scaled_means: dict[str, float]
    """Each metric's mean on the common scale (0 worst to 1 best episode of any candidate)."""


class RankingEntry(TypedDict):
    """One entry of ``ranking``, best first."""

    name: Any
    """The policy's name (a checkpoint path for :func:`rank_checkpoints`)."""
    path: Any
    """Its checkpoint path, when known."""
    rank: int
    """1 is best: by the weighted score when there is one, else by mean return, then success
    rate, then length."""
    mean_return: Any
    """Mean return of its evaluation episodes."""
    mean_length: Any
    """Their mean length."""
    success_rate: Any
    """Their success rate."""
    rank_by: RankBy
    """Its rank on each criterion alone."""
    weighted: WeightedRanking | None
    """Its weighted score when ranked by a weighting (then ``rank`` follows it), else None."""


# -- a policy's part and the whole document -------------------------------------------------------


class PolicyPart(TypedDict):
    """:func:`diagnose_policy`'s result: one trained policy's checks, merged into the document."""

    name: str
    """The model's name."""
    divergence: PolicyDivergence
    """Its ``divergence.policies`` entry."""
    evaluation: EvaluationEntry | None
    """Its ``evaluation`` entry (None without an environment)."""
    value: ValueEntry | None
    """Its ``value`` entry (None without ``q_values``)."""
    ope: OpeEntry | None
    """Its ``ope`` entry (None without sampled rows)."""
    evaluation_max_length: int | None
    """Its longest evaluation episode."""
    seconds: float
    """Time taken."""
