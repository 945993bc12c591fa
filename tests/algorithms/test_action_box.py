"""The numpy ActionBox and a trainer's torch ActionNormaliser map actions alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offaug.algorithms.base import Spaces
from offaug.algorithms.nn.distributions import ActionNormaliser
from offaug.datasets.action_box import ActionBox


def test_the_box_of_a_trainer_s_normaliser_maps_as_the_normaliser_does() -> None:
    normaliser = ActionNormaliser(Spaces(3, 2, action_low=(-2.0, 0.0), action_high=(2.0, 1.0)))
    box = ActionBox.from_normaliser(normaliser)
    np.testing.assert_allclose(box.low, [-2.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(box.high, [2.0, 1.0], atol=1e-6)
    actions = np.array([[-2.0, 0.0], [2.0, 1.0], [0.5, 0.25], [9.0, -3.0]])
    expected = normaliser(torch.tensor(actions, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(box.normalise(actions), expected, atol=1e-6)
    np.testing.assert_allclose(box.to_env(box.normalise(actions[:3])), actions[:3], atol=1e-6)
    assert box.log_abs_det == pytest.approx(normaliser.log_abs_det)
    assert box.log_abs_det == pytest.approx(ActionBox.from_bounds([-2, 0], [2, 1]).log_abs_det)
