"""The learned-dynamics ensemble and its MOPO and MOBILE rollouts on a real Hopper dataset."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from offaug.datasets import load_transitions
from offaug.pipeline.models.dynamics import (
    DynamicsConfig,
    DynamicsEnsemble,
    dataset_statistics,
    load_dynamics,
    mobile_penalty,
    save_dynamics,
    train_dynamics,
)
from offaug.pipeline.rollouts.model_rollouts import model_rollout
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.references import DiscountedValue
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow
from tests.pipeline.test_rollout import KnownHopperPolicy

CONFIG = DynamicsConfig(members=4, hidden=(64, 64), steps=250, horizon=5, seed=0)


@pytest.fixture(scope="module")
def trained(make_test_dataset) -> tuple[Any, Any]:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    model, _ = train_dynamics(data, CONFIG)
    return data, model


def test_model_beats_predicting_no_change(trained) -> None:
    """expected_step (the members' mean prediction) beats "nothing moves" and "the mean
    reward" on the data it learned."""
    data, model = trained
    obs, actions = np.array(data.observations[:300]), np.array(data.actions[:300])
    next_obs, rewards = model.expected_step(obs, actions)
    assert next_obs.shape == obs.shape and rewards.shape == (300,)
    true_next, true_rewards = np.array(data.next_observations[:300]), np.array(data.rewards[:300])
    assert np.mean((next_obs - true_next) ** 2) < 0.5 * np.mean((obs - true_next) ** 2)
    reward_spread = np.mean((true_rewards - data.rewards.mean()) ** 2)
    assert np.mean((rewards - true_rewards) ** 2) < 0.5 * reward_spread


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
        out.extras["raw_reward"] - CONFIG.penalty_coefficient * out.extras["model_uncertainty"],
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


def test_mobile_penalty_is_the_members_std_of_their_mean_bellman_targets() -> None:
    # Two draws (S) of three members (E) at one state (B = 1); gamma 0.5.
    rewards = torch.tensor([[[1.0], [0.0], [2.0]], [[3.0], [0.0], [2.0]]])
    next_values = torch.tensor([[[2.0], [4.0], [0.0]], [[2.0], [0.0], [4.0]]])
    # Targets r + 0.5 V: member 0: 2, 4 -> 3; member 1: 2, 0 -> 1; member 2: 2, 4 -> 3.
    # Mean 7/3; unbiased variance ((2/3)^2 + (4/3)^2 + (2/3)^2) / 2 = 4/3.
    penalty = mobile_penalty(rewards, next_values, gamma=0.5)
    assert penalty.shape == (1,)
    assert penalty.item() == pytest.approx(math.sqrt(4 / 3), rel=1e-6)


def _toy_ensemble(biases: list[list[float]], samples: int) -> DynamicsEnsemble:
    """Members that predict constant (delta s, r) = their bias, with a vanishing variance."""
    obs_dim = len(biases[0]) - 1
    target = obs_dim + 1
    stats = {
        "input_mean": np.zeros(obs_dim + 1),
        "input_std": np.ones(obs_dim + 1),
        "target_mean": np.zeros(target),
        "target_std": np.ones(target),
        "observation_low": np.full(obs_dim, -10.0),
        "observation_high": np.full(obs_dim, 10.0),
    }
    config = DynamicsConfig(
        members=len(biases), hidden=(), penalty="mobile", mobile_samples=samples
    )
    model = DynamicsEnsemble(obs_dim, 1, config, stats)
    with torch.no_grad():
        (layer,) = model.net.layers
        layer.weight.zero_()
        layer.bias.zero_()
        layer.bias[:, 0, :target] = torch.tensor(biases)
        # Both log-variance bounds far down: std ~ exp(-20), draws equal the means.
        layer.bias[:, 0, target : 2 * target] = -40.0
        model.max_log_var.fill_(-40.0)
        model.min_log_var.fill_(-40.0)
    return model


def test_mobile_penalty_of_a_toy_ensemble_equals_the_hand_computation() -> None:
    # Three members over a 2-d state: (delta s_1, delta s_2, r).
    model = _toy_ensemble([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [-1.0, 0.0, 2.0]], samples=3)
    value = DiscountedValue(lambda s: s.sum(axis=1), gamma=0.5)  # V(s) = s_1 + s_2
    state = torch.tensor([[1.0, 1.0]])
    penalty = model.bellman_inconsistency(
        state, torch.zeros(1, 1), value, torch.Generator().manual_seed(0)
    )
    # s'_k = (2, 1), (1, 3), (0, 1); targets r_k + V(s'_k) / 2: 1.5, 3.0, 2.5; mean 7/3;
    # unbiased variance ((5/6)^2 + (2/3)^2 + (1/6)^2) / 2 = 7/12.
    assert penalty.item() == pytest.approx(math.sqrt(7 / 12), rel=1e-5)


def test_mobile_rollouts_penalise_by_the_bellman_inconsistency(trained) -> None:
    data, model = trained
    mobile = copy.copy(model)
    mobile.config = dataclasses.replace(
        model.config, penalty="mobile", penalty_coefficient=0.5, mobile_samples=2
    )
    starts = np.array(data.observations[::20])
    with pytest.raises(ValueError, match="MOBILE's penalty needs a value function"):
        model_rollout(mobile, KnownHopperPolicy(), starts)
    # A real value of the data's scale: the discounted sum of a reward of the first state dim.
    value = DiscountedValue(lambda s: 10.0 * np.tanh(s[:, 0]), gamma=0.99)
    out = model_rollout(mobile, KnownHopperPolicy(), starts, value=value)
    assert out.meta["penalty"] == "mobile" and len(out) > 0
    uncertainty = out.extras["model_uncertainty"]
    assert (uncertainty > 0).all()
    np.testing.assert_allclose(
        out.rewards, out.extras["raw_reward"] - 0.5 * uncertainty, rtol=1e-5, atol=1e-5
    )
    # A constant V leaves only the members' reward spread; the first step (row 0, drawn before
    # any of MOBILE's draws) is the same model step in both.
    flat = DiscountedValue(lambda s: np.zeros(len(s)), gamma=0.99)
    reward_only = model_rollout(mobile, KnownHopperPolicy(), starts, value=flat)
    np.testing.assert_array_equal(reward_only.next_observations[0], out.next_observations[0])
    assert 0 < reward_only.extras["model_uncertainty"][0] != pytest.approx(uncertainty[0])


def _workflow(tmp_path: Path, rollout: dict[str, Any]) -> Path:
    path = tmp_path / "workflow.yaml"
    document = {"name": "w", "source": {"dataset": "a/b-v0"}, "rollout": rollout}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_mobile_needs_a_learner_with_a_value_as_the_rollout_policy(tmp_path: Path) -> None:
    rollout: dict[str, Any] = {"backend": "model", "dynamics": {"penalty": "mobile"}}
    with pytest.raises(WorkflowError, match=r"the BC clone has no critic.*'mobile' needs"):
        load_workflow(_workflow(tmp_path, rollout))
    with pytest.raises(WorkflowError, match=r"bcq.*Use one of: .*td3bc"):
        load_workflow(_workflow(tmp_path, {**rollout, "policy": "bcq"}))
    workflow = load_workflow(_workflow(tmp_path, {**rollout, "policy": "td3bc"}))
    assert workflow.rollout.dynamics.penalty == "mobile"


def test_a_number_as_the_penalty_is_mopos_lambda(tmp_path: Path) -> None:
    workflow = load_workflow(
        _workflow(tmp_path, {"backend": "model", "dynamics": {"penalty": 0.25}})
    )
    assert workflow.rollout.dynamics.penalty == "mopo"
    assert workflow.rollout.dynamics.penalty_coefficient == 0.25


def test_the_search_in_the_model_commits_the_mean_prediction_and_never_loses(trained) -> None:
    from offaug.pipeline.rollouts.config import Lookahead, RolloutConfig
    from offaug.pipeline.rollouts.model_rollouts import model_lookahead_rollout

    data, model = trained
    starts = np.asarray(data.observations, dtype=np.float32)
    config = RolloutConfig(
        episodes=4,
        n_envs=4,
        noise=parse_noise("gaussian:0.3"),
        seed=0,
        horizon=12,
        lookahead=Lookahead(candidates=4, window=3, depth=None),
    )
    out = model_lookahead_rollout(model, KnownHopperPolicy(), config, starts)
    tr = out.transitions
    assert (tr.source == 2).all() and out.simulator_steps == 0
    assert tr.meta["model_steps"] > len(tr) and tr.meta["penalty"] == "mopo"
    # Every committed step is the members' mean prediction, its reward penalised.
    next_obs, reward, _, uncertainty = model.mean_step(
        torch.as_tensor(tr.observations), torch.as_tensor(tr.actions)
    )
    np.testing.assert_allclose(tr.next_observations, next_obs.numpy(), atol=1e-4)
    penalised = reward.numpy() - CONFIG.penalty_coefficient * uncertainty.numpy()
    np.testing.assert_allclose(tr.rewards, penalised, rtol=1e-4, atol=1e-4)
    for episode in tr.iter_episodes():
        assert len(episode) <= 12
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
    # The model is deterministic here and the depth runs to the end: never below the policy.
    record = out.filter_record
    assert record is not None
    for score, reference in zip(record.scores, record.references, strict=True):
        assert score >= reference - 1e-3
    with pytest.raises(ValueError, match=r"needs rollout\.horizon"):
        model_lookahead_rollout(
            model, KnownHopperPolicy(), dataclasses.replace(config, horizon=None), starts
        )


def test_a_lookahead_in_the_model_needs_a_horizon() -> None:
    from pydantic import ValidationError

    from offaug.pipeline.schema.rollout_section import RolloutModel

    RolloutModel(backend="model", lookahead={}, horizon=50)
    with pytest.raises(ValidationError, match=r"set rollout.horizon"):
        RolloutModel(backend="model", lookahead={})


def test_model_envs_stepped_together_equal_each_stepped_alone(trained) -> None:
    from offaug.pipeline.rollouts.model_rollouts import ModelBoundsExit, ModelEnv

    data, model = trained
    starts = np.asarray(data.observations[:5], dtype=np.float32)
    actions = np.array(data.actions[:5], dtype=np.float32)
    actions[4] = 1e6  # far outside anything seen: the model's step leaves the data's bounds
    together = [ModelEnv(model, starts[b : b + 1]) for b in range(5)]
    alone = [ModelEnv(model, starts[b : b + 1]) for b in range(5)]
    for env in (*together, *alone):
        env.reset(seed=0)
    outcomes = ModelEnv.step_batch(together, actions)
    for b in range(4):
        outcome = outcomes[b]
        assert not isinstance(outcome, Exception)
        observation, reward, terminated, _, _ = alone[b].step(actions[b])
        np.testing.assert_allclose(outcome[0], observation, atol=1e-5)
        assert outcome[1] == pytest.approx(reward, abs=1e-5) and outcome[2] == terminated
        np.testing.assert_allclose(together[b].state, alone[b].state, atol=1e-5)
    assert isinstance(outcomes[4], ModelBoundsExit)
    np.testing.assert_array_equal(together[4].state, starts[4].astype(np.float64))
    with pytest.raises(ModelBoundsExit):
        alone[4].step(actions[4])
    with pytest.raises(ValueError, match="one model"):
        other = ModelEnv(copy.copy(model), starts[:1])
        ModelEnv.step_batch([together[0], other], actions[:2])
