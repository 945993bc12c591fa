"""The rollout engine on real Gymnasium environments: weights, episodes, faults, outputs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import pytest

from offaug.algorithms.evaluate import make_env
from offaug.datasets import ShardSet, load_transitions
from offaug.pipeline.rollouts.config import RolloutConfig, RolloutError
from offaug.pipeline.rollouts.env_state import dataset_start_states
from offaug.pipeline.rollouts.noise import parse_noise, truncnorm_log_prob
from offaug.pipeline.rollouts.simulator import rollout
from offaug.pipeline.rollouts.tasks import split_tasks

BEHAVIOUR_STD = 0.3


class KnownGaussianPolicy:
    """A fixed Gaussian behaviour policy on Pendulum: mean depends on the state, std is fixed."""

    discrete = False

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        mean = np.tanh(-0.8 * observations[:, 2:3] - 0.5 * observations[:, 1:2]).astype(np.float64)
        return mean, np.full_like(mean, math.log(BEHAVIOUR_STD))

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return (2.0 * actions).astype(np.float32)  # Pendulum's box is [-2, 2]

    @property
    def log_abs_det(self) -> float:
        return math.log(0.5)


def _expected_under_behaviour(observations: npt.NDArray[Any], f: Any) -> npt.NDArray[Any]:
    """E_beta[f(a) | s] for every state, by quadrature on the truncated Gaussian."""
    grid = np.linspace(-1, 1, 801)[None, :, None]  # (1, G, 1)
    mean, log_std = KnownGaussianPolicy()(observations)
    density = np.exp(truncnorm_log_prob(grid, mean[:, None, :], np.exp(log_std)[:, None, :]))
    weights = density / density.sum(axis=1, keepdims=True)
    return (weights * f(grid[..., 0])).sum(axis=1)


def test_importance_weights_recover_the_behaviour_expectation() -> None:
    config = RolloutConfig(
        episodes=40, n_envs=20, noise=parse_noise("gaussian:0.6"), seed=0, max_weight=1e9
    )
    result = rollout(KnownGaussianPolicy(), lambda: gym.make("Pendulum-v1"), config)
    data = result.transitions
    f = np.square  # test function of the normalised action
    values = f(data.actions[:, 0] / 2.0)
    truth = _expected_under_behaviour(data.observations, f)
    weighted = data.importance_weight * values - truth
    unweighted = values - truth
    standard_error = weighted.std() / math.sqrt(len(weighted))
    # Stated tolerance: four standard errors of the per-transition difference.
    assert abs(weighted.mean()) < 4 * standard_error
    assert abs(unweighted.mean()) > 4 * unweighted.std() / math.sqrt(len(unweighted))
    assert result.weight_stats["clipped_fraction"] == 0.0
    assert 0 < result.weight_stats["ess_fraction"] <= 1


def test_episodes_are_exact_with_terminations_and_truncations(make_test_dataset) -> None:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    config = RolloutConfig(
        episodes=12, n_envs=5, noise=parse_noise("gaussian:0.5"), seed=1, max_episode_steps=15
    )
    result = rollout(KnownHopperPolicy(), lambda: make_env(data.meta, max_episode_steps=15), config)
    out = result.transitions
    assert out.num_episodes == 12
    for episode in out.iter_episodes():
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
        assert episode.terminals[-1] or episode.timeouts[-1]
        assert not (episode.terminals[:-1] | episode.timeouts[:-1]).any()
        assert len(episode) <= 15
        if len(episode) == 15:
            assert episode.timeouts[-1] and not episode.terminals[-1]
    # Per-decision weights are the running product of per-step ratios inside each episode.
    for episode in out.iter_episodes():
        ratio = episode.behaviour_log_prob.astype(np.float64) - episode.rollout_log_prob
        np.testing.assert_allclose(
            episode.extras["cumulative_log_ratio"], np.cumsum(ratio), rtol=1e-4, atol=1e-3
        )


class KnownHopperPolicy:
    """A fixed Gaussian policy for Hopper-v5 (3 actions in [-1, 1])."""

    discrete = False

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        mean = np.tanh(observations[:, :3]).astype(np.float64) * 0.5
        return mean, np.full_like(mean, math.log(0.4))

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return actions.astype(np.float32)

    @property
    def log_abs_det(self) -> float:
        return 0.0


class RaisingEnv(gym.Wrapper):  # type: ignore[type-arg]
    """A real environment that raises every ``every`` steps."""

    def __init__(self, env: gym.Env, every: int) -> None:  # type: ignore[type-arg]
        super().__init__(env)
        self.every = every
        self.count = 0

    def step(self, action: Any) -> Any:
        self.count += 1
        if self.count % self.every == 0:
            raise RuntimeError(f"simulator blew up at call {self.count}")
        return self.env.step(action)


class NaNEnv(gym.Wrapper):  # type: ignore[type-arg]
    """A real environment whose observation turns NaN every ``every`` steps."""

    def __init__(self, env: gym.Env, every: int) -> None:  # type: ignore[type-arg]
        super().__init__(env)
        self.every = every
        self.count = 0

    def step(self, action: Any) -> Any:
        self.count += 1
        observation, reward, terminated, truncated, info = self.env.step(action)
        if self.count % self.every == 0:
            observation = np.full_like(observation, np.nan)
        return observation, reward, terminated, truncated, info


@pytest.mark.parametrize("wrapper", [RaisingEnv, NaNEnv])
def test_faulty_environments_are_counted_and_the_data_stays_clean(wrapper: Any) -> None:
    config = RolloutConfig(episodes=10, n_envs=4, noise=parse_noise("gaussian:0.3"), seed=2)
    result = rollout(
        KnownGaussianPolicy(), lambda: wrapper(gym.make("Pendulum-v1"), every=37), config
    )
    data = result.transitions
    assert len(result.faults) > 5
    assert all(
        f.kind == ("RuntimeError" if wrapper is RaisingEnv else "NonFinite") for f in result.faults
    )
    assert np.isfinite(data.observations).all() and np.isfinite(data.next_observations).all()
    assert data.num_episodes == 10
    for episode in data.iter_episodes():
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
        assert episode.timeouts[-1] or episode.terminals[-1]
    if wrapper is NaNEnv:
        assert len(result.bad_steps) == len(result.faults)
        assert math.isnan(result.bad_steps[0]["next_observation"][0])


def test_a_policy_that_outputs_nan_stops_with_a_clear_error() -> None:
    class Broken(KnownGaussianPolicy):
        def __call__(self, observations: npt.NDArray[np.float32]) -> Any:
            mean, log_std = super().__call__(observations)
            return mean * np.nan, log_std

    with pytest.raises(RolloutError, match="NaN"):
        rollout(Broken(), lambda: gym.make("Pendulum-v1"), RolloutConfig(episodes=2, n_envs=2))


def test_branching_from_dataset_states_reproduces_their_observations(make_test_dataset) -> None:
    data = load_transitions(
        make_test_dataset("hopper", "hdf5").dataset_id, info_keys=["qpos", "qvel"]
    )
    states = dataset_start_states(data)
    assert states is not None
    config = RolloutConfig(
        episodes=6, n_envs=3, noise=parse_noise("gaussian:0.2"), seed=4, start="dataset"
    )
    result = rollout(KnownHopperPolicy(), lambda: make_env(data.meta), config, start_states=states)
    firsts = result.transitions.observations[result.transitions.episode_bounds()[:-1]]
    # Every episode's first observation is a dataset observation (the branch point).
    dataset_rows = {row.tobytes() for row in np.round(data.observations, 5)}
    assert all(row.tobytes() in dataset_rows for row in np.round(firsts, 5))


def test_discrete_epsilon_greedy_rollout_records_log_probs(make_test_dataset) -> None:
    class Greedy:
        discrete = True

        def __call__(self, observations: npt.NDArray[np.float32]) -> Any:
            logits = np.stack([observations[:, 2], -observations[:, 2]], axis=1).astype(np.float64)
            return logits, None

        def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return actions

        log_abs_det = 0.0

    config = RolloutConfig(episodes=5, n_envs=5, noise=parse_noise("epsilon:0.2"), seed=5)
    result = rollout(Greedy(), lambda: gym.make("CartPole-v1"), config)
    data = result.transitions
    assert data.actions.dtype == np.int64
    probabilities = np.exp(data.rollout_log_prob.astype(np.float64)).round(4)
    assert set(np.unique(probabilities).tolist()) <= {0.9, 0.1}


def test_bc_policy_rollout_to_shards(make_test_dataset, tmp_path: Path) -> None:
    from offaug.algorithms.training.loop import train
    from offaug.algorithms.training.options import TrainOptions
    from offaug.pipeline.rollouts.tasks import merge_rollout_shards, run_rollout_task, split_tasks

    made = make_test_dataset("hopper", "hdf5")
    run = train(
        "bc",
        [made.dataset_id],
        tmp_path / "bc",
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=30, eval_every=0, log_every=10, checkpoint_every=30),
    )
    config = RolloutConfig(episodes=7, n_envs=3, noise=parse_noise("gaussian:0.2"), seed=3)
    tasks = split_tasks(made.dataset_id, str(run.checkpoint), config, tmp_path / "aug", tasks=3)
    assert [t.config.episodes for t in tasks] == [3, 2, 2]
    results = [run_rollout_task(t) for t in tasks]
    shard_set = merge_rollout_shards(
        tmp_path / "aug", results, {"noise": config.noise.text, "max_weight": config.max_weight}
    )
    assert isinstance(shard_set, ShardSet)
    assert shard_set.episodes == 7
    assert shard_set.params["weight_stats"]["n"] == shard_set.rows
    loaded = shard_set.load()
    assert loaded.importance_weight is not None and (loaded.source == 1).all()
    assert loaded.meta["provenance"]["policy_checkpoint_xxh3"]


def test_self_normalised_weights_are_pooled_over_every_shard(
    make_test_dataset, tmp_path: Path
) -> None:
    from offaug.algorithms.training.loop import train
    from offaug.algorithms.training.options import TrainOptions
    from offaug.pipeline.rollouts.tasks import merge_rollout_shards, run_rollout_task, split_tasks

    made = make_test_dataset("hopper", "hdf5")
    run = train(
        "bc",
        [made.dataset_id],
        tmp_path / "bc",
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=30, eval_every=0, log_every=10, checkpoint_every=30),
    )
    config = RolloutConfig(
        episodes=6, n_envs=2, noise=parse_noise("gaussian:0.3"), seed=7, max_weight=1e6
    )
    tasks = split_tasks(made.dataset_id, str(run.checkpoint), config, tmp_path / "aug", tasks=3)
    shard_set = merge_rollout_shards(
        tmp_path / "aug",
        [run_rollout_task(t) for t in tasks],
        {"noise": config.noise.text, "max_weight": config.max_weight},
    )
    parts = list(shard_set.iter_shards())
    means = [float(np.mean(p.importance_weight.astype(np.float64))) for p in parts]
    assert max(means) > 1.05 * min(means)  # the shards' own means differ
    pooled = shard_set.load()
    weights = pooled.importance_weight.astype(np.float64)
    np.testing.assert_allclose(
        pooled.extras["self_normalised_weight"], weights / weights.mean(), rtol=1e-5
    )


def test_a_simulator_step_budget_ends_the_rollout_there() -> None:
    """simulator_steps in place of episodes: exactly that many env.step calls, whole episodes
    (Pendulum's run 200 steps) and the ones the budget cut, which end as truncated."""
    config = RolloutConfig(
        episodes=1, simulator_steps=450, n_envs=2, noise=parse_noise("gaussian:0.3"), seed=0
    )
    result = rollout(KnownGaussianPolicy(), lambda: gym.make("Pendulum-v1"), config)
    data = result.transitions
    assert result.simulator_steps == len(data) == 450
    lengths = np.bincount(data.episode_ids)
    assert sorted(lengths.tolist()) == [25, 25, 200, 200]
    ends = np.cumsum(lengths) - 1
    assert data.timeouts[ends].all() and not data.terminals.any()
    assert data.meta["rollout"]["simulator_steps"] == 450
    # An episode budget counts its steps too.
    episodes = rollout(
        KnownGaussianPolicy(),
        lambda: gym.make("Pendulum-v1"),
        RolloutConfig(episodes=1, n_envs=1, noise=parse_noise("gaussian:0.3"), seed=0),
    )
    assert episodes.simulator_steps == len(episodes.transitions) == 200


def test_a_simulator_step_budget_is_split_over_the_tasks() -> None:
    config = RolloutConfig(episodes=100, simulator_steps=10, seed=2)
    tasks = split_tasks("a/b-v0", "bc.pt", config, "out", 3)
    assert [t.config.simulator_steps for t in tasks] == [4, 3, 3]
    assert [t.config.seed for t in tasks] == [2000, 2001, 2002]
