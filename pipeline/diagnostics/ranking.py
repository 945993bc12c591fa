"""Ranking evaluated policies, and evaluating many checkpoints from the same start states."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from offaug.pipeline.diagnostics.evaluation import evaluate_checkpoint
from offaug.pipeline.diagnostics.schema import RankingEntry


def rank_results(results: Sequence[Mapping[str, Any]]) -> list[RankingEntry]:
    """Rank evaluated policies, best first: by mean return, then success rate, then length.

    Each entry also gets its rank on each criterion alone (1 is best; ties share the best rank;
    a longer episode ranks higher, as in locomotion where falling ends an episode).
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
    order = np.lexsort((-scores["length"], -scores["success"], -scores["return"]))
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
            }
        )
    return ranked


def rank_checkpoints(
    checkpoints: Sequence[str],
    env_meta: Mapping[str, Any],
    episodes: int,
    seeds: Sequence[int],
    client: Any = None,
) -> list[RankingEntry]:
    """Evaluate many checkpoints from the same start states and rank them, best first.

    Every checkpoint runs one greedy episode per reset seed ``seed + i`` for ``seed`` in
    ``seeds`` and ``i < episodes``, so all see the same start states. With a Dask ``client``
    the checkpoints are evaluated in parallel (``client.map``, one task each); without, one
    after another. The client is used through its methods only: this module never imports Dask.

    Returns:
        :func:`rank_results` entries; ``name`` and ``path`` are the checkpoint path.
    """
    reset_seeds = [int(seed) + i for seed in seeds for i in range(episodes)]
    paths = [str(p) for p in checkpoints]
    results: Sequence[Mapping[str, Any]]
    if client is None:
        results = [evaluate_checkpoint(p, dict(env_meta), reset_seeds) for p in paths]
    else:
        futures = client.map(
            evaluate_checkpoint,
            paths,
            env_meta=dict(env_meta),
            reset_seeds=reset_seeds,
            pure=False,
        )
        results = client.gather(futures)
    return rank_results(results)
