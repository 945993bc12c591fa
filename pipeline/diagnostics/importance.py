"""The ``weights`` section: how much of the augmented data its importance weights keep.

The effective sample size and the clipped fraction come from
:func:`offaug.pipeline.rollouts.behaviour.weight_statistics` (the rollouts' own); the clipped
fraction is counted from the raw log-ratios log beta_hat - log mu the rollout stored, against the
``max_weight`` clip its manifest records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.weights import effective_sample_size_from_logs
from offaug.pipeline.diagnostics.document import (
    EpisodeWeights,
    ShardWeights,
    WeightHistogram,
    WeightsSection,
    WeightSummary,
)
from offaug.pipeline.diagnostics.histograms import quantiles, shared_histogram
from offaug.pipeline.diagnostics.sampling import FloatArray
from offaug.pipeline.rollouts.behaviour import weight_statistics

# Log-weights are capped here before exp: exp(700) ~ 1e304 still fits a float64.
_LOG_CAP = 700.0


def weight_summary(
    weights: npt.ArrayLike, raw_log_ratio: npt.ArrayLike | None, max_weight: float | None
) -> WeightSummary:
    """n, ESS, ESS/N, clipped fraction (None without log-ratios or a clip), mean/min/max."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    counted = raw_log_ratio is not None and max_weight is not None
    stats = weight_statistics(
        w,
        np.zeros(w.size) if raw_log_ratio is None else raw_log_ratio,
        math.inf if max_weight is None else max_weight,
    )
    return {
        "n": int(w.size),
        "ess": stats["ess"],
        "ess_fraction": stats["ess_fraction"],
        "clipped_fraction": stats["clipped_fraction"] if counted and w.size else None,
        "mean": float(w.mean()) if w.size else None,
        "min": float(w.min()) if w.size else None,
        "max": float(w.max()) if w.size else None,
    }


def log_weight_histogram(weights: npt.ArrayLike, bins: int) -> WeightHistogram:
    """Histogram of log10 w over the positive weights; ``zeros`` counts w == 0."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    positive = w[w > 0]
    histogram = shared_histogram({"counts": np.log10(positive)}, bins)
    return {
        "edges": histogram["edges"],
        "counts": histogram["counts"],
        "zeros": int(np.sum(w <= 0)),
    }


def episode_log_weights(transitions: Any) -> FloatArray | None:
    """Per episode, log prod_t beta_hat/mu: ``cumulative_log_ratio`` at the episode's last row.

    Falls back to summing ``behaviour_log_prob - rollout_log_prob``; None without either.
    """
    bounds = transitions.episode_bounds()
    if len(bounds) < 2:
        return np.zeros(0)
    cumulative = transitions.extras.get("cumulative_log_ratio")
    if cumulative is not None:
        return np.asarray(cumulative, dtype=np.float64)[bounds[1:] - 1]
    if transitions.behaviour_log_prob is None or transitions.rollout_log_prob is None:
        return None
    ratio = np.asarray(transitions.behaviour_log_prob, np.float64) - np.asarray(
        transitions.rollout_log_prob, np.float64
    )
    return transitions.episode_sums(ratio)


def raw_log_ratio(transitions: Any) -> FloatArray | None:
    """Per row, the unclipped log beta_hat - log mu; None without both log-probabilities."""
    if transitions.behaviour_log_prob is None or transitions.rollout_log_prob is None:
        return None
    return np.asarray(transitions.behaviour_log_prob, np.float64) - np.asarray(
        transitions.rollout_log_prob, np.float64
    )


def importance_weight_diagnostics(
    shards: Sequence[tuple[str, Any]], max_weight: float | None, bins: int
) -> WeightsSection:
    """The ``weights`` section over named shards of augmented :class:`Transitions`."""
    weights, log_ratios, episode_logs = [], [], []
    per_shard: list[ShardWeights] = []
    present = all(part.importance_weight is not None for _, part in shards) and bool(shards)
    for name, part in shards:
        w = (
            np.ones(len(part))
            if part.importance_weight is None
            else np.asarray(part.importance_weight, np.float64)
        )
        log_ratio = raw_log_ratio(part)
        weights.append(w)
        if log_ratio is not None:
            log_ratios.append(log_ratio)
        logs = episode_log_weights(part)
        if logs is not None:
            episode_logs.append(logs)
        summary = weight_summary(w, log_ratio, max_weight)
        per_shard.append(
            {
                "shard": name,
                "n": summary["n"],
                "ess": summary["ess"],
                "ess_fraction": summary["ess_fraction"],
                "clipped_fraction": summary["clipped_fraction"],
            }
        )
    all_weights = np.concatenate(weights) if weights else np.zeros(0)
    all_log_ratio = (
        np.concatenate(log_ratios) if len(log_ratios) == len(shards) and log_ratios else None
    )
    episodes: EpisodeWeights | None = None
    if episode_logs and len(episode_logs) == len(shards):
        logs = np.concatenate(episode_logs)
        ess = effective_sample_size_from_logs(logs)
        episodes = {
            "episodes": len(logs),
            "log_quantiles": quantiles(logs),
            "quantiles": quantiles(np.exp(np.minimum(logs, _LOG_CAP))),
            "ess": ess,
            "ess_fraction": ess / len(logs) if len(logs) else 0.0,
        }
    return {
        "present": present,
        **weight_summary(all_weights, all_log_ratio, max_weight),
        "weight_clip": max_weight,
        "per_shard": per_shard,
        "histogram": log_weight_histogram(all_weights, bins),
        "episodes": episodes,
    }
