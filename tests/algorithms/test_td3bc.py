"""TD3+BC: its losses by hand, the delayed actor, observation statistics, CLI and workflow.

The generic learner checks (finite metrics, round trips, all-ones weights, seeds, the training
loop) run for TD3+BC in ``test_shared.py``; here are the checks specific to TD3+BC.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from offaug.algorithms.learners.td3bc import (
    TD3BC,
    TD3BCConfig,
    q_normaliser,
    smoothed_actions,
    td3bc_actor_loss,
)
from offaug.algorithms.normalisation import (
    OBSERVATION_STD_EPSILON,
    ObservationNormaliser,
    observation_moments,
)
from offaug.algorithms.training.batches import make_sampler
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.cli import app
from offaug.datasets import MixtureSampler, Transitions, load_transitions
from tests.algorithms.learner_stages import SMALL, sample_batches, spaces_of, train_and_diagnose


@pytest.fixture
def hopper(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)


def _trainer(data: Transitions, seed: int = 0, **overrides: object) -> TD3BC:
    torch.manual_seed(seed)
    config = dataclasses.replace(TD3BCConfig(), **{**SMALL, **overrides})
    return TD3BC(spaces_of(data), config, device="cpu")


def test_smoothed_actions_clip_the_noise_then_the_box() -> None:
    actions = torch.tensor([[0.0, 0.9, -0.9]])
    noise = torch.tensor([[10.0, 1.0, -0.1]])
    out = smoothed_actions(actions, noise, sigma=0.2, clip=0.5)
    # 0 + min(2.0, 0.5); 0.9 + 0.2 -> clipped to 1; -0.9 - 0.02.
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.0, -0.92]]))


def test_actor_loss_against_a_hand_computation() -> None:
    q_policy = torch.tensor([2.0, -4.0])
    policy_actions = torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    actions = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    loss, behaviour = td3bc_actor_loss(q_policy, policy_actions, actions, 2.5, None)
    # lambda = 2.5 / mean(|2|, |-4|) = 2.5 / 3; mean Q = -1; BC = mean(0.125, 1.0) = 0.5625.
    assert behaviour.item() == pytest.approx(0.5625)
    assert loss.item() == pytest.approx(2.5 / 3 + 0.5625)
    assert q_normaliser(q_policy).item() == pytest.approx(1 / 3)
    weights = torch.tensor([2.0, 0.0])
    weighted, weighted_bc = td3bc_actor_loss(q_policy, policy_actions, actions, 2.5, weights)
    # The normaliser stays unweighted; both terms weighted: mean(2 * 2, 0) = 2; BC mean(0.25, 0).
    assert weighted_bc.item() == pytest.approx(0.125)
    assert weighted.item() == pytest.approx(-2.5 / 3 * 2.0 + 0.125)


def test_actor_and_targets_update_every_policy_freq_steps(hopper: Transitions) -> None:
    trainer = _trainer(hopper, policy_freq=2)
    batches = sample_batches(hopper, 3)
    snapshots = []
    for batch in batches:
        before = [p.detach().clone() for p in trainer.actor.parameters()]
        target_before = [p.detach().clone() for p in trainer.critic_target.parameters()]
        trainer.update(batch)
        actor_moved = any(
            not torch.equal(a, p) for a, p in zip(before, trainer.actor.parameters(), strict=True)
        )
        target_moved = any(
            not torch.equal(a, p)
            for a, p in zip(target_before, trainer.critic_target.parameters(), strict=True)
        )
        snapshots.append((actor_moved, target_moved))
    assert snapshots == [(True, True), (False, False), (True, True)]


def test_actor_step_leaves_the_critics_gradients_alone(hopper: Transitions) -> None:
    batch = sample_batches(hopper, 1)[0]
    grads = []
    for steps in (0, 1):  # an actor step (0 % 2 == 0), then a critic-only step
        trainer = _trainer(hopper, seed=3)
        trainer.steps = steps
        torch.manual_seed(4)
        trainer.update(batch)
        grads.append([p.grad.clone() for p in trainer.critic.parameters()])
        assert all(p.requires_grad for p in trainer.critic.parameters())
    for with_actor, critic_only in zip(*grads, strict=True):
        assert torch.equal(with_actor, critic_only)


def test_observation_moments_weight_each_set_by_its_share(hopper: Transitions) -> None:
    bounds = hopper.episode_bounds()
    half = hopper.slice(0, int(bounds[len(bounds) // 2]))
    sampler = MixtureSampler([hopper, half], 10, mixing=[0.3, 0.7])
    mean, std = observation_moments(sampler)
    first = np.asarray(hopper.observations, np.float64)
    second = np.asarray(half.observations, np.float64)
    expected_mean = 0.3 * first.mean(0) + 0.7 * second.mean(0)
    expected_square = 0.3 * (first**2).mean(0) + 0.7 * (second**2).mean(0)
    expected_std = np.sqrt(expected_square - expected_mean**2) + OBSERVATION_STD_EPSILON
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std, expected_std, rtol=1e-4, atol=1e-6)
    # One set, uniform: numpy's own mean and std.
    single_mean, single_std = observation_moments(MixtureSampler([hopper], 10))
    np.testing.assert_allclose(single_mean, first.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(single_std, first.std(0) + 1e-3, rtol=1e-4, atol=1e-6)


def test_observation_normaliser_standardises() -> None:
    normaliser = ObservationNormaliser(2)
    x = torch.tensor([[1.0, 2.0]])
    torch.testing.assert_close(normaliser(x), x)  # identity until set
    normaliser.set_moments(np.array([1.0, 0.0], np.float32), np.array([2.0, 4.0], np.float32))
    torch.testing.assert_close(normaliser(x), torch.tensor([[0.0, 0.5]]))


def test_act_applies_the_stored_statistics_to_raw_observations(
    hopper: Transitions, tmp_path: Path
) -> None:
    trainer = _trainer(hopper)
    make_sampler(trainer, [hopper])
    mean, std = observation_moments(MixtureSampler([hopper], 32))
    torch.testing.assert_close(trainer.observation_normaliser.mean, torch.from_numpy(mean))
    torch.testing.assert_close(trainer.observation_normaliser.std, torch.from_numpy(std))
    obs = hopper.observations[:5]
    with torch.no_grad():
        standardised = (torch.tensor(np.asarray(obs)) - trainer.observation_normaliser.mean) / (
            trainer.observation_normaliser.std
        )
        expected = trainer.normaliser.inverse(trainer.actor(standardised)).numpy()
    np.testing.assert_array_equal(trainer.act(obs), expected)
    # Without normalisation the moments stay the identity.
    plain = _trainer(hopper, normalise_observations=False)
    make_sampler(plain, [hopper])
    assert torch.equal(plain.observation_normaliser.std, torch.ones(hopper.observations.shape[1]))


def test_cli_trains_td3bc_and_the_checkpoint_keeps_the_statistics(
    make_test_dataset, tmp_path: Path
) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "td3bc.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 32\n")
    out = tmp_path / "run"
    args = ["train", "td3bc", dataset, "--steps", "10", "--log-every", "5", "--eval-every", "0"]
    result = CliRunner().invoke(app, [*args, "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["algorithm"] == "td3bc" and recorded["config"]["alpha"] == 2.5
    restored = load_trainer(out / "checkpoint.pt")
    assert isinstance(restored, TD3BC)
    data = load_transitions(dataset)
    mean, _ = observation_moments(MixtureSampler([data], 32))
    torch.testing.assert_close(restored.observation_normaliser.mean, torch.from_numpy(mean))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [5, 10]
    assert {"critic_loss", "actor_loss", "bc_loss", "q_data"} <= set(lines[0])


def test_workflow_stages_train_and_diagnose_td3bc(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    part = train_and_diagnose("td3bc", {"hidden": [32, 32], "batch_size": 32}, dataset, tmp_path)
    assert part["name"] == "td3bc-original"
    assert part["value"] is not None  # Q against Monte-Carlo returns: q_values is there
    assert part["divergence"] is not None and part["ope"] is not None
