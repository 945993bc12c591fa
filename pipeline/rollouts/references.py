"""Filters that judge a rollout episode against a reference of the rollout policy's own.

``filter: data`` (:mod:`offaug.pipeline.rollouts.data`) keeps what earns at least the data;
these two keep what beats the policy itself, so that rolling out a policy better than the data
still adds only what improves on it:

* **policy** (self-improvement): from each episode's start (the same ``env.reset`` seed, and
  the same dataset state for a branch) the noiseless policy, its noise centre, is rolled out
  too, under the same time limit and horizon; a noisy episode is kept only when its return
  beats that reference's. With ``rollout.rounds`` (train -> roll out -> retrain) this is policy
  iteration on real transitions: each round keeps the perturbations that improved on the
  current policy, judged by simulating the base policy itself as the rollout algorithms of
  approximate policy iteration do (Bertsekas & Tsitsiklis 1996, "Neuro-Dynamic Programming"),
  and imitates them as self-imitation learning imitates the returns that beat the agent's own
  value estimate (Oh et al. 2018, "Self-Imitation Learning").
* **value**: a branch of L steps from dataset row ``r`` is scored by its discounted return
  plus ``gamma^L V(s_L)`` (no bootstrap after a termination), ``V`` the rollout learner's own
  value (IQL's V, or its critics at its action: :class:`offaug.algorithms.base.StateValue`)
  and ``gamma`` its discount. It is kept when that beats the data's discounted return-to-go
  from row ``r`` to the end of its episode, bootstrapped the same way where the data's episode
  ends without a termination. Short branches from dataset states follow MBPO (Janner et al.
  2019, "When to Trust Your Model"); the bootstrapped H-step return is the n-step target of
  value learning (Sutton & Barto 2018, ch. 7), as in MVE (Feinberg et al. 2018).

Both keep an episode when ``score > reference - margin * L - tolerance * |reference|``
(``rollout.filter_margin`` and ``filter_tolerance``; strictly, so a noisy episode that only
equals its reference adds nothing). A reference that cannot be computed (its environment
raised, or returned NaN) is NaN, and its episode is dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.signal import lfilter

from offaug.datasets.transitions import Transitions
from offaug.pipeline.rollouts.behaviour import RolloutPolicy, noise_centre
from offaug.pipeline.rollouts.env_state import StartStates, set_state

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
StateValues = Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]
"""``(B, obs) -> (B,)``: a learner's ``V(s)`` (``offaug.algorithms.base.StateValue``)."""


@dataclasses.dataclass(frozen=True)
class DiscountedValue:
    """A state-value function and its discount: what MOBILE's penalty and the lookahead's
    bootstrap (``rollout.lookahead.bootstrap``) need of a rollout learner."""

    value: StateValues
    """``V(s)`` of a batch of states in the data's reward units: ``(B, obs) -> (B,)``."""
    gamma: float
    """The discount of ``r + gamma * V(s')``."""


def beats(
    scores: FloatArray,
    references: FloatArray,
    lengths: IntArray,
    margin: float = 0.0,
    tolerance: float = 0.0,
) -> npt.NDArray[np.bool_]:
    """(episodes,) bool: which scores beat their references (less ``margin`` per step and
    ``tolerance`` of the reference's size); a NaN reference is never beaten."""
    references = np.asarray(references, dtype=np.float64)
    allowed = references - margin * np.asarray(lengths, dtype=np.float64)
    allowed -= tolerance * np.abs(references)
    kept: npt.NDArray[np.bool_] = np.asarray(scores, dtype=np.float64) > allowed
    return kept


def noiseless_returns(
    policy: RolloutPolicy,
    envs: Sequence[Any],
    reset_seeds: IntArray,
    start_rows: IntArray,
    start_states: StartStates | None,
    limit: int,
) -> tuple[FloatArray, int]:
    """(episodes,) the return of the noise centre (:func:`noise_centre`) from each start, and
    the environment steps the references took (simulator steps spent on them).

    Each start is ``env.reset(seed=reset_seeds[i])``, then the dataset state of
    ``start_rows[i]`` when it is not negative, as the rollout began it; each reference ends at
    a termination, a truncation or ``limit`` steps; episodes of the same start share one
    reference, rolled out once. The envs are stepped together, one batched policy call per
    step. Rewards are summed as the rollout sums them (float32 each).
    """
    # Episodes of one start (``rollout.tries``) share one reference: each is rolled out once.
    starts, of_episode = np.unique(
        np.stack([np.asarray(reset_seeds), np.asarray(start_rows)], axis=1),
        axis=0,
        return_inverse=True,
    )
    seeds, rows = starts[:, 0], starts[:, 1]
    returns = np.full(len(starts), np.nan)
    env_steps = 0
    for first in range(0, len(starts), len(envs)):
        batch = np.arange(first, min(first + len(envs), len(starts)))
        returns[batch], taken = _noiseless_batch(
            policy, envs, seeds[batch], rows[batch], start_states, limit
        )
        env_steps += taken
    episode_returns: FloatArray = returns[np.asarray(of_episode).reshape(-1)]
    return episode_returns, env_steps


def reference_returns(
    returns: FloatArray,
    noiseless: npt.NDArray[np.bool_],
    reset_seeds: IntArray,
    start_rows: IntArray,
) -> FloatArray:
    """(episodes,) the return of the noiseless episode of each episode's start (reset seed and
    start row); NaN where that start has none (its reference failed or was not finished)."""
    of_start = {
        (int(reset_seeds[i]), int(start_rows[i])): float(returns[i])
        for i in np.flatnonzero(noiseless)
    }
    keys = zip(np.asarray(reset_seeds).tolist(), np.asarray(start_rows).tolist(), strict=True)
    return np.array([of_start.get((int(s), int(r)), np.nan) for s, r in keys], dtype=np.float64)


