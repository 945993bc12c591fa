"""Off-policy evaluation: WPDIS on-policy and FQE on one-step values."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from tests.pipeline.diagnostics.helpers import (
    FAST,
)


def test_wpdis_on_policy_is_the_mean_discounted_return() -> None:
    rng = np.random.default_rng(0)
    lengths = [3, 7, 1, 5]
    ids = np.repeat(np.arange(4), lengths)
    rewards = rng.normal(size=len(ids))
    result = diag.weighted_per_decision_is(rewards, ids, np.zeros(len(ids)), 0.9)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    truth = diag.discounted_returns(rewards, ids, 0.9)[starts].mean()
    assert result["estimate"] == pytest.approx(truth)
    assert result["ess_fraction"] == pytest.approx(1.0)
    # One episode with an overwhelming weight: WPDIS becomes that episode's return.
    log_ratio = np.where(ids == 1, 50.0, 0.0)
    heavy = diag.weighted_per_decision_is(rewards, ids, log_ratio, 0.9)
    episode = diag.discounted_returns(rewards, ids, 0.9)[starts[1]]
    assert heavy["estimate"] == pytest.approx(episode, rel=1e-6)


def test_fqe_recovers_one_step_values() -> None:
    rng = np.random.default_rng(0)
    n = 2000
    observations = rng.normal(size=(n, 3)).astype(np.float32)
    actions = rng.uniform(-1, 1, size=(n, 1)).astype(np.float32)
    rewards = 2.0 + observations[:, 0] + 0.5 * actions[:, 0]
    settings = dataclasses.replace(FAST, fqe_steps=400)
    # Every step terminates: Q(s, a) = r(s, a), and the start value is E[r(s0, pi(s0))].
    starts = observations[:200]
    policy = np.full((200, 1), 0.5, dtype=np.float32)
    value = diag.fitted_q_evaluation(
        observations,
        actions,
        rewards,
        observations,
        actions,
        np.ones(n, dtype=bool),
        starts,
        policy,
        gamma=0.99,
        settings=settings,
        seed=0,
    )
    truth = float(np.mean(2.0 + starts[:, 0] + 0.25))
    assert value == pytest.approx(truth, abs=0.15)
