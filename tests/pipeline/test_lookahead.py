"""The rollout algorithm's search (``rollout.lookahead``) on real environments and datasets.

Every episode is built window by window: the env's state is read, the candidates (the noiseless
policy and noisy windows followed by it) are simulated from it, the best window is committed.
Here the committed episodes are replayed action by action in a fresh environment (so the state
was carried from window to window exactly), each is compared with the noiseless policy from the
same reset computed independently, and the steps are counted by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import pytest
from pydantic import ValidationError

from offaug.algorithms.evaluate import make_env
from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.datasets import load_transitions
from offaug.pipeline.rollouts.config import Lookahead, RolloutConfig, RolloutError
from offaug.pipeline.rollouts.env_state import env_state_kind, read_state, set_state
from offaug.pipeline.rollouts.lookahead import _Search
from offaug.pipeline.rollouts.noise import parse_noise
from offaug.pipeline.rollouts.policies import load_rollout_policy
from offaug.pipeline.rollouts.references import DiscountedValue
from offaug.pipeline.rollouts.tasks import rollout_to_shard_set
from offaug.pipeline.schema.rollout_section import RolloutModel


def _clone(dataset_id: str, out: Path, algorithm: str = "bc", steps: int = 60) -> Path:
    """A small ``algorithm`` checkpoint trained on the dataset (the BC clone by default)."""
    run = train(
        algorithm,
        [dataset_id],
        out,
        config={"hidden": (32, 32)},
        options=TrainOptions(steps=steps, eval_every=0, log_every=steps, checkpoint_every=steps),
    )
    return run.checkpoint


def _replay(meta: dict[str, Any], seed: int, actions: npt.NDArray[Any]) -> list[float]:
    """The rewards of ``actions`` stepped from ``reset(seed)`` in a fresh environment."""
    env = make_env(meta)
    env.reset(seed=seed)
    rewards = []
    for action in actions:
        _, reward, terminated, _, _ = env.step(action)
        rewards.append(float(np.float32(reward)))
        if terminated:
            break
    env.close()
    return rewards


def test_lookahead_episodes_are_real_and_never_below_the_noiseless_policy(
    make_test_dataset, tmp_path: Path
) -> None:
    made = make_test_dataset("pendulum", "hdf5")
    checkpoint = _clone(made.dataset_id, tmp_path / "bc")
    horizon, window, candidates = 40, 5, 4
    config = RolloutConfig(
        episodes=4,
        n_envs=2,
        noise=parse_noise("gaussian:0.5"),
        seed=3,
        horizon=horizon,
        lookahead=Lookahead(candidates=candidates, window=window),
    )
    outcome = rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=2)
    meta = load_transitions(made.dataset_id).meta
    bc = load_rollout_policy(str(checkpoint))
    data = outcome.shard_set.load()
    bounds = data.episode_bounds()
    records = [task.filter_record for task in outcome.tasks]
    assert all(record is not None for record in records)
    seeds = [seed for record in records if record for seed in record.reset_seeds]
    references = [ref for record in records if record for ref in record.references]
    assert len(seeds) == len(bounds) - 1 == 4
    improved = 0
    for episode, (seed, reference) in enumerate(zip(seeds, references, strict=True)):
        rows = slice(int(bounds[episode]), int(bounds[episode + 1]))
        actions = np.asarray(data.actions[rows])  # the environment's own action space
        recorded = np.asarray(data.rewards[rows], dtype=np.float64)
        # The committed windows chain into one real episode of the environment.
        assert len(recorded) == horizon and bool(data.timeouts[rows][-1])
        np.testing.assert_allclose(_replay(meta, seed, actions), recorded, atol=1e-4)
        # The reference is the noiseless policy's own return from the same reset.
        env = make_env(meta)
        obs, _ = env.reset(seed=seed)
        own = 0.0
        for _ in range(horizon):
            mean = bc(np.asarray(obs, dtype=np.float32)[None])[0]
            obs, reward, _, _, _ = env.step(bc.to_env(mean)[0])
            own += float(np.float32(reward))
        env.close()
        assert reference == pytest.approx(own, abs=1e-3)
        # Deterministic env, depth to the end: never below the policy, and above it somewhere.
        assert recorded.sum() >= own - 1e-3
        improved += int(recorded.sum() > own + 1e-3)
    assert improved > 0
    # Per episode, every decision simulates each candidate to the horizon.
    per_episode = candidates * sum(horizon - t for t in range(0, horizon, window))
    assert [task.simulator_steps for task in outcome.tasks] == [2 * per_episode] * 2
    assert outcome.shard_set.params["lookahead"]["window"] == window
    # Pendulum's box is [-2, 2]: actions are recorded in it, as a noisy pass records them.
    assert np.abs(np.asarray(data.actions)).max() > 1.0
    assert np.isfinite(np.asarray(data.rollout_log_prob)).all()


def test_lookahead_depth_bounds_each_candidate_and_mujoco_states_round_trip(
    make_test_dataset, tmp_path: Path
) -> None:
    """A MuJoCo env (Hopper-v5) read and set back replays the same steps; with a depth, each
    candidate is simulated for that many steps only (and the first reference to the end)."""
    env = gym.make("Hopper-v5")
    env.reset(seed=0)
    kind = env_state_kind(env)
    actions = np.random.default_rng(0).uniform(-1, 1, (6, 3))
    for action in actions[:3]:
        env.step(action)
    state = read_state(env, kind)
    after = [env.step(action)[0] for action in actions[3:]]
    env.reset(seed=1)
    set_state(env, kind, state)
    again = [env.step(action)[0] for action in actions[3:]]
    # Equal to rounding: the solver's warm start (qacc_warmstart) is not part of the state.
    np.testing.assert_allclose(np.asarray(after), np.asarray(again), rtol=0, atol=1e-9)
    env.close()

    made = make_test_dataset("hopper", "hdf5")
    checkpoint = _clone(made.dataset_id, tmp_path / "bc")
    config = RolloutConfig(
        episodes=2,
        n_envs=2,
        noise=parse_noise("gaussian:0.3"),
        seed=1,
        lookahead=Lookahead(candidates=3, window=4, depth=6),
    )
    outcome = rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=1)
    data = outcome.shard_set.load()
    assert len(data.episode_bounds()) == 3 and len(data) > 0
    lengths = np.diff(data.episode_bounds())
    # Each decision steps 3 candidates at most max(depth, window) = 6 steps (fewer when they
    # fall), and the first decision's reference at most the time limit (30).
    decisions = np.ceil(lengths / 4)
    bound = int((decisions * 3 * 6).sum() + 2 * 30)
    assert 0 < outcome.tasks[0].simulator_steps <= bound


def test_lookahead_is_refused_where_it_cannot_run() -> None:
    RolloutModel(lookahead={"candidates": 4, "window": 5, "depth": 20})
    with pytest.raises(ValidationError, match=r"filter 'none', tries 1.*set: filter, tries"):
        RolloutModel(lookahead={}, filter="policy", tries=4)
    with pytest.raises(ValidationError, match="set: backend"):
        RolloutModel(lookahead={}, backend="diffusion")
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        RolloutModel(lookahead={"candidates": 1})


def test_lookahead_refuses_a_discrete_policy(make_test_dataset, tmp_path: Path) -> None:
    made = make_test_dataset("cartpole", "hdf5")
    checkpoint = _clone(made.dataset_id, tmp_path / "bc")
    config = RolloutConfig(
        episodes=1, n_envs=1, noise=parse_noise("epsilon:0.1"), lookahead=Lookahead()
    )
    with pytest.raises(RolloutError, match="continuous action spaces only"):
        rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=1)


def _decision_scores(
    made_id: str, checkpoint: Path, search: Lookahead, value: DiscountedValue, t: int
) -> tuple[Any, int]:
    """One decision of the search from a reset state at episode step ``t`` (horizon 40)."""
    meta = load_transitions(made_id).meta
    noise = parse_noise("gaussian:0.5")
    config = RolloutConfig(episodes=1, n_envs=1, noise=noise, seed=2, horizon=40, lookahead=search)
    policy = load_rollout_policy(str(checkpoint))
    run = _Search(policy, lambda: make_env(meta), config, search, (None, None), value)
    env = run.envs[0]
    env.reset(seed=5)
    state = read_state(env, run.state_kind)
    decision = run._simulate(np.zeros(1, dtype=np.int64), [state], t)
    for made in run.envs:
        made.close()
    return decision, min(search.depth or 40, 40 - t)


def test_lookahead_bootstrap_adds_the_discounted_value_at_each_candidates_depth(
    make_test_dataset, tmp_path: Path
) -> None:
    """With ``bootstrap`` a candidate's score is sum_t gamma^t r_t + gamma^D V(s_D), computed
    here by hand from its own recorded window (window = depth, so the window is all it scores);
    where the depth reaches the time limit nothing is added."""
    made = make_test_dataset("pendulum", "hdf5")
    checkpoint = _clone(made.dataset_id, tmp_path / "bc")
    value = DiscountedValue(lambda s: 100.0 * s[:, 0] + 10.0 * s[:, 2], gamma=0.9)
    search = Lookahead(candidates=4, window=6, depth=6, bootstrap=True)
    decision, depth = _decision_scores(made.dataset_id, checkpoint, search, value, 0)
    rewards = decision.window["rewards"].astype(np.float64)
    last = decision.window["next_observations"][:, depth - 1]
    discounts = 0.9 ** np.arange(depth)
    expected = rewards @ discounts + 0.9**depth * value.value(last)
    np.testing.assert_allclose(decision.scores, expected, rtol=1e-6)
    assert np.ptp(value.value(last)) > 0.1  # the candidates end apart: V tells them apart
    # Four steps before the horizon the depth is the time limit: no V after it.
    decision, depth = _decision_scores(made.dataset_id, checkpoint, search, value, 36)
    assert depth == 4
    rewards = decision.window["rewards"][:, :depth].astype(np.float64)
    np.testing.assert_allclose(decision.scores, rewards @ (0.9 ** np.arange(depth)), atol=1e-6)


def test_lookahead_bootstrap_with_a_learners_value_runs_and_is_refused_without_one(
    make_test_dataset, tmp_path: Path
) -> None:
    """The rollout task passes the learner's own V (IQL's) to the search; a clone, a search
    without a depth and a call without a value are refused with what to change."""
    made = make_test_dataset("pendulum", "hdf5")
    checkpoint = _clone(made.dataset_id, tmp_path / "bc")
    iql = _clone(made.dataset_id, tmp_path / "iql", "iql", steps=40)
    search = Lookahead(candidates=3, window=5, depth=10, bootstrap=True)
    noise = parse_noise("gaussian:0.3")
    config = RolloutConfig(episodes=2, n_envs=2, noise=noise, horizon=20, lookahead=search)
    outcome = rollout_to_shard_set(
        made.dataset_id, checkpoint, config, tmp_path / "aug", tasks=1, learner=iql
    )
    data = outcome.shard_set.load()
    assert len(data) == 2 * 20 and np.isfinite(np.asarray(data.rewards)).all()
    assert outcome.shard_set.params["lookahead"]["bootstrap"] is True
    with pytest.raises(ValueError, match=r"lookahead\.bootstrap adds V"):
        rollout_to_shard_set(made.dataset_id, checkpoint, config, tmp_path / "aug2", tasks=1)
    RolloutModel(policy="iql", lookahead={"depth": 30, "bootstrap": True})
    with pytest.raises(ValidationError, match="BC clone has no critic"):
        RolloutModel(policy="bc", lookahead={"depth": 30, "bootstrap": True})
    with pytest.raises(ValidationError, match=r"set lookahead\.depth"):
        RolloutModel(policy="iql", lookahead={"bootstrap": True})
    # Off, the field stays out of the dump that keys the stages: runs from before it reuse theirs.
    assert "bootstrap" not in RolloutModel(lookahead={"depth": 30}).model_dump()["lookahead"]
    on = RolloutModel(policy="iql", lookahead={"depth": 30, "bootstrap": True})
    assert on.model_dump()["lookahead"]["bootstrap"] is True
