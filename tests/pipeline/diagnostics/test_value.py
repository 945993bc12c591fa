"""The ``value`` section: a critic that says +100 everywhere over-estimates."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from tests.pipeline.diagnostics.helpers import (
    Hopper,
)


def test_constant_critic_shows_a_positive_gap(hopper: Hopper) -> None:
    data = hopper.data
    mc = diag.discounted_returns(data.rewards, data.episode_ids, 0.99)
    assert mc.max() < 100.0

    def critic(observations: np.ndarray, actions: np.ndarray) -> np.ndarray:
        return np.full(len(observations), 100.0, dtype=np.float32)

    q = diag.batched_q(critic, data.observations, data.actions)
    gap = diag.value_gap(q, mc)
    assert gap["gap_mean"] > 0
    assert gap["sign"] == "over"
    assert gap["overestimated_fraction"] == 1.0
    assert gap["gap_mean"] == pytest.approx(100.0 - mc.mean())
    random = diag.random_action_gap(
        critic, data.observations, data.actions, np.zeros_like(data.actions)
    )
    assert random["difference"] == 0.0
