"""The ``weights`` section: ESS, clipping and per-episode weights on hand-made data."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from offaug.datasets import Transitions
from offaug.pipeline import diagnostics as diag


def test_effective_sample_size_formula() -> None:
    assert diag.effective_sample_size([1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert diag.effective_sample_size([1.0, 0.0, 0.0, 0.0]) == pytest.approx(1.0)
    assert diag.effective_sample_size([2.0, 1.0, 1.0]) == pytest.approx(16.0 / 6.0)
    # Scale-free, and the log form agrees without overflowing.
    weights = np.random.default_rng(0).lognormal(0.0, 2.0, size=1000)
    assert diag.effective_sample_size(7.0 * weights) == pytest.approx(
        diag.effective_sample_size(weights)
    )
    assert diag.effective_sample_size_from_logs(np.log(weights) + 900.0) == pytest.approx(
        diag.effective_sample_size(weights)
    )
    assert diag.effective_sample_size([]) == 0.0


def test_weight_summary_counts_clipping_from_raw_log_ratios() -> None:
    raw = np.log([0.5, 1.0, 200.0, 1000.0])
    summary = diag.weight_summary(np.exp(np.minimum(raw, math.log(100.0))), raw, 100.0)
    assert summary["clipped_fraction"] == 0.5
    assert summary["n"] == 4
    assert diag.weight_summary(np.ones(3), None, 100.0)["clipped_fraction"] is None


def test_episode_weights_use_cumulative_log_ratio_at_episode_end() -> None:
    ids = np.array([0, 0, 0, 1, 1])
    ratio = np.array([0.1, -0.2, 0.3, 1.0, 2.0], dtype=np.float32)
    cumulative = np.array([0.1, -0.1, 0.2, 1.0, 3.0], dtype=np.float32)
    base = _transitions(ids, rollout_log_prob=np.zeros(5, np.float32), behaviour_log_prob=ratio)
    assert diag.episode_log_weights(base) == pytest.approx([0.2, 3.0], abs=1e-6)
    with_extra = dataclasses.replace(base, extras={"cumulative_log_ratio": cumulative})
    assert diag.episode_log_weights(with_extra) == pytest.approx([0.2, 3.0], abs=1e-6)


def _transitions(ids: np.ndarray, **optional: Any) -> Transitions:
    n = len(ids)
    observations = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    last = np.r_[ids[1:] != ids[:-1], True]
    return Transitions(
        observations=observations,
        actions=np.zeros((n, 1), dtype=np.float32),
        rewards=np.ones(n, dtype=np.float32),
        next_observations=observations + 1,
        terminals=last.copy(),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=ids.astype(np.int64),
        **optional,
    )
