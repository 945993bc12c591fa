"""Divergence from beta_hat: the behaviour mean and noisy rollouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from offaug.pipeline.diagnostics.policy_models import _rollout_divergence
from offaug.pipeline.rollouts.noise import parse_noise


def _known_behaviour(sigma: float) -> diag.BehaviourModel:
    def parameters(observations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mean = np.tanh(observations[:, :2].astype(np.float64))
        return mean, np.full_like(mean, math.log(sigma))

    return diag.BehaviourModel(parameters, diag.ActionSpace.box([-2.0, -2.0], [2.0, 2.0]))


def test_divergence_of_the_behaviour_mean_and_of_noisy_rollouts() -> None:
    from offaug.pipeline.rollouts.noise import truncnorm_log_prob

    rng = np.random.default_rng(0)
    behaviour = _known_behaviour(0.3)
    states = rng.normal(size=(500, 3)).astype(np.float32)
    mean, _ = behaviour.parameters(states)
    mean_actions = behaviour.actions.denormalise(mean)
    dataset_actions = behaviour.actions.denormalise(np.clip(mean + 0.1, -1, 1))
    entry = diag.policy_divergence(behaviour, states, dataset_actions, mean_actions)
    expected = -np.mean(truncnorm_log_prob(mean, mean, 0.3))
    assert entry["nll"] == pytest.approx(expected, rel=1e-6)
    assert entry["action_distance"] == pytest.approx(np.linalg.norm([0.1, 0.1]), rel=0.05)
    # A rollout with exactly beta_hat's noise has KL 0; a wider one has a positive KL.
    same = _rollout_divergence(behaviour, states, dataset_actions, parse_noise("gaussian:0.3"), rng)
    assert same["kl_monte_carlo"] == pytest.approx(0.0, abs=1e-9)
    wide = _rollout_divergence(behaviour, states, dataset_actions, parse_noise("gaussian:0.9"), rng)
    assert wide["kl_monte_carlo"] > 0.1
