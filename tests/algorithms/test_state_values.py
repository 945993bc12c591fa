"""The learners' own value of their policy (``base.StateValue``): what ``filter: value`` reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import Spaces, StateValue, has_state_value

SPACES = Spaces(5, 2, action_low=(-2.0, -0.5), action_high=(2.0, 0.5))


def test_the_learners_with_a_value_are_named() -> None:
    able = {name for name in registry.ALGORITHMS if has_state_value(registry.trainer_type(name))}
    assert able == {"iql", "td3bc", "rebrac", "cql"}
    assert registry.state_value_refusal("td3bc") is None
    refusal = registry.state_value_refusal("bcq")
    assert refusal is not None and "bcq has none" in refusal and "iql" in refusal


@pytest.mark.parametrize("name", ["td3bc", "rebrac", "cql"])
def test_a_critics_value_is_its_q_at_the_policys_action(name: str) -> None:
    learner = registry.build(name, SPACES, {"hidden": (32, 32)}, device="cpu")
    assert isinstance(learner, StateValue)
    observations = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    values = learner.state_values(observations)
    assert values.shape == (7,)
    q = learner.q_values(observations, learner.act(observations))  # type: ignore[attr-defined]
    np.testing.assert_allclose(values, q, rtol=1e-4, atol=1e-5)


def test_iqls_value_is_its_v_net_in_the_datas_reward_units() -> None:
    learner = registry.build("iql", SPACES, {"hidden": (32, 32)}, device="cpu")
    learner.reward_scale = 4.0  # type: ignore[attr-defined]
    observations = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    with torch.no_grad():
        normalised = learner.observation_normaliser(torch.as_tensor(observations))  # type: ignore[attr-defined]
        expected = learner.value(normalised).squeeze(-1).numpy() / 4.0  # type: ignore[attr-defined]
    np.testing.assert_allclose(learner.state_values(observations), expected, rtol=1e-6)  # type: ignore[attr-defined]
