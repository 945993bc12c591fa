"""Summaries of a dataset: what ``offaug inspect`` prints."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from minari.serialization import deserialize_space

from offaug.datasets.transitions import Transitions
from offaug.datasets.weights import effective_sample_size


def _space_text(serialised: Any) -> str | None:
    if not isinstance(serialised, str):
        return None
    return str(deserialize_space(serialised))


def summarize(transitions: Transitions) -> dict[str, Any]:
    """Episode, step, space, return and flag statistics of a transition set (JSON-ready).

    NaN/inf values are counted per field, not refused, so that a broken dataset can be looked at.
    """
    bounds = transitions.episode_bounds()
    lengths = np.diff(bounds)
    rewards = transitions.rewards.astype(np.float64)
    finite_rewards = np.where(np.isfinite(rewards), rewards, 0.0)
    returns = transitions.episode_returns(finite=True)

    def stats(values: np.ndarray) -> dict[str, float]:
        if values.size == 0:
            return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
        return {
            "mean": float(values.mean()),
            "std": float(values.std()),
            "min": float(values.min()),
            "max": float(values.max()),
        }

    nan_counts = {
        name: int(np.count_nonzero(~np.isfinite(getattr(transitions, name))))
        for name in ("observations", "next_observations", "actions", "rewards")
        if getattr(transitions, name).dtype.kind == "f"
    }
    meta = transitions.meta
    summary: dict[str, Any] = {
        "format": meta.get("format"),
        "dataset_id": meta.get("dataset_id"),
        "episodes": len(lengths),
        "steps": len(transitions),
        "observation_shape": list(transitions.observation_shape),
        "observation_dtype": str(transitions.observations.dtype),
        "action_shape": list(transitions.action_shape),
        "action_dtype": str(transitions.actions.dtype),
        "observation_space": _space_text(meta.get("observation_space")),
        "action_space": _space_text(meta.get("action_space")),
        "observation_keys": meta.get("observation_keys"),
        "episode_length": stats(lengths.astype(np.float64)),
        "episode_return": stats(returns),
        "reward": stats(finite_rewards),
        "terminals": int(transitions.terminals.sum()),
        "timeouts": int(transitions.timeouts.sum()),
        "nan_or_inf": nan_counts,
        "ref_min_score": meta.get("ref_min_score"),
        "ref_max_score": meta.get("ref_max_score"),
        "extras": sorted(transitions.extras),
    }
    if transitions.importance_weight is not None:
        weights = transitions.importance_weight.astype(np.float64)
        summary["importance_weight"] = {
            **stats(weights),
            "ess": effective_sample_size(weights),
        }
    return summary
