"""Weights in training: normalised within each source, pi/mu from the learner's current policy,
the ESS/N of the weights used, and the learners that cannot weight by pi/mu."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import distributions as D

from offaug.algorithms import registry
from offaug.algorithms.base import spaces_from_transitions
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.learners.bc import BC
from offaug.algorithms.learners.cql import CQL
from offaug.algorithms.learners.iql import IQL
from offaug.algorithms.training.batches import make_sampler
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.algorithms.training.weighting import (
    PolicyWeights,
    WeightUsage,
    clipped_policy_weights,
    normalise_per_source,
)
from offaug.datasets import MixtureSampler, ShardSet, Transitions, load_transitions
from offaug.datasets.weights import effective_sample_size
from offaug.pipeline.rollouts.config import RolloutConfig
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.tasks import rollout_to_shard_set

SMALL = {"hidden": (32, 32), "batch_size": 64}


@pytest.fixture(scope="module")
def hopper(make_test_dataset) -> Transitions:
    return load_transitions(make_test_dataset("hopper", "hdf5").dataset_id, cache=False)


@pytest.fixture(scope="module")
def rollouts(make_test_dataset, tmp_path_factory) -> ShardSet:
    """Real simulator rollouts of a (briefly) cloned BC policy, in two shards."""
    made = make_test_dataset("hopper", "hdf5")
    root = tmp_path_factory.mktemp("rollouts")
    bc = train(
        "bc",
        [made.dataset_id],
        root / "bc",
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=30, eval_every=0, log_every=10, checkpoint_every=30),
    )
    config = RolloutConfig(episodes=6, n_envs=3, noise=parse_noise("gaussian:0.3"), seed=1)
    outcome = rollout_to_shard_set(made.dataset_id, bc.checkpoint, config, root / "aug", tasks=2)
    return outcome.shard_set


def _heavy_tailed(data: Transitions, seed: int) -> Transitions:
    """``data`` with log-normal importance weights clipped at 50 (a tenth of them zero)."""
    rng = np.random.default_rng(seed)
    weights = np.minimum(np.exp(rng.normal(0.0, 1.5, len(data))), 50.0)
    weights[rng.random(len(data)) < 0.1] = 0.0
    return Transitions(**{**data.columns(), "importance_weight": weights.astype(np.float32)})


def _per_source_estimate(losses: np.ndarray, weights: np.ndarray, set_index: np.ndarray) -> float:
    """sum_s (n_s / B) * sum_{i in s} w_i l_i / sum_{i in s} w_i, by hand in float64."""
    total = 0.0
    for source in np.unique(set_index):
        rows = set_index == source
        w, loss = weights[rows].astype(np.float64), losses[rows].astype(np.float64)
        total += rows.mean() * (w * loss).sum() / w.sum()
    return total


def _mixed_samplers(hopper: Transitions, seed: int = 3) -> tuple[MixtureSampler, MixtureSampler]:
    sets = [hopper, _heavy_tailed(hopper, 0), _heavy_tailed(hopper, 1)]
    options = {"mixing": [0.5, 0.3, 0.2], "use_weights": True, "seed": seed}
    normalised = MixtureSampler(sets, 200, **options)
    raw = MixtureSampler(sets, 200, normalise_weights=False, **options)
    return normalised, raw


def _spaces(data: Transitions):
    return spaces_from_transitions(data.meta, data.observations.shape[1], data.actions)


def test_bc_loss_is_the_per_source_self_normalised_mean(hopper: Transitions) -> None:
    torch.manual_seed(0)
    bc = BC(_spaces(hopper), registry.config_type("bc")(policy="deterministic", hidden=(32, 32)))
    normalised, raw = _mixed_samplers(hopper)
    for _ in range(3):
        batch, stored = normalised.sample(), raw.sample()
        loss = float(bc.loss(TorchBatch.from_batch(batch)).detach())
        with torch.no_grad():
            observations = torch.from_numpy(stored.observations)
            predicted = bc.policy(observations).numpy()
            actions = bc.normaliser(torch.from_numpy(stored.actions)).numpy()
        squared_error = ((predicted - actions) ** 2).sum(-1)
        expected = _per_source_estimate(squared_error, stored.weights, stored.set_index)
        assert loss == pytest.approx(expected, rel=1e-5)


def test_cql_td_loss_is_the_per_source_self_normalised_mean(hopper: Transitions) -> None:
    torch.manual_seed(0)
    cql = CQL(_spaces(hopper), registry.config_type("cql")(hidden=(32, 32)))
    assert cql.config.backup == "mean"  # the target below is the mean-action backup
    normalised, raw = _mixed_samplers(hopper, seed=4)
    batch, stored = normalised.sample(), raw.sample()
    td = float(cql.losses(TorchBatch.from_batch(batch)).td.detach())
    with torch.no_grad():
        obs = torch.from_numpy(stored.observations)
        next_obs = torch.from_numpy(stored.next_observations)
        actions = cql.normaliser(torch.from_numpy(stored.actions))
        q_data = cql.critic(obs, actions)  # (E, B)
        next_action = torch.tanh(cql.actor.mean_log_std(next_obs)[0])
        next_value = cql.critic_target(next_obs, next_action).min(0).values
        not_terminal = 1.0 - torch.from_numpy(stored.terminals.astype(np.float32))
        target = torch.from_numpy(stored.rewards) + cql.config.gamma * not_terminal * next_value
        per_row = (q_data - target).pow(2).sum(0).numpy()
    expected = _per_source_estimate(per_row, stored.weights, stored.set_index)
    assert td == pytest.approx(expected, rel=1e-4)


def test_torch_normalisation_pools_each_source_and_guards_zero_sums() -> None:
    rng = np.random.default_rng(0)
    set_index = rng.integers(0, 4, 300)
    weights = rng.exponential(size=300)
    weights[set_index == 2] = 0.0  # a source whose rows all weigh 0 stays at 0
    result = normalise_per_source(
        torch.tensor(weights), torch.tensor(set_index, dtype=torch.int64), sets=5
    ).numpy()
    assert np.isfinite(result).all()
    for source in range(4):
        rows = set_index == source
        if source == 2:
            assert (result[rows] == 0).all()
        else:
            np.testing.assert_allclose(
                result[rows], weights[rows] * rows.sum() / weights[rows].sum()
            )


def _log_pi_by_hand(trainer, observations: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """log pi(a|s) over the environment's box from the actor's outputs, with torch.distributions:
    CQL's tanh-Gaussian; BC's and IQL's Gaussians truncated to the box."""
    spaces = trainer.spaces
    low = torch.tensor(spaces.action_low, dtype=torch.float64)
    high = torch.tensor(spaces.action_high, dtype=torch.float64)
    to_env = D.AffineTransform(loc=(high + low) / 2, scale=(high - low) / 2)
    obs = torch.from_numpy(observations)
    env_actions = torch.from_numpy(actions).double()
    with torch.no_grad():
        if isinstance(trainer, CQL):
            mean, log_std = (x.double() for x in trainer.actor.mean_log_std(obs))
            squashed = D.TransformedDistribution(
                D.Normal(mean, log_std.exp()), [D.TanhTransform(), to_env]
            )
            return squashed.log_prob(env_actions).sum(-1).numpy()
        if isinstance(trainer, IQL):
            actor_outputs = trainer.actor.mean_log_std(trainer.observation_normaliser(obs))
        else:
            actor_outputs = trainer.policy.mean_log_std(obs)
        mean, log_std = (x.double() for x in actor_outputs)
        normal = D.Normal(mean, log_std.exp())
        box_mass = normal.cdf(torch.ones_like(mean)) - normal.cdf(-torch.ones_like(mean))
        truncated = D.TransformedDistribution(normal, [to_env])
        return (truncated.log_prob(env_actions) - box_mass.log()).sum(-1).numpy()


