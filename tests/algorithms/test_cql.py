"""CQL (continuous and discrete): losses, weights, checkpoints, determinism and behaviour.

The generic learner checks (finite metrics, round trips, all-ones weights, seeds, the training
loop) also run for CQL in ``test_shared.py``; here are the checks specific to CQL's math.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from offaug.algorithms import registry
from offaug.algorithms.base import Spaces, config_from_json, spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.fusing import Draws
from offaug.algorithms.learners.cql import CQL, CQLConfig
from offaug.algorithms.learners.cql_losses import alpha_loss, conservative_gap, conservative_penalty
from offaug.algorithms.learners.discrete_cql import (
    DiscreteCQL,
    DiscreteCQLConfig,
    discrete_conservative_loss,
    discrete_td_loss,
)
from offaug.algorithms.learners.losses import ensemble_td_loss, soft_actor_loss, temperature_loss
from offaug.algorithms.nn.distributions import tanh_gaussian
from offaug.algorithms.normalisation import observation_moments
from offaug.algorithms.training.batches import make_sampler
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import MixtureSampler, Transitions, load_transitions

SMALL = {"hidden": (32, 32), "batch_size": 64, "n_action_samples": 4}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cartpole(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id)


def _spaces(data: Transitions) -> Spaces:
    return spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)


def _cql(data: Transitions, seed: int = 0, **overrides: object) -> CQL:
    torch.manual_seed(seed)
    config = dataclasses.replace(CQLConfig(), **{**SMALL, **overrides})
    return CQL(_spaces(data), config, device="cpu")


def _batches(data: Transitions, n: int, size: int = 64, seed: int = 0) -> list[TorchBatch]:
    sampler = MixtureSampler([data], size, seed=seed)
    return [TorchBatch.from_batch(sampler.sample()) for _ in range(n)]


def _tensors(state: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


# -- configuration ---------------------------------------------------------------------------


def test_defaults_are_d3rlpys() -> None:
    config = CQLConfig()
    assert (config.actor_learning_rate, config.critic_learning_rate) == (1e-4, 3e-4)
    assert (config.temp_learning_rate, config.alpha_learning_rate) == (1e-4, 1e-4)
    assert (config.batch_size, config.gamma, config.tau, config.n_critics) == (256, 0.99, 0.005, 2)
    assert (config.initial_temperature, config.initial_alpha) == (1.0, 1.0)
    assert (config.alpha_threshold, config.conservative_weight) == (10.0, 5.0)
    assert config.n_action_samples == 10 and config.backup == "mean" and config.lagrange
    discrete = DiscreteCQLConfig()
    assert (discrete.learning_rate, discrete.batch_size, discrete.n_critics) == (6.25e-5, 32, 1)
    assert (discrete.target_update_interval, discrete.alpha, discrete.td_loss) == (
        8000,
        1.0,
        "huber",
    )


def test_backup_choices_are_exclusive_and_json_round_trips() -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        CQLConfig(soft_q_backup=True, max_q_backup=True)
    assert CQLConfig(soft_q_backup=True).backup == "soft"
    assert CQLConfig(max_q_backup=True).backup == "max"
    config = CQLConfig(hidden=(64, 64), lagrange=False)
    data = json.loads(json.dumps(dataclasses.asdict(config)))
    assert config_from_json(registry.config_type("cql"), data) == config


# -- pieces against their references ---------------------------------------------------------


def test_conservative_gap_is_the_importance_sampled_logsumexp() -> None:
    q_data = torch.tensor([[1.0, 2.0]])  # (E=1, B=2)
    q_sampled = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])  # (E=1, S=2, B=2)
    log_density = torch.tensor([[0.5, 0.5], [-1.0, -1.0]])  # (S=2, B=2)
    gap = conservative_gap(q_data, q_sampled, log_density)
    expected = [
        math.log(math.exp(0.0 - 0.5) + math.exp(2.0 + 1.0)) - 1.0,
        math.log(math.exp(1.0 - 0.5) + math.exp(3.0 + 1.0)) - 2.0,
    ]
    torch.testing.assert_close(gap, torch.tensor([expected]))


def test_alpha_loss_raises_alpha_only_above_the_threshold() -> None:
    log_alpha = torch.zeros((), requires_grad=True)
    gap = torch.full((2, 4), 12.0)
    alpha_loss(log_alpha, gap, None, 5.0, 10.0).backward()
    assert log_alpha.grad is not None and log_alpha.grad < 0  # descent raises alpha
    log_alpha.grad = None
    alpha_loss(log_alpha, gap - 4.0, None, 5.0, 10.0).backward()
    assert log_alpha.grad is not None and log_alpha.grad > 0


# -- weights ---------------------------------------------------------------------------------


def test_pure_losses_with_all_ones_weights_equal_the_unweighted_losses() -> None:
    torch.manual_seed(0)
    e, s, b = 2, 6, 8
    q_data, q_sampled = torch.randn(e, b), torch.randn(e, s, b)
    log_density, log_prob = torch.randn(s, b), torch.randn(b)
    target, ones = torch.randn(b), torch.ones(b)
    log_param = torch.tensor(0.3)
    gap = conservative_gap(q_data, q_sampled, log_density)
    pairs = [
        (ensemble_td_loss(q_data, target, None), ensemble_td_loss(q_data, target, ones)),
        (conservative_penalty(gap, None, 5.0, 10.0), conservative_penalty(gap, ones, 5.0, 10.0)),
        (alpha_loss(log_param, gap, None, 5.0, 10.0), alpha_loss(log_param, gap, ones, 5.0, 10.0)),
        (
            soft_actor_loss(q_data, log_prob, log_param, None),
            soft_actor_loss(q_data, log_prob, log_param, ones),
        ),
        (
            temperature_loss(log_param, log_prob, -3.0, None),
            temperature_loss(log_param, log_prob, -3.0, ones),
        ),
        (discrete_td_loss(q_data, target, None), discrete_td_loss(q_data, target, ones)),
        (
            discrete_td_loss(q_data, target, None, "mse"),
            discrete_td_loss(q_data, target, ones, "mse"),
        ),
    ]
    for unweighted, weighted in pairs:
        assert torch.equal(unweighted, weighted)


def test_weights_reweight_both_td_and_conservative_terms_per_sample() -> None:
    # Weight 2 on the first half and 0 on the second is the plain mean over the first half.
    torch.manual_seed(0)
    e, s, b = 2, 6, 8
    q_data, q_sampled, log_density = torch.randn(e, b), torch.randn(e, s, b), torch.randn(s, b)
    target = torch.randn(b)
    weights = torch.cat([torch.full((b // 2,), 2.0), torch.zeros(b // 2)])
    half = slice(0, b // 2)
    torch.testing.assert_close(
        ensemble_td_loss(q_data, target, weights),
        ensemble_td_loss(q_data[:, half], target[half], None),
    )
    gap = conservative_gap(q_data, q_sampled, log_density)
    torch.testing.assert_close(
        conservative_penalty(gap, weights, 5.0, 10.0),
        conservative_penalty(gap[:, half], None, 5.0, 10.0),
    )


def test_trainer_losses_with_all_ones_weights_equal_the_unweighted_losses(hopper) -> None:
    batch = _batches(hopper, 1)[0]
    trainer = _cql(hopper)
    torch.manual_seed(1)
    weighted = trainer.losses(dataclasses.replace(batch, weights=torch.ones(64)))
    torch.manual_seed(1)
    unweighted = trainer.losses(dataclasses.replace(batch, weights=None))  # type: ignore[arg-type]
    for field in dataclasses.fields(weighted):
        assert torch.equal(getattr(weighted, field.name), getattr(unweighted, field.name))


# -- training --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"lagrange": False}, {"soft_q_backup": True}, {"max_q_backup": True}, {"n_critics": 3}],
    ids=["lagrange", "fixed-alpha", "soft-backup", "max-backup", "three-critics"],
)
def test_updates_give_finite_scalar_metrics(hopper, overrides: dict[str, object]) -> None:
    trainer = _cql(hopper, **overrides)
    for batch in _batches(hopper, 3):
        metrics = trainer.update(batch)
    assert {"critic_loss", "td_loss", "conservative_loss", "actor_loss", "alpha"} <= set(metrics)
    assert ("alpha_loss" in metrics) == trainer.config.lagrange
    for name, value in metrics.items():
        assert value.shape == () and not value.requires_grad, name
        assert torch.isfinite(value), name
    assert trainer.steps == 3
    actions = trainer.act(hopper.observations[:5])
    low, high = np.asarray(trainer.spaces.action_low), np.asarray(trainer.spaces.action_high)
    assert actions.shape == (5, 3) and np.all(actions >= low) and np.all(actions <= high)


def test_state_dict_round_trip_gives_identical_outputs(hopper) -> None:
    trainer = _cql(hopper, seed=1)
    for batch in _batches(hopper, 3):
        trainer.update(batch)
    fresh = _cql(hopper, seed=2)
    fresh.load_state_dict(trainer.state_dict())
    obs, actions = hopper.observations[:16], hopper.actions[:16]
    np.testing.assert_array_equal(fresh.act(obs), trainer.act(obs))
    np.testing.assert_array_equal(fresh.q_values(obs, actions), trainer.q_values(obs, actions))
    assert fresh.steps == trainer.steps
    for a, b in zip(_tensors(fresh.state_dict()), _tensors(trainer.state_dict()), strict=True):
        assert torch.equal(a, b)


def test_same_seed_gives_identical_parameters(hopper) -> None:
    runs = []
    for _ in range(2):
        trainer = _cql(hopper, seed=3)
        torch.manual_seed(4)
        for batch in _batches(hopper, 4, seed=5):
            trainer.update(batch)
        runs.append(_tensors(trainer.state_dict()))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _q_data_minus_random(trainer: CQL, data: Transitions) -> float:
    rng = np.random.default_rng(0)
    obs = data.observations[:512]
    low, high = np.asarray(trainer.spaces.action_low), np.asarray(trainer.spaces.action_high)
    random_actions = rng.uniform(low, high, size=(len(obs), len(low))).astype(np.float32)
    q_data = trainer.q_values(obs, data.actions[:512])
    q_random = trainer.q_values(obs, random_actions)
    return float(np.mean(q_data - q_random))


def test_conservative_penalty_pushes_random_actions_below_data_actions(make_test_dataset) -> None:
    # The test data are uniform random actions, so data and random actions are alike; the
    # behaviour data of a fixed, narrow policy make the check meaningful: a Gaussian around 0.
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    rng = np.random.default_rng(0)
    narrow = np.clip(0.1 * rng.standard_normal(data.actions.shape), -1, 1).astype(np.float32)
    data = dataclasses.replace(data, actions=narrow)
    margins = {}
    for weight in (0.0, 5.0):
        trainer = _cql(
            data, seed=0, conservative_weight=weight, lagrange=False, critic_learning_rate=1e-3
        )
        sampler = MixtureSampler([data], 64, seed=0)
        for _ in range(200):
            trainer.update(TorchBatch.from_batch(sampler.sample()))
        margins[weight] = _q_data_minus_random(trainer, data)
    # Measured margins: about 0.0 without the penalty and 4 to 7 with it (seeds 0 to 3).
    assert abs(margins[0.0]) < 0.5
    assert margins[5.0] > 1.5


def test_lagrange_variant_tunes_alpha_and_the_fixed_variant_does_not(hopper) -> None:
    batches = _batches(hopper, 5)
    tuned, fixed = _cql(hopper, lagrange=True), _cql(hopper, lagrange=False)
    for batch in batches:
        tuned_metrics = tuned.update(batch)
        fixed_metrics = fixed.update(batch)
    # At initialisation the gap is far below the threshold of 10, so alpha shrinks.
    assert float(tuned_metrics["gap"]) < 10.0
    assert float(tuned.log_alpha.detach()) < 0.0
    assert float(tuned_metrics["alpha"]) < 1.0
    assert float(fixed.log_alpha.detach()) == 0.0 and float(fixed_metrics["alpha"]) == 1.0


def test_bc_warm_start_clones_the_data_then_follows_q(hopper) -> None:
    """During ``bc_steps`` the actor's loss is ``temperature * log pi(a~|s) - log pi(a|s)`` with
    the data's action ``a``; after them it is SAC's loss against the critics again."""
    batch = _batches(hopper, 1)[0]
    warm, plain = _cql(hopper, seed=1, bc_steps=2), _cql(hopper, seed=1)
    assert [warm.schedule(step, {"gamma": 0.99}) for step in (0, 1, 2)] == [
        {"bc_phase": 1.0},
        {"bc_phase": 1.0},
        {"bc_phase": 0.0},
    ]
    assert plain.schedule(0, {"gamma": 0.99}) == {}
    noise = warm.draw_noise(64, Draws(torch.device("cpu")))
    cloning = warm.losses(batch, noise).actor
    # By hand: the actor's density at the data's (normalised) action and at its own sample 0.
    obs, temperature = batch.observations, warm.log_temperature.detach().exp()
    mean, log_std = warm.actor.mean_log_std(obs)
    _, log_prob = tanh_gaussian(mean, log_std, noise["policy"][0, :64])
    data_log_prob = warm.actor.log_prob(obs, warm.normaliser(batch.actions))
    expected = (temperature * log_prob - data_log_prob).mean()
    torch.testing.assert_close(cloning, expected)
    warm.steps = 2
    torch.testing.assert_close(warm.losses(batch, noise).actor, plain.losses(batch, noise).actor)


def test_bc_warm_start_moves_the_policy_to_the_data_actions(hopper) -> None:
    # Without the penalty the critics alone give the actor no reason to pick the data's
    # actions, so only the warm start brings it to them.
    rng = np.random.default_rng(0)
    narrow = np.clip(0.5 + 0.05 * rng.standard_normal(hopper.actions.shape), -1, 1)
    data = dataclasses.replace(hopper, actions=narrow.astype(np.float32))
    distances = {}
    for bc_steps in (0, 300):
        trainer = _cql(data, bc_steps=bc_steps, actor_learning_rate=1e-3, conservative_weight=0.0)
        sampler = MixtureSampler([data], 64, seed=0)
        for _ in range(300):
            trainer.update(TorchBatch.from_batch(sampler.sample()))
        distances[bc_steps] = float(np.abs(trainer.act(data.observations[:256]) - 0.5).mean())
    # Measured: 0.42 without the warm start, 0.04 with it.
    assert distances[300] < 0.1 < distances[0]


def test_observation_normalisation_is_taken_once_and_applied_everywhere(hopper) -> None:
    trainer = _cql(hopper, normalise_observations=True)
    make_sampler(trainer, [hopper])
    mean, std = observation_moments(MixtureSampler([hopper], 32))
    torch.testing.assert_close(trainer.observation_normaliser.mean, torch.from_numpy(mean))
    torch.testing.assert_close(trainer.observation_normaliser.std, torch.from_numpy(std))
    for batch in _batches(hopper, 3):
        trainer.update(batch)
    obs, actions = hopper.observations[:8], hopper.actions[:8]
    standardised = (torch.tensor(np.asarray(obs)) - torch.from_numpy(mean)) / torch.from_numpy(std)
    with torch.no_grad():
        expected = trainer.normaliser.inverse(trainer.actor.deterministic(standardised))
        q = trainer.critic(standardised, trainer.normaliser(torch.tensor(np.asarray(actions))))
    np.testing.assert_array_equal(trainer.act(obs), expected.numpy())
    np.testing.assert_allclose(trainer.q_values(obs, actions), q.min(0).values.numpy(), atol=1e-6)
    # The moments travel in the checkpoint, so a restored trainer acts the same without data.
    fresh = _cql(hopper, seed=9, normalise_observations=True)
    fresh.load_state_dict(trainer.state_dict())
    np.testing.assert_array_equal(fresh.act(obs), trainer.act(obs))


def test_observations_stay_raw_by_default_and_old_checkpoints_load(hopper) -> None:
    trainer = _cql(hopper)
    make_sampler(trainer, [hopper])
    assert torch.equal(trainer.observation_normaliser.std, torch.ones(hopper.observations.shape[1]))
    # A checkpoint written before observation normalisation existed: the identity.
    state = trainer.state_dict()
    del state["observation_normaliser"]
    fresh = _cql(hopper, seed=9, normalise_observations=True)
    fresh.observation_normaliser.set_moments(
        np.full(hopper.observations.shape[1], 5.0, np.float32),
        np.full(hopper.observations.shape[1], 2.0, np.float32),
    )
    fresh.load_state_dict(state)
    obs = hopper.observations[:8]
    np.testing.assert_array_equal(fresh.act(obs), trainer.act(obs))


def test_continuous_cql_refuses_discrete_actions(cartpole) -> None:
    with pytest.raises(ValueError, match="DiscreteCQL"):
        CQL(_spaces(cartpole), device="cpu")
    with pytest.raises(ValueError, match="continuous"):
        DiscreteCQL(Spaces(3, 2), device="cpu")


# -- discrete --------------------------------------------------------------------------------


def _discrete(data: Transitions, seed: int = 0, **overrides: object) -> DiscreteCQL:
    torch.manual_seed(seed)
    config = DiscreteCQLConfig(hidden=(32, 32), **overrides)  # type: ignore[arg-type]
    return DiscreteCQL(_spaces(data), config, device="cpu")


def test_discrete_cql_trains_acts_and_round_trips(cartpole) -> None:
    trainer = _discrete(cartpole, target_update_interval=2, n_critics=2)
    for step, batch in enumerate(_batches(cartpole, 4, size=32)):
        metrics = trainer.update(batch)
        # The target is copied after the updates that start at steps 0, 2, ...
        synced = all(
            torch.equal(a, b)
            for a, b in zip(
                trainer.critic.parameters(), trainer.critic_target.parameters(), strict=True
            )
        )
        assert synced == (step % 2 == 0)
    for name, value in metrics.items():
        assert torch.isfinite(value), name
    obs = cartpole.observations[:20]
    actions = trainer.act(obs)
    assert actions.dtype == np.int64 and actions.shape == (20,)
    assert set(actions.tolist()) <= {0, 1}
    q = trainer.q_values(obs, cartpole.actions[:20])
    assert q.shape == (20,) and np.isfinite(q).all()
    fresh = _discrete(cartpole, seed=9, target_update_interval=2, n_critics=2)
    fresh.load_state_dict(trainer.state_dict())
    np.testing.assert_array_equal(fresh.act(obs), actions)
    np.testing.assert_array_equal(fresh.q_values(obs, cartpole.actions[:20]), q)


def test_discrete_conservative_loss_prefers_the_data_action() -> None:
    q_values = torch.tensor([[[3.0, 0.0], [0.0, 3.0]]])  # (E=1, B=2, n_actions=2)
    best = torch.tensor([[3.0, 3.0]])
    worst = torch.tensor([[0.0, 0.0]])
    assert discrete_conservative_loss(q_values, best, None) < discrete_conservative_loss(
        q_values, worst, None
    )
    expected = math.log(math.exp(3.0) + 1.0) - 3.0
    torch.testing.assert_close(
        discrete_conservative_loss(q_values, best, None), torch.tensor(expected)
    )


# -- the training loop -----------------------------------------------------------------------


def test_training_loop_runs_cql_and_its_checkpoint_loads(make_test_dataset, tmp_path: Path) -> None:
    dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
    options = TrainOptions(
        steps=50, log_every=25, eval_every=50, eval_episodes=1, checkpoint_every=50, threads=1
    )
    config = {"hidden": [32, 32], "batch_size": 64, "n_action_samples": 4}
    result = train("cql", [dataset_id], tmp_path / "run", config=config, options=options)
    assert result.last_evaluation is not None
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    train_lines = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in train_lines] == [25, 50]
    assert all(math.isfinite(line["critic_loss"]) for line in train_lines)
    restored = load_trainer(result.checkpoint)
    assert isinstance(restored, CQL) and restored.steps == 50
    assert restored.config.hidden == (32, 32)
    data = load_transitions(dataset_id)
    assert restored.act(data.observations[:4]).shape == (4, 3)
    assert np.isfinite(restored.q_values(data.observations[:4], data.actions[:4])).all()
