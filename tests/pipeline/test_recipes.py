"""Rollout recipes that stay close to the data, on real envs and real Minari datasets.

Recorded states (MuJoCo and classic control) set the env exactly; short horizons; sparse
starts; the filter against the data's returns; a trained learner as the rollout policy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import pytest

from offaug.algorithms.evaluate import make_env
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import ShardSet, load_transitions
from offaug.datasets.action_box import ActionBox
from offaug.datasets.generate import collect_episodes
from offaug.pipeline.rollouts.behaviour import CentredPolicy
from offaug.pipeline.rollouts.config import RolloutConfig, RolloutError
from offaug.pipeline.rollouts.data import (
    RESET_START,
    EpisodeFilter,
    ReturnBaseline,
    sparsity,
    start_probabilities,
)
from offaug.pipeline.rollouts.env_state import (
    STATE_KINDS,
    StateError,
    dataset_start_states,
    load_with_states,
    set_state,
)
from offaug.pipeline.rollouts.noise import parse_noise, truncnorm_log_prob
from offaug.pipeline.rollouts.policies import BCRolloutPolicy, LearnerRolloutPolicy
from offaug.pipeline.rollouts.simulator import rollout
from offaug.pipeline.rollouts.tasks import rollout_to_shard_set

PENDULUM_BOX = ActionBox.from_bounds([-2.0], [2.0])


class ReplayPolicy:
    """Centres the noise on the dataset's own action at each dataset observation."""

    discrete = False

    def __init__(self, observations: npt.NDArray[Any], actions: npt.NDArray[Any]) -> None:
        self.lookup = {
            row.tobytes(): PENDULUM_BOX.normalise(action)
            for row, action in zip(np.asarray(observations), np.asarray(actions), strict=True)
        }

    def __call__(self, observations: npt.NDArray[np.float32]) -> tuple[Any, Any]:
        mean = np.zeros((len(observations), 1))
        return mean, np.full_like(mean, math.log(0.5))

    def centre(self, observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        return np.stack([self.lookup[row.tobytes()] for row in observations])

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return PENDULUM_BOX.to_env(actions)

    @property
    def log_abs_det(self) -> float:
        return PENDULUM_BOX.log_abs_det


def _pendulum(make_test_dataset) -> Any:
    data, kind = load_with_states(make_test_dataset("pendulum", "hdf5").dataset_id)
    assert kind is not None and kind.name == "control"
    return data


@pytest.mark.parametrize("kind", ["pendulum", "hopper"])
def test_set_states_reproduce_the_datasets_next_state(make_test_dataset, kind: str) -> None:
    data, state_kind = load_with_states(make_test_dataset(kind, "hdf5").dataset_id)
    states = dataset_start_states(data)
    assert states is not None and state_kind is not None and states.kind == state_kind
    env = make_env(data.meta)
    for row in range(0, len(data), 7):
        env.reset(seed=row)
        observation = set_state(env, states.kind, states.row(row))
        np.testing.assert_allclose(observation, data.observations[row], atol=1e-6)
        next_observation, reward, *_ = env.step(np.asarray(data.actions[row]))
        np.testing.assert_allclose(next_observation, data.next_observations[row], atol=1e-6)
        assert reward == pytest.approx(float(data.rewards[row]), abs=1e-5)


def test_branched_rollouts_with_tiny_noise_reproduce_the_data(make_test_dataset) -> None:
    data = _pendulum(make_test_dataset)
    policy = ReplayPolicy(data.observations, data.actions)
    assert isinstance(policy, CentredPolicy)
    config = RolloutConfig(
        episodes=12, n_envs=4, noise=parse_noise("gaussian:1e-7"), start="dataset", horizon=1
    )
    result = rollout(
        policy, lambda: make_env(data.meta), config, start_states=dataset_start_states(data)
    )
    rows = {row.tobytes(): i for i, row in enumerate(np.asarray(data.observations))}
    out = result.transitions
    assert len(out) == 12 and out.timeouts.all()
    for observation, next_observation in zip(out.observations, out.next_observations, strict=True):
        row = rows[observation.tobytes()]
        np.testing.assert_allclose(next_observation, data.next_observations[row], atol=1e-5)


def test_classic_control_datasets_record_their_state(make_test_dataset) -> None:
    data = _pendulum(make_test_dataset)
    state = np.asarray(data.extras["infos/state"])
    assert state.shape == (len(data), 2)
    # Pendulum observes [cos theta, sin theta, thetadot] of its state [theta, thetadot].
    np.testing.assert_allclose(data.observations[:, 0], np.cos(state[:, 0]), atol=1e-6)
    np.testing.assert_allclose(data.observations[:, 2], state[:, 1], atol=1e-6)
    # MountainCar keeps a tuple after a step: recorded as a float64 vector all the same.
    env = gym.make("MountainCar-v0", max_episode_steps=5)
    (episode,) = collect_episodes(env, lambda _: env.action_space.sample(), episodes=1)
    assert episode.infos["state"].shape == (6, 2) and episode.infos["state"].dtype == np.float64


def test_a_state_of_the_wrong_kind_is_refused(make_test_dataset) -> None:
    data = _pendulum(make_test_dataset)
    states = dataset_start_states(data)
    assert states is not None
    env = gym.make("Hopper-v5")
    env.reset(seed=0)
    with pytest.raises(StateError, match="cannot set a control state"):
        set_state(env, states.kind, states.row(0))
    with pytest.raises(RolloutError, match="cannot set"):
        rollout(
            ReplayPolicy(data.observations, data.actions),
            lambda: gym.make("Hopper-v5"),
            RolloutConfig(episodes=1, n_envs=1, start="dataset"),
            start_states=states,
        )
    assert [kind.name for kind in STATE_KINDS] == ["mujoco", "control"]


@pytest.mark.parametrize("start", ["reset", "dataset"])
def test_a_horizon_truncates_every_episode(make_test_dataset, start: str) -> None:
    data = _pendulum(make_test_dataset)
    config = RolloutConfig(
        episodes=6,
        n_envs=3,
        noise=parse_noise("gaussian:0.3"),
        start=start,
        horizon=4,  # type: ignore[arg-type]
    )
    result = rollout(
        _Zero(),
        lambda: make_env(data.meta),
        config,
        start_states=dataset_start_states(data),
    )
    out = result.transitions
    lengths = np.diff(out.episode_bounds())
    assert (lengths == 4).all() and len(lengths) == 6
    assert out.timeouts[out.episode_bounds()[1:] - 1].all()
    assert out.timeouts.sum() == 6


class _Zero:
    discrete = False

    def __call__(self, observations: npt.NDArray[np.float32]) -> tuple[Any, Any]:
        mean = np.zeros((len(observations), 1))
        return mean, np.full_like(mean, math.log(0.5))

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return PENDULUM_BOX.to_env(actions)

    log_abs_det = PENDULUM_BOX.log_abs_det


def test_sparse_starts_prefer_states_where_the_data_is_thin() -> None:
    rng = np.random.default_rng(0)
    cluster = rng.normal(0.0, 0.01, size=(50, 3))
    outlier = np.array([[5.0, 5.0, 5.0]])
    probabilities = start_probabilities(sparsity(np.concatenate([cluster, outlier])))
    assert probabilities.sum() == pytest.approx(1.0)
    assert probabilities.argmax() == 50 and probabilities[50] > 0.5
    np.testing.assert_allclose(start_probabilities(np.zeros(4)), 0.25)


def test_start_probabilities_choose_the_branch_points(make_test_dataset) -> None:
    data = _pendulum(make_test_dataset)
    only = np.zeros(len(data))
    only[17] = 1.0
    result = rollout(
        _Zero(),
        lambda: make_env(data.meta),
        RolloutConfig(episodes=4, n_envs=2, start="dataset", horizon=2),
        start_states=dataset_start_states(data),
        start_probabilities=only,
    )
    firsts = result.transitions.observations[result.transitions.episode_bounds()[:-1]]
    np.testing.assert_array_equal(firsts, np.repeat(data.observations[17:18], 4, axis=0))


def test_the_baseline_compares_with_the_datas_own_continuation() -> None:
    from offaug.datasets.transitions import Transitions

    # Two episodes: rewards [1, 2, 3] and [10, 20].
    rewards = np.array([1, 2, 3, 10, 20], dtype=np.float32)
    n = len(rewards)
    data = Transitions(
        observations=np.zeros((n, 1), np.float32),
        actions=np.zeros((n, 1), np.float32),
        rewards=rewards,
        next_observations=np.zeros((n, 1), np.float32),
        terminals=np.array([0, 0, 1, 0, 0], bool),
        timeouts=np.array([0, 0, 0, 0, 1], bool),
        episode_ids=np.array([0, 0, 0, 1, 1]),
    )
    baseline = ReturnBaseline.from_transitions(data)
    per_step = rewards.mean()
    expected = baseline.expected_returns(
        np.array([0, 1, 3, 4, RESET_START]), np.array([3, 2, 2, 2, 3])
    )
    # Row 4 has one step left of its episode: the mean reward per step stands in. The reset
    # episode outlives the data's mean episode (2.5 steps): its whole return (36 / 2) stands in.
    np.testing.assert_allclose(expected, [6.0, 5.0, 30.0, 2 * per_step, 18.0])
    keep = EpisodeFilter(baseline, margin=0.5).keep(
        np.array([5.0, 5.0, 31.0, 0.0, 3 * per_step]),
        np.array([3, 2, 2, 2, 3]),
        np.array([0, 1, 3, 4, RESET_START]),
    )
    # 5 >= 6 - 1.5; 5 >= 5 - 1; 31 >= 30 - 1; 0 < 2 * 7.2 - 1; the reset episode matches.
    np.testing.assert_array_equal(keep, [True, True, True, False, True])

    # A reset episode that fell is held to the data's mean episode return (36 / 2 = 18), however
    # high its reward per step; one cut by a horizon within the data's mean episode length to the
    # reward per step; one that outlives the data's episodes to their whole return, not more.
    assert baseline.episode_return == 18.0
    resets = np.array([RESET_START, RESET_START, RESET_START, RESET_START])
    short = np.array([2, 2, 2, 3])
    fell = np.array([True, True, False, False])
    np.testing.assert_allclose(
        baseline.expected_returns(resets, short, fell), [18.0, 18.0, 2 * per_step, 18.0]
    )
    keep = EpisodeFilter(baseline).keep(
        np.array([17.0, 18.0, 2 * per_step + 1e-3, 18.0]), short, resets, fell
    )
    np.testing.assert_array_equal(keep, [False, True, True, True])
    # 18 over 3 steps (6 a step, below the data's 7.2) earns the data's whole episode: kept.
    # 17 over 2 steps beats the reward per step (7.2) but not the data's episodes.
    assert EpisodeFilter(baseline).keep(np.array([17.0]), short[:1], resets[:1])[0]

    # A tolerance of 0.1 lets an episode fall short by a tenth of the expected return's size,
    # whatever its length: the fallen reset (bar 18) passes at 16.2, not at 16.1; a branch
    # expected to earn -10 (negative rewards) passes at -11, not at -11.1.
    tolerant = EpisodeFilter(baseline, tolerance=0.1)
    keep = tolerant.keep(np.array([16.2, 16.1]), short[:2], resets[:2], fell[:2])
    np.testing.assert_array_equal(keep, [True, False])
    negative = ReturnBaseline.from_transitions(dataclasses.replace(data, rewards=-rewards))
    keep = EpisodeFilter(negative, tolerance=0.1).keep(
        np.array([-11.0 + 1e-6, -11.1]), np.array([1, 1]), np.array([3, 3])
    )
    np.testing.assert_array_equal(keep, [True, False])


def _bc(dataset_id: str, out: Path, steps: int = 60) -> Path:
    run = train(
        "bc",
        [dataset_id],
        out,
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=steps, eval_every=0, log_every=steps, checkpoint_every=steps),
    )
    return run.checkpoint