@pytest.mark.parametrize("algorithm", ["cql", "bc", "iql"])
def test_policy_weights_are_pi_over_mu_from_an_independent_computation(
    algorithm: str, hopper: Transitions, rollouts: ShardSet
) -> None:
    torch.manual_seed(0)
    trainer = registry.build(algorithm, _spaces(hopper), {"hidden": (32, 32)}, device="cpu")
    make_sampler(trainer, [hopper])  # IQL takes its observation moments from the data
    sampler = MixtureSampler(
        [hopper, rollouts], 256, mixing=[0.5, 0.5], rollout_log_prob=True, seed=2
    )
    batch = sampler.sample()
    augmented = batch.set_index == 1
    assert batch.rollout_log_prob is not None
    log_ratio = (
        _log_pi_by_hand(trainer, batch.observations[augmented], batch.actions[augmented])
        - batch.rollout_log_prob[augmented]
    )
    raw = np.exp(log_ratio)
    # Between two distinct ratios (rows repeat in a batch): some rows are clipped, not all.
    distinct = np.unique(raw)
    cut = int(0.8 * len(distinct))
    max_weight = float(np.sqrt(distinct[cut - 1] * distinct[cut]))
    converted = TorchBatch.from_batch(batch, with_sources=True)
    weighted, clipped = PolicyWeights(trainer, [max_weight, max_weight], torch.device("cpu"))(
        converted
    )
    expected = np.minimum(raw, max_weight)
    expected = expected * augmented.sum() / expected.sum()
    np.testing.assert_allclose(weighted.weights.numpy()[augmented], expected, rtol=2e-4)
    np.testing.assert_array_equal(weighted.weights.numpy()[~augmented], 1.0)
    np.testing.assert_array_equal(clipped.numpy()[augmented], raw > max_weight)
    # Unclipped and unnormalised, the weights are exp(log pi - log mu) itself.
    unclipped, _ = clipped_policy_weights(
        trainer.policy_log_prob(converted.observations, converted.actions),
        converted.rollout_log_prob,
        torch.full((256,), 1e30),
    )
    np.testing.assert_allclose(unclipped.numpy()[augmented], raw, rtol=2e-4)


