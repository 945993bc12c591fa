"""Monte-Carlo returns: hand-made episodes and a Python loop agree."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from tests.pipeline.diagnostics.helpers import (
    Hopper,
)


def test_monte_carlo_returns_on_hand_made_episodes() -> None:
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0]
    ids = [0, 0, 0, 1, 1]
    returns = diag.discounted_returns(rewards, ids, 0.5)
    assert returns == pytest.approx([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3, 4 + 0.5 * 5, 5])
    assert diag.steps_to_end(ids).tolist() == [2, 1, 0, 1, 0]
    # Episode 0 terminated: complete. Episode 1 was cut by a timeout with fewer than
    # 3 / (1 - gamma) = 6 steps left: incomplete.
    complete = diag.complete_returns([False, False, True, False, False], ids, 0.5)
    assert complete.tolist() == [True, True, True, False, False]


def test_monte_carlo_returns_match_a_python_loop(hopper: Hopper) -> None:
    data = hopper.data
    fast = diag.discounted_returns(data.rewards, data.episode_ids, 0.9)
    slow = np.zeros(len(data))
    for start, stop in zip(data.episode_bounds()[:-1], data.episode_bounds()[1:], strict=True):
        following = 0.0
        for t in range(stop - 1, start - 1, -1):
            following = float(data.rewards[t]) + 0.9 * following
            slow[t] = following
    assert fast == pytest.approx(slow, rel=1e-6)