def test_the_filter_keeps_only_episodes_that_earn_the_data(
    make_test_dataset, tmp_path: Path
) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    data = _pendulum(make_test_dataset)
    config = RolloutConfig(
        episodes=10,
        noise=parse_noise("gaussian:0.5"),
        n_envs=5,
        seed=2,
        start="dataset",
        horizon=8,
        filter="data",
    )
    outcome = rollout_to_shard_set(
        made.dataset_id, _bc(made.dataset_id, tmp_path / "bc"), config, tmp_path / "aug", tasks=2
    )
    counts = outcome.shard_set.params["filter_counts"]
    assert counts["kept"] + counts["dropped"] == 10
    assert counts["kept"] == outcome.shard_set.episodes
    assert counts["dropped"] > 0  # noisy BC from 60 steps falls behind the data somewhere
    loaded = outcome.shard_set.load()
    baseline = ReturnBaseline.from_transitions(data)
    rows = {row.tobytes(): i for i, row in enumerate(np.asarray(data.observations))}
    bounds = loaded.episode_bounds()
    for start, end in itertools.pairwise(bounds):
        row = rows[np.asarray(loaded.observations[start]).tobytes()]
        expected = baseline.expected_returns(np.array([row]), np.array([end - start]))[0]
        assert float(np.sum(loaded.rewards[start:end], dtype=np.float64)) >= expected - 1e-4


