"""The hand-written CPU paths and the tanh-Gaussian against the modules they stand in for."""

from __future__ import annotations

import pytest
import torch

from offaug.algorithms.distributions import tanh_gaussian
from offaug.algorithms.kernels import ensemble_values
from offaug.algorithms.networks import CriticEnsemble, TanhGaussianActor


def test_tanh_gaussian_matches_the_actor() -> None:
    torch.manual_seed(0)
    actor = TanhGaussianActor(5, 3, (16, 16))
    obs = torch.randn(7, 5)
    torch.manual_seed(1)
    expected = actor(obs)
    torch.manual_seed(1)
    noise = torch.randn(1, 7, 3)
    mean, log_std = actor.mean_log_std(obs)
    actions, log_prob = tanh_gaussian(mean, log_std, noise)
    torch.testing.assert_close(actions[0], expected.actions)
    torch.testing.assert_close(log_prob[0], expected.log_prob)


@pytest.mark.parametrize("batched", [False, True], ids=["per-member-blocks", "batched"])
def test_ensemble_values_match_the_critic_module_and_freeze_weights(batched: bool) -> None:
    torch.manual_seed(0)
    critic = CriticEnsemble(5, 2, (16, 16), members=3)
    obs, actions = torch.randn(5000, 5), torch.rand(5000, 2) * 2 - 1  # several CPU blocks
    values = ensemble_values(critic, obs, actions, batched=batched)
    torch.testing.assert_close(values, critic(obs, actions))
    values.sum().backward()
    gradients = [p.grad for p in critic.parameters()]
    critic.zero_grad()
    critic(obs, actions).sum().backward()
    for got, expected in zip(gradients, [p.grad for p in critic.parameters()], strict=True):
        assert got is not None and expected is not None
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # sums of 5000 rows
    critic.zero_grad(set_to_none=True)
    actions.requires_grad_(True)
    ensemble_values(critic, obs, actions, frozen=True, batched=batched).sum().backward()
    assert actions.grad is not None
    assert all(p.grad is None for p in critic.parameters())
