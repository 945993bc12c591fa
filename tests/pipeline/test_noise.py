"""Noise specifications and their log-densities."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline.noise import ContinuousNoise, DiscreteNoise, NoiseSpecError, parse_noise


@pytest.mark.parametrize(
    "spec",
    [
        "gaussian:0.3",
        "ou:0.2:0.3",
        "uniform",
        "0.7*gaussian:0.1+0.3*gaussian:0.5",
        "gaussian:0.2+epsilon:0.2",
    ],
)
def test_log_density_matches_the_samples_and_integrates_to_one(spec: str) -> None:
    rng = np.random.default_rng(0)
    n = 200_000
    noise = ContinuousNoise(parse_noise(spec), n, 1, rng)
    mean = np.full((n, 1), 0.8)
    actions, log_prob = noise.sample(mean)
    assert actions.min() >= -1.0 and actions.max() <= 1.0
    histogram, edges = np.histogram(actions[:, 0], bins=40, range=(-1, 1), density=True)
    centers = (edges[:-1] + edges[1:]) / 2
    grid = ContinuousNoise(parse_noise(spec), 40, 1, rng)
    density = np.exp(grid.log_prob(centers[:, None], np.full((40, 1), 0.8)))
    assert abs(density.sum() * 0.05 - 1.0) < 0.01
    # Sampling error of a 40-bin histogram of 200k draws stays well under 0.06.
    assert np.abs(histogram - density).max() < 0.06
    # The returned log-probabilities are the density at the sampled actions.
    np.testing.assert_allclose(
        log_prob[:5],
        ContinuousNoise(parse_noise(spec), 5, 1, rng).log_prob(actions[:5], mean[:5]),
        rtol=1e-10,
    )


def test_truncation_not_clipping_puts_no_mass_on_the_bound() -> None:
    rng = np.random.default_rng(1)
    noise = ContinuousNoise(parse_noise("gaussian:0.5"), 10_000, 2, rng)
    actions, _ = noise.sample(np.full((10_000, 2), 0.95))
    assert np.mean(np.abs(actions) >= 1.0) < 1e-3


def test_ou_noise_is_correlated_in_time_and_resets() -> None:
    rng = np.random.default_rng(2)
    noise = ContinuousNoise(parse_noise("ou:0.1:0.05"), 1, 1, rng)
    deviations = []
    for _ in range(2000):
        actions, _ = noise.sample(np.zeros((1, 1)))
        deviations.append(actions[0, 0])
    series = np.asarray(deviations)
    assert np.corrcoef(series[:-1], series[1:])[0, 1] > 0.5
    noise.reset([0])
    assert noise.ou_state[0, 0] == 0.0


def test_epsilon_greedy_probabilities_for_discrete_actions() -> None:
    rng = np.random.default_rng(3)
    noise = DiscreteNoise(parse_noise("epsilon:0.3"), 4, rng)
    actions, log_prob = noise.sample(np.zeros(100_000, dtype=np.int64))
    frequency = np.bincount(actions, minlength=4) / len(actions)
    np.testing.assert_allclose(frequency, [0.775, 0.075, 0.075, 0.075], atol=0.01)
    np.testing.assert_allclose(np.exp(log_prob[actions == 0][0]), 0.775)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "gaussian",
        "gaussian:-1",
        "ou:0.1:2",
        "laplace:0.1",
        "0.5*gaussian:0.1+0.2*uniform",
        "epsilon:1.5",
        "gaussian:abc",
    ],
)
def test_bad_specs_show_the_grammar(bad: str) -> None:
    with pytest.raises(NoiseSpecError, match=r"gaussian|epsilon|weights|ou"):
        parse_noise(bad)


def test_bare_epsilon_needs_a_continuous_base() -> None:
    with pytest.raises(NoiseSpecError, match="continuous base"):
        ContinuousNoise(parse_noise("epsilon:0.1"), 1, 1, np.random.default_rng(0))
