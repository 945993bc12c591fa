"""IQL: its losses by hand, the actor's std and schedule, reward scaling, CLI and workflow.

The generic learner checks (finite metrics, round trips, all-ones weights, seeds, the training
loop) run for IQL in ``test_shared.py``; here are the checks specific to IQL.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from offaug.algorithms.learners.iql import (
    IQL,
    IQLConfig,
    advantage_weights,
    awr_actor_loss,
    cosine_rate,
    expectile_loss,
    gaussian_log_prob,
)
from offaug.algorithms.normalisation import return_range, reward_scale
from offaug.algorithms.training.batches import make_sampler
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.cli import app
from offaug.datasets import MixtureSampler, Transitions, load_transitions
from tests.algorithms.learner_stages import SMALL, sample_batches, spaces_of, train_and_diagnose


def _trainer(data: Transitions, seed: int = 0, **overrides: object) -> IQL:
    torch.manual_seed(seed)
    config = dataclasses.replace(IQLConfig(), **{**SMALL, **overrides})
    return IQL(spaces_of(data), config, device="cpu")


def test_expectile_loss_against_a_hand_computation() -> None:
    difference = torch.tensor([2.0, -1.0])
    # tau = 0.7: 0.7 * 4 and 0.3 * 1, mean 1.55.
    assert expectile_loss(difference, 0.7, None).item() == pytest.approx(1.55)
    # tau = 0.5 is half the squared error.
    assert expectile_loss(difference, 0.5, None).item() == pytest.approx(0.5 * 2.5)
    weights = torch.tensor([0.0, 2.0])
    assert expectile_loss(difference, 0.7, weights).item() == pytest.approx(0.3)


def test_expectile_loss_minimiser_is_the_expectile() -> None:
    # Minimising over a constant V gives the tau-expectile of the samples; tau=0.5 the mean.
    samples = torch.tensor([0.0, 1.0, 5.0])
    for tau in (0.5, 0.9):
        value = torch.zeros((), requires_grad=True)
        optimizer = torch.optim.SGD([value], lr=0.1)
        for _ in range(2000):
            optimizer.zero_grad()
            expectile_loss(samples - value, tau, None).backward()
            optimizer.step()
        # The expectile m solves tau * sum_{x>m}(x - m) = (1 - tau) * sum_{x<m}(m - x).
        above = (samples - value.detach()).clamp_min(0).sum()
        below = (value.detach() - samples).clamp_min(0).sum()
        assert (tau * above).item() == pytest.approx(((1 - tau) * below).item(), abs=1e-3)
    assert value.item() > samples.mean().item()  # tau 0.9 sits above the mean


def test_advantage_weights_and_actor_loss() -> None:
    advantage = torch.tensor([0.0, 1.0, 10.0], requires_grad=True)
    weights = advantage_weights(advantage, beta=3.0, max_weight=100.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, math.exp(3.0), 100.0]))
    assert not weights.requires_grad
    log_prob = torch.tensor([-1.0, -2.0, 0.5])
    expected = -(1.0 * -1.0 + math.exp(3.0) * -2.0 + 100.0 * 0.5) / 3
    assert awr_actor_loss(log_prob, weights, None).item() == pytest.approx(expected, rel=1e-6)


def test_gaussian_log_prob_matches_torch_distributions() -> None:
    torch.manual_seed(0)
    mean, log_std, actions = torch.randn(4, 3), torch.randn(4, 3) * 0.5, torch.randn(4, 3)
    expected = torch.distributions.Normal(mean, log_std.exp()).log_prob(actions).sum(-1)
    torch.testing.assert_close(gaussian_log_prob(actions, mean, log_std), expected)


def test_cosine_rate_runs_from_the_initial_rate_to_zero() -> None:
    assert cosine_rate(3e-4, 0, 100) == pytest.approx(3e-4)
    assert cosine_rate(3e-4, 50, 100) == pytest.approx(1.5e-4)
    assert cosine_rate(3e-4, 100, 100) == pytest.approx(0.0)
    assert cosine_rate(3e-4, 500, 100) == pytest.approx(0.0)


def test_actor_learning_rate_follows_the_schedule(hopper: Transitions) -> None:
    trainer = _trainer(hopper, actor_lr_decay_steps=4)
    for batch in sample_batches(hopper, 3):
        trainer.update(batch)
    # The third step (steps = 2) ran at half the initial rate.
    assert trainer.actor_optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-4)
    constant = _trainer(hopper, actor_lr_schedule="constant", actor_lr_decay_steps=4)
    for batch in sample_batches(hopper, 3):
        constant.update(batch)
    assert constant.actor_optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_log_std_choices(hopper: Transitions) -> None:
    fixed = _trainer(hopper)
    assert fixed.actor.log_std is not None and fixed.actor.log_std.shape == (3,)
    learned = _trainer(hopper, log_std="learned")
    assert learned.actor.log_std is None
    obs = torch.tensor(np.asarray(hopper.observations[:4]))
    _, log_std = learned.actor.mean_log_std(obs)
    assert log_std.shape == (4, 3)
    for batch in sample_batches(hopper, 2):
        metrics = learned.update(batch)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_reward_scale_is_1000_over_the_return_range(hopper: Transitions) -> None:
    sampler = MixtureSampler([hopper], 32)
    returns = [float(np.sum(e.rewards, dtype=np.float64)) for e in hopper.iter_episodes()]
    assert return_range(sampler) == pytest.approx(max(returns) - min(returns))
    assert reward_scale(sampler) == pytest.approx(1000.0 / (max(returns) - min(returns)))
    trainer = _trainer(hopper)
    make_sampler(trainer, [hopper])
    assert trainer.reward_scale == pytest.approx(reward_scale(sampler))
    unscaled = _trainer(hopper, reward_normalisation="none")
    make_sampler(unscaled, [hopper])
    assert unscaled.reward_scale == 1.0


def test_q_values_are_in_the_data_reward_units(hopper: Transitions) -> None:
    trainer = _trainer(hopper)
    trainer.reward_scale = 4.0
    obs, actions = hopper.observations[:6], hopper.actions[:6]
    with torch.no_grad():
        standardised = trainer.observation_normaliser(torch.tensor(np.asarray(obs)))
        normalised = trainer.normaliser(torch.tensor(np.asarray(actions)))
        raw = trainer.critic(standardised, normalised).min(0).values.numpy()
    np.testing.assert_allclose(trainer.q_values(obs, actions), raw / 4.0, rtol=1e-6)


def test_critic_target_is_r_plus_gamma_v_next(hopper: Transitions) -> None:
    """With expectile 0.5, the value loss is half the squared error to the target Q."""
    trainer = _trainer(hopper, expectile=0.5, reward_normalisation="none")
    batch = sample_batches(hopper, 1)[0]
    losses = trainer.losses(batch)
    with torch.no_grad():
        q_target = trainer.critic_target(batch.observations, batch.actions).min(0).values
        value = trainer.value(batch.observations).squeeze(-1)
        next_value = trainer.value(batch.next_observations).squeeze(-1)
        target = batch.rewards + 0.99 * (1 - batch.terminals) * next_value
        q = trainer.critic(batch.observations, batch.actions)
    torch.testing.assert_close(losses.value, 0.5 * (q_target - value).pow(2).mean())
    torch.testing.assert_close(losses.critic, (q - target).pow(2).sum(0).mean())


def test_cli_trains_iql(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "iql.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 32\nlog_std: learned\n")
    out = tmp_path / "run"
    args = ["train", "iql", dataset, "--steps", "10", "--log-every", "5", "--eval-every", "0"]
    result = CliRunner().invoke(app, [*args, "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["config"]["log_std"] == "learned" and recorded["config"]["expectile"] == 0.7
    restored = load_trainer(out / "checkpoint.pt")
    assert isinstance(restored, IQL)
    assert restored.reward_scale == pytest.approx(
        reward_scale(MixtureSampler([load_transitions(dataset)], 8))
    )
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"value_loss", "critic_loss", "actor_loss", "advantage", "q_data"} <= set(line)


def test_an_expectile_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="expectile"):
        IQLConfig(expectile=1.0)


def test_workflow_stages_train_and_diagnose_iql(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    part = train_and_diagnose("iql", {"hidden": [32, 32], "batch_size": 32}, dataset, tmp_path)
    assert part["name"] == "iql-original"
    assert part["value"] is not None and part["ope"] is not None
