"""Noise specifications and their log-densities."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline.rollouts.noise import (
    ContinuousNoise,
    DiscreteNoise,
    NoiseSpecError,
    parse_noise,
)


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


def test_a_centre_far_outside_the_box_samples_its_truncated_density() -> None:
    from scipy import stats

    n, sigma, theta = 20_000, 0.1, 0.5
    noise = ContinuousNoise(parse_noise(f"ou:{sigma}:{theta}"), n, 1, np.random.default_rng(4))
    noise.ou_state[:] = 4.0  # centre 0 + (1 - theta) * 4 = 2: ten sigmas above the box
    actions, log_prob = noise.sample(np.zeros((n, 1)))
    centre = 2.0
    truth = stats.truncnorm((-1 - centre) / sigma, (1 - centre) / sigma, loc=centre, scale=sigma)
    assert np.mean(actions >= 1.0) < 1e-3
    assert abs(actions.mean() - truth.mean()) < 5 * truth.std() / np.sqrt(n)
    np.testing.assert_allclose(log_prob, truth.logpdf(actions[:, 0]), rtol=1e-6, atol=1e-6)
    # -E[log mu] is the entropy; with every sample on the bound it is off by about a nat.
    assert abs(-log_prob.mean() - truth.entropy()) < 0.05


def test_mixture_weights_within_tolerance_are_renormalised_once() -> None:
    spec = parse_noise("0.3333333*gaussian:0.1+0.6666666*gaussian:0.3")
    assert sum(c.weight for c in spec.components) == pytest.approx(1.0, abs=1e-15)
    noise = ContinuousNoise(spec, 1000, 2, np.random.default_rng(5))
    actions, log_prob = noise.sample(np.zeros((1000, 2)))
    assert np.isfinite(log_prob).all() and np.abs(actions).max() <= 1.0
    assert spec.text == "0.3333333*gaussian:0.1+0.6666666*gaussian:0.3"


def test_epsilon_zero_is_refused_for_discrete_actions() -> None:
    with pytest.raises(NoiseSpecError, match="deterministic"):
        DiscreteNoise(parse_noise("epsilon:0"), 4, np.random.default_rng(6))


def test_the_workflow_holds_the_parsed_spec_and_writes_back_its_text(tmp_path) -> None:
    import yaml

    from offaug.pipeline.schema.rollout_section import RolloutModel
    from offaug.pipeline.schema.validation import WorkflowError
    from offaug.pipeline.schema.workflow import load_workflow

    rollout = RolloutModel.model_validate({"noise": "0.7*gaussian:0.1+0.3*ou:0.2:0.3"})
    assert rollout.noise == parse_noise("0.7*gaussian:0.1+0.3*ou:0.2:0.3")
    assert rollout.model_dump(mode="json")["noise"] == "0.7*gaussian:0.1+0.3*ou:0.2:0.3"
    assert RolloutModel.model_validate(rollout.model_dump(mode="json")) == rollout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"name": "x", "source": {"dataset": "a-v0"}, "rollout": {"noise": "lap"}})
    )
    with pytest.raises(WorkflowError, match=r"bad\.yaml:\d+: rollout\.noise: .*gaussian"):
        load_workflow(bad)