def _noiseless_batch(
    policy: RolloutPolicy,
    envs: Sequence[Any],
    reset_seeds: IntArray,
    start_rows: IntArray,
    start_states: StartStates | None,
    limit: int,
) -> tuple[FloatArray, int]:
    n = len(reset_seeds)
    totals = np.zeros(n)
    active = np.ones(n, dtype=bool)
    observations: list[npt.NDArray[np.float32]] = []
    for i in range(n):
        try:
            obs, _ = envs[i].reset(seed=int(reset_seeds[i]))
            if start_rows[i] >= 0:
                assert start_states is not None
                obs = set_state(envs[i], start_states.kind, start_states.row(int(start_rows[i])))
        except Exception:  # arbitrary environment code: no reference, so the episode is dropped
            totals[i], active[i] = np.nan, False
            obs = np.zeros(envs[i].observation_space.shape)
        observations.append(np.asarray(obs, dtype=np.float32).reshape(-1))
    current = np.stack(observations)
    steps = env_steps = 0
    while active.any() and steps < limit:
        index = np.flatnonzero(active)
        mean, _ = policy(current[index])
        actions = policy.to_env(noise_centre(policy, current[index], mean))
        steps += 1
        env_steps += len(index)
        for j, i in enumerate(index.tolist()):
            try:
                next_obs, reward, terminated, truncated, _ = envs[i].step(actions[j])
            except Exception:  # arbitrary environment code: no reference, as above
                totals[i], active[i] = np.nan, False
                continue
            next_obs = np.asarray(next_obs, dtype=np.float32).reshape(-1)
            if not (np.isfinite(next_obs).all() and np.isfinite(reward)):
                totals[i], active[i] = np.nan, False
                continue
            totals[i] += float(np.float32(reward))
            current[i] = next_obs
            active[i] = not (terminated or truncated)
    return totals, env_steps


def discounted_episode_returns(
    rewards: npt.ArrayLike, lengths: IntArray, gamma: float
) -> FloatArray:
    """(episodes,) ``sum_t gamma^t r_t`` of episodes of ``lengths`` consecutive rewards."""
    values = np.asarray(rewards, dtype=np.float64)
    if len(values) == 0:
        return np.zeros(len(lengths))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    steps = np.arange(len(values)) - np.repeat(starts, lengths)  # t inside each episode
    return np.asarray(np.add.reduceat(values * gamma ** steps.astype(np.float64), starts))


def discounted_returns_to_go(
    rewards: npt.ArrayLike,
    lengths: IntArray,
    gamma: float,
    final_values: FloatArray,
) -> FloatArray:
    """(N,) each row's ``sum_k gamma^k r_{row+k}`` to the end of its episode, plus
    ``gamma^(steps left) * final_values[episode]`` (pass 0 where the episode terminated)."""
    values = np.asarray(rewards, dtype=np.float64)
    to_go = np.zeros(len(values))
    end = 0
    for episode, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        start, end = end, end + length
        # y[n] = x[n] + gamma * y[n - 1] over the episode reversed, started from its final value.
        reversed_rewards = np.concatenate(([final_values[episode]], values[start:end][::-1]))
        to_go[start:end] = lfilter([1.0], [1.0, -gamma], reversed_rewards)[1:][::-1]
    return to_go


@dataclasses.dataclass(frozen=True)
class ValueFilter:
    """``filter: value``: a branch's value-bootstrapped return against the data's."""

    returns_to_go: FloatArray
    """(N,) the data's discounted return-to-go from each row, bootstrapped where its episode
    ends without a termination."""
    gamma: float
    """The learner's discount."""
    state_values: StateValues
    """The learner's ``V(s)``."""

    @classmethod
    def from_data(cls, data: Transitions, state_values: StateValues, gamma: float) -> ValueFilter:
        """The filter of a learner's value over ``data``'s episodes."""
        bounds = data.episode_bounds()
        last = bounds[1:] - 1
        terminated = np.asarray(data.terminals, dtype=bool)[last]
        final_values = _values(state_values, np.asarray(data.next_observations)[last])
        final_values[terminated] = 0.0
        to_go = discounted_returns_to_go(data.rewards, np.diff(bounds), gamma, final_values)
        return cls(to_go, gamma, state_values)

    def scores(
        self,
        rewards: npt.ArrayLike,
        lengths: IntArray,
        final_observations: npt.NDArray[np.float32],
        terminated: npt.NDArray[np.bool_],
    ) -> FloatArray:
        """(episodes,) ``sum_t gamma^t r_t + gamma^L V(s_L)`` of each episode (no ``V`` after a
        termination); ``final_observations``: each episode's last next observation."""
        bootstrap = _values(self.state_values, final_observations)
        bootstrap[np.asarray(terminated, dtype=bool)] = 0.0
        discount = self.gamma ** np.asarray(lengths, dtype=np.float64)
        return discounted_episode_returns(rewards, lengths, self.gamma) + discount * bootstrap

    def references(self, start_rows: IntArray) -> FloatArray:
        """(episodes,) the data's bootstrapped discounted return-to-go at each start row."""
        rows = np.asarray(start_rows, dtype=np.int64)
        if (rows < 0).any():
            raise ValueError("filter 'value' compares branches from dataset rows: start='dataset'")
        return np.asarray(self.returns_to_go[rows], dtype=np.float64)


def _values(state_values: StateValues, observations: npt.ArrayLike) -> FloatArray:
    states = np.asarray(observations, dtype=np.float32)
    if len(states) == 0:
        return np.zeros(0)
    return np.asarray(state_values(states.reshape(len(states), -1)), dtype=np.float64).reshape(-1)
