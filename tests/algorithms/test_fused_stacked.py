"""Stacked fused losses: the member-agnostic learners run once on all members' parameters.

BC (continuous), TD3+BC and IQL declare ``FusedSpec.stacked``: without ``vmap`` their losses
see every module's parameters with a leading member axis. Each member must still train as its
single-seed run, read its own hyperparameters and its own data's statistics.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offaug.algorithms.fused.trainer import FusedTrainer
from offaug.algorithms.fusing import per_member
from offaug.algorithms.training.fused_loop import build_members, member_configs
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import Transitions
from tests.algorithms.fused_runs import (
    SMALL,
    assert_members_match,
    fused_and_single_runs,
)

STACKED = {
    "bc-gaussian": ("bc", {"policy": "gaussian"}),
    "bc-deterministic": ("bc", {"policy": "deterministic"}),
    "td3bc": ("td3bc", {}),
    "iql": ("iql", {}),
    "iql-learned-std": ("iql", {"log_std": "learned"}),
}


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "vmap"])
@pytest.mark.parametrize("learner", list(STACKED))
def test_stacked_and_vmapped_losses_both_match_single_runs(
    hopper: Transitions, learner: str, stacked: bool
) -> None:
    algorithm, overrides = STACKED[learner]
    configs = member_configs(algorithm, {**SMALL[algorithm], **overrides}, 2)
    fused, singles, metrics = fused_and_single_runs(
        algorithm, [[hopper]] * 2, configs, 20, stacked=stacked
    )
    assert fused.stacked is stacked
    assert_members_match(fused, singles, metrics)


PER_MEMBER: dict[str, dict[str, Any]] = {
    "td3bc": {
        "gamma": [0.99, 0.9],
        "tau": [0.005, 0.05],
        "policy_noise": [0.2, 0.5],
        "noise_clip": [0.5, 0.1],
        "alpha": [2.5, 10.0],
        "critic_learning_rate": [3e-4, 1e-3],
    },
    "iql": {
        "gamma": [0.99, 0.9],
        "expectile": [0.7, 0.9],
        "beta": [3.0, 0.5],
        "max_weight": [100.0, 2.0],
        "value_learning_rate": [3e-4, 1e-3],
    },
}


@pytest.mark.parametrize("algorithm", list(PER_MEMBER))
def test_stacked_members_read_their_own_hyperparameters(
    hopper: Transitions, algorithm: str
) -> None:
    """Each member differs in every float its losses read; each is the single run of its
    config (a hyperparameter broadcast against the wrong member's rows would not be)."""
    configs = member_configs(algorithm, {**SMALL[algorithm], **PER_MEMBER[algorithm]}, 2)
    fused, singles, metrics = fused_and_single_runs(algorithm, [[hopper]] * 2, configs, 20)
    assert fused.stacked
    assert_members_match(fused, singles, metrics)


@pytest.mark.parametrize("algorithm", ["td3bc", "iql"])
def test_members_on_their_own_data_stack_with_their_own_statistics(
    hopper: Transitions, algorithm: str
) -> None:
    """TD3+BC and IQL standardise observations by their data's moments: members that each mix
    the data with their own second set (a workflow's seeds, each with its own rollouts) read
    their own moments, and each trains as its single run on that pair."""
    bounds = hopper.episode_bounds()
    own = [[hopper, hopper.slice(0, int(bounds[2]))], [hopper, hopper.slice(0, int(bounds[4]))]]
    configs = member_configs(algorithm, SMALL[algorithm], 2)
    options = TrainOptions(mixing=(0.5, 0.5))
    fused, singles, metrics = fused_and_single_runs(algorithm, own, configs, 20, options=options)
    assert fused.stacked
    moments = fused.buffers["parts.observation_normaliser.mean"]
    assert not torch.equal(moments[0], moments[1])
    assert_members_match(fused, singles, metrics)


def test_learners_without_member_agnostic_losses_refuse_stacking(hopper: Transitions) -> None:
    configs = member_configs("rebrac", SMALL["rebrac"], 2)
    built = build_members("rebrac", [hopper], (0, 1), configs, TrainOptions())
    assert not FusedTrainer(built.trainers, built.generators, (0, 1)).stacked
    with pytest.raises(ValueError, match="cannot train stacked"):
        FusedTrainer(built.trainers, built.generators, (0, 1), stacked=True)


def test_per_member_broadcasts_a_stacked_value_against_its_members_rows() -> None:
    rows = torch.zeros(3, 4, 2)
    value = torch.tensor([1.0, 2.0, 3.0])
    shaped = per_member(value, rows)
    assert shaped.shape == (3, 1, 1)
    assert torch.equal((rows + shaped)[:, 2, 1], value)
    assert per_member(0.5, rows) == 0.5
    scalar = torch.tensor(0.5)
    assert per_member(scalar, rows) is scalar
