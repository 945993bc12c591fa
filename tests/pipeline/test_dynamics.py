"""The learned-dynamics ensemble and its MOPO-style rollouts on a real Hopper dataset."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from offaug.datasets import load_transitions
from offaug.pipeline.rollouts.dynamics import (
    DynamicsConfig,
    dataset_statistics,
    load_dynamics,
    model_rollout,
    save_dynamics,
    train_dynamics,
)
from offaug.pipeline.rollouts.noise import parse_noise
from tests.pipeline.test_rollout import KnownHopperPolicy

CONFIG = DynamicsConfig(members=4, hidden=(64, 64), steps=250, horizon=5, seed=0)


@pytest.fixture(scope="module")
def trained(make_test_dataset) -> tuple[Any, Any]:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    model, _ = train_dynamics(data, CONFIG)
    return data, model


def test_model_beats_predicting_no_change(trained) -> None:
    data, model = trained
    obs = torch.as_tensor(np.array(data.observations[:300]))
    actions = torch.as_tensor(np.array(data.actions[:300]))
    mean, _, _ = model._predict(obs, actions)
    predicted_delta = (mean.mean(0) * model.stats["target_std"] + model.stats["target_mean"])[
        :, :-1
    ]
    true_delta = torch.as_tensor(np.array(data.next_observations[:300] - data.observations[:300]))
    model_error = (predicted_delta - true_delta).pow(2).mean()
    no_change_error = true_delta.pow(2).mean()
    assert model_error < 0.5 * no_change_error


def test_rollouts_have_horizon_bounds_and_penalties(trained) -> None:
    data, model = trained
    starts = np.array(data.observations[::7])
    out = model_rollout(model, KnownHopperPolicy(), starts, noise=parse_noise("gaussian:0.2"))
    assert out.num_episodes == len(starts)
    stats = dataset_statistics(data)
    margin = CONFIG.bounds_margin * (stats["observation_high"] - stats["observation_low"])
    assert (out.next_observations >= stats["observation_low"] - margin - 1e-5).all()
    assert (out.next_observations <= stats["observation_high"] + margin + 1e-5).all()
    for episode in out.iter_episodes():
        assert len(episode) <= CONFIG.horizon
        assert episode.terminals[-1] or episode.timeouts[-1]
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
    np.testing.assert_allclose(
        out.rewards,
        out.extras["raw_reward"] - CONFIG.penalty * out.extras["model_uncertainty"],
        rtol=1e-5,
        atol=1e-5,
    )
    assert (out.source == 2).all()
    assert out.importance_weight is not None and np.isfinite(out.importance_weight).all()
    # Random-policy Hopper data terminates often; the sampled termination head shows it.
    assert out.terminals.any()


def test_save_and_load_give_the_same_predictions(trained, tmp_path: Path) -> None:
    data, model = trained
    path = save_dynamics(model, tmp_path / "dynamics.pt")
    restored = load_dynamics(path)
    obs = torch.as_tensor(np.array(data.observations[:10]))
    actions = torch.as_tensor(np.array(data.actions[:10]))
    for a, b in zip(model._predict(obs, actions), restored._predict(obs, actions), strict=True):
        assert torch.equal(a, b)


def test_discrete_actions_are_refused(make_test_dataset) -> None:
    data = load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id)
    with pytest.raises(ValueError, match="continuous"):
        train_dynamics(data, CONFIG)


def test_a_step_that_leaves_the_bounds_is_dropped_not_clipped(trained) -> None:
    data, model = trained
    # Narrow bounds: many model steps leave them.
    stats = dataset_statistics(data)
    middle = (stats["observation_low"] + stats["observation_high"]) / 2
    half = 0.2 * (stats["observation_high"] - stats["observation_low"])
    narrow = copy.copy(model)  # shares the networks, not the statistics
    narrow.stats = {
        **model.stats,
        "observation_low": torch.as_tensor(middle - half),
        "observation_high": torch.as_tensor(middle + half),
    }
    starts = np.clip(np.array(data.observations[::7]), middle - half, middle + half)
    out = model_rollout(narrow, KnownHopperPolicy(), starts, noise=parse_noise("gaussian:0.2"))
    margin = CONFIG.bounds_margin * 2 * half
    low, high = middle - half - margin, middle + half + margin
    assert 0 < out.num_episodes < len(starts)  # some rollouts left the bounds at once
    # No transition bootstraps from a state clipped onto the bounds' faces.
    next_observations = out.next_observations.astype(np.float32)
    on_face = (next_observations == low.astype(np.float32)) | (
        next_observations == high.astype(np.float32)
    )
    assert not on_face.any()
    assert ((next_observations >= low - 1e-5) & (next_observations <= high + 1e-5)).all()
    for episode in out.iter_episodes():
        assert episode.terminals[-1] or episode.timeouts[-1]
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])


def test_model_rollouts_carry_self_normalised_weights(trained) -> None:
    data, model = trained
    out = model_rollout(
        model,
        KnownHopperPolicy(),
        np.array(data.observations[::7]),
        noise=parse_noise("gaussian:0.2"),
    )
    weights = out.importance_weight.astype(np.float64)
    np.testing.assert_allclose(
        out.extras["self_normalised_weight"], weights / weights.mean(), rtol=1e-5
    )


def test_disagreement_scores_every_state_and_the_filter_drops_rollouts(trained) -> None:
    from offaug.pipeline.rollouts.data import EpisodeFilter, ReturnBaseline

    data, model = trained
    spread = model.disagreement(data.observations[:50], data.actions[:50], chunk=16)
    assert spread.shape == (50,) and (spread >= 0).all() and spread.std() > 0
    starts = np.asarray(data.observations[:20])
    strict = EpisodeFilter(ReturnBaseline.from_transitions(data), margin=-1e6)
    out = model_rollout(
        model,
        KnownHopperPolicy(),
        starts,
        horizon=2,
        start_rows=np.arange(20),
        episode_filter=strict,
    )
    assert len(out) == 0 and out.meta["episodes_dropped"] > 0
    kept = model_rollout(model, KnownHopperPolicy(), starts, horizon=2)
    assert np.diff(kept.episode_bounds()).max() <= 2 and kept.meta["episodes_dropped"] == 0
