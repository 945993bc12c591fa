"""The action box: round trip and distances."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag


def test_action_space_round_trip_and_distance() -> None:
    space = diag.ActionSpace.box([0.0, -4.0], [2.0, 4.0])
    actions = np.array([[0.0, -4.0], [2.0, 4.0], [1.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(space.normalise(actions), [[-1, -1], [1, 1], [0, 0]])
    np.testing.assert_allclose(space.denormalise(space.normalise(actions)), actions)
    assert space.distance(actions[:1], actions[1:2]) == pytest.approx([math.sqrt(8)])
    discrete = diag.ActionSpace(True, np.zeros(0), np.zeros(0), 3)
    assert discrete.distance(np.array([0, 1]), np.array([0, 2])).tolist() == [0.0, 1.0]
    assert discrete.features(np.array([2])).tolist() == [[0.0, 0.0, 1.0]]