def test_a_learner_policy_centres_the_noise_and_bc_stays_the_behaviour(
    make_test_dataset, tmp_path: Path
) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    bc_path = _bc(made.dataset_id, tmp_path / "bc")
    cql = train(
        "cql",
        [made.dataset_id],
        tmp_path / "cql",
        config={"hidden": (32, 32), "batch_size": 64},
        options=TrainOptions(steps=20, eval_every=0, log_every=20, checkpoint_every=20),
    )
    bc = load_trainer(bc_path, device="cpu")
    learner = load_trainer(cql.checkpoint, device="cpu")
    policy = LearnerRolloutPolicy(learner, BCRolloutPolicy(bc))
    sigma = 0.2
    config = RolloutConfig(
        episodes=3, n_envs=3, noise=parse_noise(f"gaussian:{sigma}"), seed=1, horizon=5
    )
    result = rollout(policy, lambda: gym.make("Pendulum-v1"), config)
    out = result.transitions
    observations = np.asarray(out.observations)
    box = ActionBox.from_normaliser(bc.normaliser)
    centre = box.normalise(learner.act(observations))
    log_mu = truncnorm_log_prob(box.normalise(out.actions), centre, sigma) + box.log_abs_det
    np.testing.assert_allclose(out.rollout_log_prob, log_mu, atol=1e-4)
    np.testing.assert_allclose(
        out.behaviour_log_prob, bc.log_prob(observations, np.asarray(out.actions)), atol=1e-4
    )


def test_a_learner_from_other_data_is_refused(make_test_dataset, tmp_path: Path) -> None:
    pendulum = load_trainer(_bc(make_test_dataset("pendulum", "hdf5").dataset_id, tmp_path / "p"))
    hopper = load_trainer(_bc(make_test_dataset("hopper", "hdf5").dataset_id, tmp_path / "h"))
    with pytest.raises(ValueError, match="same dataset"):
        LearnerRolloutPolicy(hopper, BCRolloutPolicy(pendulum))


def test_rollout_shards_record_the_learner(make_test_dataset, tmp_path: Path) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    bc_path = _bc(made.dataset_id, tmp_path / "bc")
    config = RolloutConfig(episodes=2, n_envs=2, horizon=3)
    outcome = rollout_to_shard_set(
        made.dataset_id, bc_path, config, tmp_path / "aug", learner=bc_path
    )
    assert isinstance(outcome.shard_set, ShardSet)
    assert outcome.shard_set.source["learner"] == str(bc_path)
    assert load_transitions(str(tmp_path / "aug")).meta["provenance"]["learner"] == str(bc_path)
