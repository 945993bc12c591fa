"""What the report reads: ``metrics.json``, typed.

Every key is optional: a missing section is reported as missing rather than failing.
"""

from __future__ import annotations

from typing import Any, TypedDict

# ``return`` is a keyword, so this one is spelled functionally: the final evaluation's mean
# return, and its D4RL-normalised score (None without reference scores).
TrainingResult = TypedDict(
    "TrainingResult", {"return": float, "normalised_score": float | None}, total=False
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
    """One result per training run, named ``<algorithm>-original`` / ``<algorithm>-augmented``."""
    weights: RolloutWeights
    """The rollout's importance weights."""
    diagnostics: dict[str, Any]
    """:func:`offaug.pipeline.diagnostics.run_diagnostics`'s document, typed as
    :class:`offaug.pipeline.diagnostics.schema.Diagnostics`."""
