"""Ranking evaluated policies, and evaluating many checkpoints from the same start states.

Two orders:

* by default, lexicographic: mean return, then success rate, then mean length;
* with a :class:`~offaug.pipeline.schema.rank_metric.RankMetric`
(``return:0.6,success:0.3,length:0.1``),
  by a **weighted score**. Each metric is first put on a common scale: min-max over every
  episode of every candidate (0 is the worst episode seen on that metric, 1 the best; the
  direction is the term's, so ``-length`` makes the shortest episode 1). A metric equal in every
  episode tells the candidates nothing apart and scores 0 for all. An episode's score is the
  weighted sum of its scaled metrics; a policy's score is the mean over start states, with a 95 %
  percentile bootstrap interval that resamples start states (the same resample for every
  policy, since they all ran from the same start states). The scale is fixed by the full sample,
  so the score is linear in the episodes and the interval brackets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.evaluation import evaluate_checkpoint
from offaug.pipeline.diagnostics.policy_document import RankingEntry, WeightedRanking
from offaug.pipeline.schema.rank_metric import MetricName, RankMetric

BOOTSTRAP_REPS = 2000
"""Bootstrap resamples of the start states per interval."""
INTERVAL_PERCENTILES = (2.5, 97.5)
"""The 95 % percentile interval."""
_EPISODE_KEYS: dict[MetricName, str] = {
    "return": "returns",
    "success": "successes",
    "length": "lengths",
}
"""Where each metric's per-episode values are in an evaluation record."""


@dataclasses.dataclass(frozen=True)
class WeightedScore:
    """One policy's weighted score with its bootstrap interval."""

    score: float
    low: float
    high: float
    scaled_means: dict[str, float]
    """Each metric's mean on the common scale (direction applied)."""


def episode_metric(
    results: Sequence[Mapping[str, Any]], name: MetricName
) -> npt.NDArray[np.float64]:
    """``(policies, start states)``: metric ``name`` of every policy's episode from every start.

    Raises:
        ValueError: a record lacks the per-episode values, or the policies ran from different
            numbers of start states.
    """
    key = _EPISODE_KEYS[name]
    rows = []
    for result in results:
        values = result.get(key)
        if values is None:
            raise ValueError(f"{result.get('name')!r}: no per-episode {key!r} to rank on {name}")
        rows.append(np.asarray(values, dtype=np.float64))
    counts = {len(row) for row in rows}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"every policy needs episodes from the same start states, got counts {sorted(counts)}"
        )
    return np.stack(rows)


def weighted_scores(
    results: Sequence[Mapping[str, Any]],
    metric: RankMetric,
    *,
    seed: int = 0,
    reps: int = BOOTSTRAP_REPS,
) -> list[WeightedScore]:
    """Every policy's weighted score and 95 % bootstrap interval (see the module docstring).

    ``results`` hold per-episode ``returns``, ``successes`` and ``lengths`` in the same order
    of start states (as :func:`evaluate_checkpoint` and the diagnostics' evaluation make them).
    The bootstrap draws from ``numpy.random.default_rng(seed)``.
    """
    if not results:
        return []
    scaled_terms = []
    for term in metric.terms:
        values = episode_metric(results, term.name)  # (policies, starts)
        low, high = float(values.min()), float(values.max())
        scaled = (values - low) / (high - low) if high > low else np.zeros_like(values)
        if not term.higher_is_better and high > low:
            scaled = 1.0 - scaled
        scaled_terms.append(scaled)
    weights = np.array([term.weight for term in metric.terms])
    per_episode = np.tensordot(weights, np.stack(scaled_terms), axes=1)  # (policies, starts)
    scaled_means = [
        {
            term.label: float(scaled[i].mean())
            for term, scaled in zip(metric.terms, scaled_terms, strict=True)
        }
        for i in range(len(results))
    ]
    starts = per_episode.shape[1]
    rng = np.random.default_rng(seed)
    resamples = rng.integers(0, starts, size=(reps, starts))
    boot = per_episode[:, resamples].mean(axis=2)  # (policies, reps, starts) -> (policies, reps)
    lows, highs = np.percentile(boot, INTERVAL_PERCENTILES, axis=1)
    points = per_episode.mean(axis=1)
    return [
        WeightedScore(float(point), float(low), float(high), means)
        for point, low, high, means in zip(points, lows, highs, scaled_means, strict=True)
    ]


