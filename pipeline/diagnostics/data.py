"""The ``data`` section: episodes, steps, rewards and returns of the original and augmented data."""

from __future__ import annotations

from typing import Any

import numpy as np

from offaug.pipeline.diagnostics.document import DataSection, DataSummary
from offaug.pipeline.diagnostics.histograms import paired_histogram, quantiles


def data_summary(transitions: Any) -> DataSummary:
    """Episodes, steps, reward mean/std, episode lengths and returns, terminal/timeout counts."""
    rewards = np.asarray(transitions.rewards, dtype=np.float64)
    lengths = np.diff(transitions.episode_bounds())
    returns = transitions.episode_returns()
    return {
        "episodes": int(transitions.num_episodes),
        "steps": len(transitions),
        "reward_mean": float(rewards.mean()) if rewards.size else None,
        "reward_std": float(rewards.std()) if rewards.size else None,
        "terminals": int(np.count_nonzero(transitions.terminals)),
        "timeouts": int(np.count_nonzero(transitions.timeouts)),
        "episode_length": {
            "mean": float(lengths.mean()) if lengths.size else None,
            "min": int(lengths.min()) if lengths.size else None,
            "max": int(lengths.max()) if lengths.size else None,
        },
        "return": {
            "mean": float(returns.mean()) if returns.size else None,
            "std": float(returns.std()) if returns.size else None,
            "quantiles": quantiles(returns),
        },
    }


def data_section(original: Any, augmented: Any | None, gamma: float, bins: int) -> DataSection:
    """The ``data`` section: both datasets' summaries and their return histograms."""
    return {
        "gamma": gamma,
        "effective_horizon": 1.0 / (1.0 - gamma),
        "original": data_summary(original),
        "augmented": None if augmented is None else data_summary(augmented),
        "return_histogram": paired_histogram(
            original.episode_returns(),
            None if augmented is None else augmented.episode_returns(),
            bins,
        ),
    }
