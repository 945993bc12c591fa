"""Importance-weight statistics: the one home of the effective sample size and of
self-normalisation.

Rollouts, model rollouts, diagnostics and publishing all summarise weights with these
functions (numpy only, so the data layer can use them too).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def effective_sample_size(weights: npt.ArrayLike) -> float:
    """Kish's ESS = (sum w)^2 / sum w^2 (0 for no or all-zero weights)."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0:
        return 0.0
    return effective_sample_size_from_sums(float(np.sum(w)), float(np.sum(w**2)))


def effective_sample_size_from_sums(total: float, total_squared: float) -> float:
    """Kish's ESS from running sums: ``total`` = sum w, ``total_squared`` = sum w^2."""
    if total_squared <= 0:
        return 0.0
    # numpy float64: a huge sum overflows to inf (with a warning) instead of raising.
    return float(np.float64(total) ** 2 / total_squared)


def effective_sample_size_from_logs(log_weights: npt.ArrayLike) -> float:
    """ESS of ``exp(log_weights)`` without overflow: exp(2 lse(x) - lse(2x))."""
    x = np.asarray(log_weights, dtype=np.float64).reshape(-1)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0
    return float(np.exp(2 * np.logaddexp.reduce(x) - np.logaddexp.reduce(2 * x)))


def self_normalised_weights(
    weights: npt.ArrayLike, mean_weight: float | None = None
) -> npt.NDArray[np.float64]:
    """``w / mean(w)``: weights whose mean is 1 over the data that ``mean_weight`` pools.

    ``mean_weight`` defaults to the mean of ``weights`` themselves; a shard set passes the mean
    over all its shards, so that every shard is normalised by the same constant.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0:
        return w
    mean = float(w.mean()) if mean_weight is None else float(mean_weight)
    return w / max(mean, 1e-300)
