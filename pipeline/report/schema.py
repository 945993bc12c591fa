"""What the report reads: ``metrics.json``, typed.

Every key is optional: a missing section is reported as missing rather than failing.
"""

from __future__ import annotations

from typing import Any, TypedDict

from offaug.pipeline.summary import RecipeSummary
from offaug.pipeline.verdict import ArmVerdict

# ``return`` is a keyword, so this one is spelled functionally: the final evaluation's mean
# return and its D4RL-normalised score (None without reference scores), the learner, recipe
# (``original`` for the plain baseline) and training seed, and the checkpoint's path.
TrainingResult = TypedDict(
    "TrainingResult",
    {
        "learner": str,
        "recipe": str,
        "seed": int,
        "return": float,
        "normalised_score": float | None,
        "checkpoint": str,
    },
    total=False,
)


class RolloutWeights(TypedDict, total=False):
    """The rollout's pooled importance-weight statistics
    (:func:`offaug.pipeline.rollout.weight_statistics`)."""

    n: int
    """Transitions."""
    ess: float
    """Effective sample size."""
    ess_fraction: float
    """ESS / N."""
    clipped_fraction: float
    """Share of raw weights above the clip."""
    max_weight: float
    """The clip."""
    mean_log_ratio: float
    """Mean log beta_hat/mu."""


class Metrics(TypedDict, total=False):
    """``metrics.json``: a run's metrics."""

    training: dict[str, TrainingResult]
    """One result per training run, named ``LEARNER-RECIPE`` (``cql-original``,
    ``cql-augmented``), with ``@sSEED`` for seeds other than the workflow's ``seed``."""
    seeds: list[int]
    """The training seeds."""
    recipes: dict[str, RecipeSummary]
    """Each augmentation recipe's weights, coverage and rewards, beside the verdict."""
    data_score: float | None
    """The normalised score of the data's own episodes (None without reference scores)."""
    verdict_score: str
    """What the verdict compares: ``normalised_score``, or ``return`` without reference scores."""
    verdict: list[ArmVerdict]
    """Each (learner, recipe) against plain over seeds (:func:`offaug.pipeline.verdict.judge`)."""
    verdict_headline: str
    """One line: the best arm per learner (:func:`offaug.pipeline.verdict.headline`)."""
    weights: RolloutWeights
    """The rollout's importance weights."""
    diagnostics: dict[str, Any]
    """:func:`offaug.pipeline.diagnostics.run_diagnostics`'s document, typed as
    :class:`offaug.pipeline.diagnostics.schema.Diagnostics`."""