def test_weight_usage_reports_the_ess_of_the_weights_used() -> None:
    rng = np.random.default_rng(1)
    usage = WeightUsage([False, True], torch.device("cpu"))
    used = []
    for _ in range(4):
        set_index = rng.integers(0, 2, 100)
        weights = rng.exponential(size=100).astype(np.float32)
        usage.add(torch.tensor(weights), torch.tensor(set_index), None)
        used.append(weights[set_index == 1])
    metrics = usage.flush(clipping=False)
    expected = effective_sample_size(np.concatenate(used)) / len(np.concatenate(used))
    assert metrics["weight_ess_fraction"] == pytest.approx(expected, rel=1e-5)
    assert metrics["weight_ess_fraction_run"] == pytest.approx(expected, rel=1e-5)
    assert usage.flush(clipping=False) == {"weight_ess_fraction_run": pytest.approx(expected)}


def test_training_with_policy_weights_reports_them(
    make_test_dataset, rollouts: ShardSet, tmp_path: Path
) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    options = TrainOptions(
        steps=20,
        mixing=(0.5, 0.5),
        weighting="policy",
        eval_every=0,
        log_every=10,
        checkpoint_every=20,
    )
    train("cql", [dataset, rollouts.directory], tmp_path / "run", config=SMALL, options=options)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert 0 < line["weight_ess_fraction"] <= 1
        assert 0 < line["weight_ess_fraction_run"] <= 1
        assert 0 <= line["weight_clipped_fraction"] <= 1
        assert math.isfinite(line["critic_loss"])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["options"]
    assert recorded["weighting"] == "policy" and recorded["normalise_weights"] is True


def test_behaviour_weights_report_their_ess(
    make_test_dataset, rollouts: ShardSet, tmp_path: Path
) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    options = TrainOptions(
        steps=10, mixing=(0.5, 0.5), weighting="behaviour", eval_every=0, log_every=10
    )
    result = train(
        "bc", [dataset, rollouts.directory], tmp_path / "run", config=SMALL, options=options
    )
    assert result.weight_ess_fraction is not None and 0 < result.weight_ess_fraction <= 1
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["weight_ess_fraction_run"] == pytest.approx(result.weight_ess_fraction)
    assert "weight_clipped_fraction" not in line  # clipping happened at rollout time


@pytest.mark.parametrize(
    ("algorithm", "config"),
    [
        ("bcq", {}),
        ("td3bc", {}),
        ("rebrac", {}),
        ("discrete_cql", {}),
        ("discrete_bcq", {}),
        ("bc", {"policy": "deterministic"}),
    ],
)
def test_learners_without_a_policy_density_refuse_policy_weights(
    algorithm: str, config: dict[str, object], make_test_dataset, tmp_path: Path
) -> None:
    refusal = registry.policy_weighting_refusal(algorithm, config)
    assert refusal is not None
    assert "weighting 'policy'" in refusal and algorithm in refusal
    assert "cql" in refusal.split("one of:")[1]  # names learners that can
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    with pytest.raises(ValueError, match=f"{algorithm}'s policy has no density"):
        train(
            algorithm,
            [dataset],
            tmp_path / "run",
            config=config,
            options=TrainOptions(steps=1, weighting="policy", eval_every=0),
        )


@pytest.mark.parametrize("algorithm", ["bc", "cql", "sac", "iql"])
def test_learners_with_a_policy_density_accept_policy_weights(algorithm: str) -> None:
    assert registry.policy_weighting_refusal(algorithm, {}) is None