def rank_results(
    results: Sequence[Mapping[str, Any]],
    metric: RankMetric | None = None,
    *,
    seed: int = 0,
    reps: int = BOOTSTRAP_REPS,
) -> list[RankingEntry]:
    """Rank evaluated policies, best first.

    Without ``metric``: by mean return, then success rate, then length. With one: by the
    weighted score (ties by mean return), each entry's ``weighted`` holding the score, its
    bootstrap interval (``seed``, ``reps``) and the scaled metric means. Either way each entry
    also gets its rank on each criterion alone (1 is best; ties share the best rank; a longer
    episode ranks higher, as in locomotion where falling ends an episode).
    """
    # Imported here: scipy.stats is heavy and only ranking needs it.
    from scipy.stats import rankdata

    if not results:
        return []

    criteria = {"return": "mean_return", "success": "success_rate", "length": "mean_length"}
    # Higher is better on every criterion; a missing value counts as 0.
    scores = {
        name: np.array([float(r.get(key) or 0.0) for r in results])
        for name, key in criteria.items()
    }
    by = {name: rankdata(-values, method="min") for name, values in scores.items()}
    weighted: list[WeightedRanking | None] = [None] * len(results)
    if metric is None:
        order = np.lexsort((-scores["length"], -scores["success"], -scores["return"]))
    else:
        found = weighted_scores(results, metric, seed=seed, reps=reps)
        order = np.lexsort((-scores["return"], -np.array([w.score for w in found])))
        weighted = [
            {
                "metric": str(metric),
                "score": w.score,
                "low": w.low,
                "high": w.high,
                "scaled_means": w.scaled_means,
            }
            for w in found
        ]
    ranked: list[RankingEntry] = []
    for position, i in enumerate(order.tolist(), start=1):
        entry = results[i]
        ranked.append(
            {
                "name": entry.get("name"),
                "path": entry.get("path"),
                "rank": position,
                "mean_return": entry.get("mean_return"),
                "mean_length": entry.get("mean_length"),
                "success_rate": entry.get("success_rate"),
                "rank_by": {
                    "return": int(by["return"][i]),
                    "success": int(by["success"][i]),
                    "length": int(by["length"][i]),
                },
                "weighted": weighted[i],
            }
        )
    return ranked


def rank_checkpoints(
    checkpoints: Sequence[str],
    env_meta: Mapping[str, Any],
    episodes: int,
    seeds: Sequence[int],
    client: Any = None,
    *,
    metric: RankMetric | None = None,
    env_id: str | None = None,
    bootstrap_seed: int = 0,
) -> list[RankingEntry]:
    """Evaluate many checkpoints from the same start states and rank them, best first.

    Every checkpoint runs one greedy episode per reset seed ``seed + i`` for ``seed`` in
    ``seeds`` and ``i < episodes``, so all see the same start states, in the env of
    ``env_meta`` (or ``env_id``). With a Dask ``client`` the checkpoints are evaluated in
    parallel (``client.map``, one task each); without, one after another. The client is used
    through its methods only: this module never imports Dask.

    Returns:
        :func:`rank_results` entries (by ``metric`` when given, its bootstrap seeded
        ``bootstrap_seed``); ``name`` and ``path`` are the checkpoint path.
    """
    reset_seeds = [int(seed) + i for seed in seeds for i in range(episodes)]
    paths = [str(p) for p in checkpoints]
    results: Sequence[Mapping[str, Any]]
    if client is None:
        results = [
            evaluate_checkpoint(p, dict(env_meta), reset_seeds, env_id=env_id) for p in paths
        ]
    else:
        futures = client.map(
            evaluate_checkpoint,
            paths,
            env_meta=dict(env_meta),
            reset_seeds=reset_seeds,
            env_id=env_id,
            pure=False,
        )
        results = client.gather(futures)
    return rank_results(results, metric, seed=bootstrap_seed)
