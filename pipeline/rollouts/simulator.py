"""Noise-perturbed rollouts of the BC policy in the dataset's own simulator.

Many environments are stepped together: per step, one batched policy call gives every active
environment's mean action and the behaviour model's parameters, :func:`behaviour.policy_step`
picks the noisy actions and their exact log-densities, and each environment steps. Every
transition carries

* ``rollout_log_prob``: log mu(a|s) of the noisy rollout policy,
* ``behaviour_log_prob``: log beta_hat(a|s) under the BC behaviour model (a Gaussian truncated
  to the action box),
* ``importance_weight``: beta_hat/mu, clipped at ``max_weight``,

and the extras ``cumulative_log_ratio`` (the running sum of log beta_hat - log mu inside the
episode), ``per_decision_weight`` (its exponential, clipped) and ``self_normalised_weight``
(the importance weight divided by its mean over the rollout; a merged shard set normalises it
over all its shards). The weight maths lives in :mod:`offaug.pipeline.rollouts.behaviour`;
densities are over the environment's action box. Rollout tasks, their shards and the shard set are
in
:mod:`offaug.pipeline.rollouts.tasks`.

Terminations and truncations are recorded exactly as Gymnasium reports them; environments are
reset by this loop (no automatic reset), so a step never mixes two episodes.

**Start states.** ``reset`` starts every episode from ``env.reset``. ``dataset`` branches from
dataset states: a dataset transition's recorded state (MuJoCo's ``infos/qpos``/``infos/qvel``
or a classic-control env's ``infos/state``; :mod:`offaug.pipeline.rollouts.env_state`) is set after
a reset; the time limit then counts from the branch point. The transition is drawn uniformly or with
given probabilities (``sparse`` starts, :mod:`offaug.pipeline.rollouts.data`). With a ``horizon`` H
every episode ends as truncated after H steps (short branched rollouts, as in MBPO/MOPO), from
dataset states and resets alike.

**Filter.** Before the weights are computed, the finished episodes are judged by the filter
(``data``, ``policy`` or ``value``) and, with ``tries``, the best of each start's stays
(:mod:`offaug.pipeline.rollouts.selection`). ``filter: policy``'s references are rolled out in
the same environments once the noisy episodes are done, or, with ``keep_reference``, are the
first try of each start, rolled out without noise (:func:`behaviour.at_centre`).

**Faults.** An ``env.step`` that raises ends that environment's episode as truncated (the
previous step becomes a timeout; the failed step is not data), the environment is reset, and
the fault (type, message, step, environment) is counted and logged. A NaN/inf observation or
reward is handled the same way, and the offending step is saved for debugging. A policy that
outputs NaN stops the rollout with :class:`RolloutError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from offaug.pipeline.rollouts.behaviour import (
    RolloutPolicy,
    at_centre,
    noise_centre,
    policy_step,
)
from offaug.pipeline.rollouts.config import Fault, RolloutConfig, RolloutError, RolloutResult
from offaug.pipeline.rollouts.data import (
    RESET_START,
    EpisodeFilter,
    draw_start_row,
    keep_episodes,
)
from offaug.pipeline.rollouts.env_state import StartStates, StateError, set_state
from offaug.pipeline.rollouts.episodes import EpisodeStaging, simulator_transitions
from offaug.pipeline.rollouts.noise import ContinuousNoise, DiscreteNoise
from offaug.pipeline.rollouts.references import ValueFilter, noiseless_returns
from offaug.pipeline.rollouts.selection import FinishedEpisodes, select_episodes

logger = logging.getLogger(__name__)


def rollout(
    policy: RolloutPolicy,
    env_factory: Callable[[], Any],
    config: RolloutConfig,
    *,
    start_states: StartStates | None = None,
    start_probabilities: npt.NDArray[np.float64] | None = None,
    episode_filter: EpisodeFilter | ValueFilter | None = None,
    meta: Mapping[str, Any] | None = None,
    close_envs: bool = True,
) -> RolloutResult:
    """Collect ``config.episodes`` noisy episodes (fewer when the filter drops some), or as
    many as ``config.simulator_steps`` environment steps make.

    Args:
        policy: beta_hat's parameters and, for a centred policy, the noise centre (e.g.
            :class:`offaug.pipeline.rollouts.policies.BCRolloutPolicy`).
        env_factory: A zero-argument callable that makes one environment.
        config: Episodes, environments, noise, seed, clipping, start states, horizon, filter.
        start_states: The dataset's states to branch from when ``config.start == "dataset"``.
        start_probabilities: (N,) how likely each start state is drawn (None: uniformly).
        episode_filter: What an episode must earn to be kept: the data's
            :class:`EpisodeFilter` for ``filter: data``, the learner's :class:`ValueFilter` for
            ``filter: value`` (``filter: policy`` needs none: its references are rolled out).
        meta: Copied into the result's ``Transitions.meta`` (spaces, env spec, provenance).
        close_envs: Close the environments at the end (False when they come from a pool).
    """
    if config.episodes <= 0 or config.n_envs <= 0:
        raise ValueError("episodes and n_envs must be positive")
    if config.simulator_steps is not None and config.simulator_steps <= 0:
        raise ValueError("simulator_steps must be positive (or None)")
    if config.horizon is not None and config.horizon <= 0:
        raise ValueError("horizon must be positive (or None)")
    if config.start == "dataset" and start_states is None:
        raise RolloutError("start='dataset' needs the dataset's recorded states (infos/...)")
    if config.filter == "data" and not isinstance(episode_filter, EpisodeFilter):
        raise ValueError("filter='data' needs the data's episode filter")
    if config.filter == "value" and not isinstance(episode_filter, ValueFilter):
        raise ValueError("filter='value' needs the learner's value filter")
    if config.filter == "value" and config.start != "dataset":
        raise RolloutError(
            "filter='value' compares branches with the data's return-to-go from their start row:"
            " it needs start='dataset' and a dataset that records its states"
        )
    # Rollout steps multiply small matrices: a multi-threaded BLAS only spins on a busy
    # machine, so numpy's BLAS runs on one thread here.
    with threadpool_limits(limits=1):
        run = _Rollout(policy, env_factory, config, (start_states, start_probabilities))
        run.episode_filter = episode_filter if config.filter in ("data", "value") else None
        try:
            while run.active.any():
                run.step()
            # Inside the try: filter 'policy' rolls its references out in the same envs.
            return run.result(meta)
        finally:
            if close_envs:
                for env in run.envs:
                    env.close()


@dataclasses.dataclass
class _StepOutcome:
    """What the environments returned for one batched step (rows: the stepped envs)."""

    next_observations: npt.NDArray[np.float32]
    rewards: npt.NDArray[np.float64]
    terminated: npt.NDArray[np.bool_]
    truncated: npt.NDArray[np.bool_]
    failed: npt.NDArray[np.bool_]


class _Rollout:
    """The state of one rollout: environments, noise, episodes, faults; one step at a time."""

    def __init__(
        self,
        policy: RolloutPolicy,
        env_factory: Callable[[], Any],
        config: RolloutConfig,
        starts: tuple[StartStates | None, npt.NDArray[np.float64] | None],
    ) -> None:
        self.policy, self.config = policy, config
        self.start_states, self.start_probabilities = starts
        self.episode_filter: EpisodeFilter | ValueFilter | None = None
        self.rng = np.random.default_rng(config.seed)
        if config.keep_reference and policy.discrete:
            raise RolloutError(
                "rollout.keep_reference rolls the noiseless policy out as the first try of each"
                " start: it supports continuous actions only; set keep_reference: false"
            )
        n_envs = min(config.n_envs, config.episodes)
        if config.simulator_steps is not None:
            n_envs = min(config.n_envs, config.simulator_steps)
        self.envs = [env_factory() for _ in range(n_envs)]
        self.observation_dim = int(np.prod(self.envs[0].observation_space.shape))
        action_shape: tuple[int, ...]
        action_dtype: type[np.generic]
        if policy.discrete:
            n_actions = int(self.envs[0].action_space.n)
            self.noise: ContinuousNoise | DiscreteNoise = DiscreteNoise(
                config.noise, n_actions, self.rng
            )
            action_shape, action_dtype = (), np.int64
        else:
            action_dim = int(np.prod(self.envs[0].action_space.shape))
            self.noise = ContinuousNoise(config.noise, n_envs, action_dim, self.rng)
            action_shape, action_dtype = (action_dim,), np.float32
        spec_limit = getattr(self.envs[0].spec, "max_episode_steps", None)
        self.limit = config.max_episode_steps or spec_limit or 1000
        if config.horizon is not None:
            self.limit = min(self.limit, config.horizon)
        columns = {
            "observations": ((self.observation_dim,), np.float32),
            "actions": (action_shape, action_dtype),
            "rewards": ((), np.float32),
            "next_observations": ((self.observation_dim,), np.float32),
            "terminals": ((), np.bool_),
            "timeouts": ((), np.bool_),
            "rollout_log_prob": ((), np.float64),
            "behaviour_log_prob": ((), np.float64),
        }
        self.episodes = EpisodeStaging(columns, n_envs, self.limit)
        self.faults: list[Fault] = []
        self.bad_steps: list[dict[str, Any]] = []
        self.observations = np.zeros((n_envs, self.observation_dim), dtype=np.float32)
        self.active = np.ones(n_envs, dtype=bool)
        self.start_rows = np.full(n_envs, RESET_START, dtype=np.int64)
        self.reset_seeds = np.zeros(n_envs, dtype=np.int64)
        self.started = 0
        self.noiseless = np.zeros(n_envs, dtype=bool)
        """Which environments run a noiseless reference episode (``keep_reference``)."""
        self.episode_noiseless: list[bool] = []
        """Per finished episode (as ``self.episodes`` lists them): was it a reference?"""
        self.start_rows_drawn: dict[int, int] = {}
        """Start index -> its dataset row (``tries``: every try branches from the same row)."""
        self.step_count = 0
        self.simulator_steps = 0
        """Environment steps taken so far."""
        for env_index in range(n_envs):
            self.start_episode(env_index)

    def start_episode(self, i: int) -> None:
        """Reset environment ``i`` (branching from a dataset state if asked), retrying faults."""
        config = self.config
        for attempt in range(3):
            try:
                # With tries K, episodes started*K .. started*K + K - 1 share one start.
                start = self.started // config.tries
                seed = int(config.seed * 100_003 + start * 7 + attempt)
                obs, _ = self.envs[i].reset(seed=seed)
                self.reset_seeds[i] = seed
                if config.start == "dataset":
                    assert self.start_states is not None
                    row = self.start_rows_drawn.get(start)
                    if row is None:
                        row = draw_start_row(
                            self.rng, len(self.start_states), self.start_probabilities
                        )
                        self.start_rows_drawn[start] = row
                    states = self.start_states
                    obs = set_state(self.envs[i], states.kind, states.row(row))
                    self.start_rows[i] = row
                self.observations[i] = np.asarray(obs, dtype=np.float32).reshape(-1)
                break
            except StateError as exc:
                raise RolloutError(str(exc)) from exc
            except RolloutError:
                raise
            except Exception as exc:  # arbitrary environment code: count it and retry
                self.faults.append(Fault(type(exc).__name__, str(exc), i, self.step_count))
        else:
            raise RolloutError(f"environment {i} failed to reset three times: {self.faults[-1]}")
        self.noise.reset([i])
        # keep_reference: the first try of each start is the noiseless policy.
        self.noiseless[i] = config.keep_reference and self.started % config.tries == 0
        self.started += 1

    def _finish(self, i: int) -> None:
        """Move environment ``i``'s episode to the finished ones (if it has steps)."""
        if self.episodes.lengths[i] > 0:
            self.episode_noiseless.append(bool(self.noiseless[i]))
        self.episodes.finish(i, int(self.start_rows[i]), int(self.reset_seeds[i]))
        self.start_rows[i] = RESET_START

    def finish_episode(self, i: int) -> None:
        """Keep environment ``i``'s episode; start its next one, or retire it."""
        self._finish(i)
        budget = self.config.simulator_steps
        if budget is None:
            more = self.started < self.config.episodes
        else:
            more = self.simulator_steps < budget
        if more:
            self.start_episode(i)
        else:
            self.active[i] = False

    def retire(self, i: int) -> None:
        """End environment ``i``'s episode where it stands, as truncated (the step budget is
        spent), and start no other."""
        self.episodes.mark_last_timeout(i)
        self._finish(i)
        self.active[i] = False

    def within_budget(self, index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The environments of ``index`` that the step budget lets step now (the others are
        retired)."""
        budget = self.config.simulator_steps
        if budget is None or self.simulator_steps + len(index) <= budget:
            return index
        left = budget - self.simulator_steps
        for env in index[left:].tolist():
            self.retire(env)
        return index[:left]

    def step(self) -> None:
        """One batched policy call and one step of every active environment."""
        if len(self.faults) > self.config.max_faults:
            raise RolloutError(f"{len(self.faults)} environment faults; last: {self.faults[-1]}")
        index = self.within_budget(np.flatnonzero(self.active))
        observations = self.observations[index]
        mean, log_std = self.policy(observations)
        self._check_policy_output(mean, log_std)
        centre = noise_centre(self.policy, observations, mean)
        self._check_policy_output(np.asarray(centre, dtype=np.float64), None)
        chosen = policy_step(self.policy, self.noise, mean, log_std, index, centre)
        quiet = self.noiseless[index]
        if quiet.any():
            assert isinstance(self.noise, ContinuousNoise) and log_std is not None
            self.noise.reset(index[quiet])  # no OU deviation carried into a noiseless episode
            chosen = at_centre(self.policy, self.noise, chosen, quiet, mean, log_std, centre)
        self.step_count += 1
        self.simulator_steps += len(index)
        outcome = self._step_envs(index, chosen.env_actions)
        ok = self._screen(index, chosen.env_actions, outcome)
        rows = index[ok]
        # An episode that reaches the staging limit is truncated there.
        ended_by_limit = (self.episodes.lengths[rows] + 1 >= self.limit) & ~outcome.terminated[ok]
        self.episodes.record(
            rows,
            {
                "observations": self.observations[rows],
                "actions": chosen.env_actions[ok],
                "rewards": outcome.rewards[ok],
                "next_observations": outcome.next_observations[ok],
                "terminals": outcome.terminated[ok],
                "timeouts": outcome.truncated[ok] | ended_by_limit,
                "rollout_log_prob": chosen.rollout_log_prob[ok],
                "behaviour_log_prob": chosen.behaviour_log_prob[ok],
            },
        )
        self.observations[rows] = outcome.next_observations[ok]
        # A failed step is not data: the episode ends at its previous step, as truncated.
        for failed_env in index[~ok].tolist():
            self.episodes.mark_last_timeout(failed_env)
            self.finish_episode(failed_env)
        done = outcome.terminated[ok] | outcome.truncated[ok] | ended_by_limit
        for done_env in rows[done].tolist():
            self.finish_episode(done_env)
        budget = self.config.simulator_steps
        if budget is not None and self.simulator_steps >= budget:
            for env in np.flatnonzero(self.active).tolist():
                self.retire(env)

    def _check_policy_output(
        self, mean: npt.NDArray[Any], log_std: npt.NDArray[Any] | None
    ) -> None:
        if np.isfinite(mean).all() and (log_std is None or np.isfinite(log_std).all()):
            return
        bad = int((~np.isfinite(mean)).any(-1).sum())
        raise RolloutError(
            f"the policy returned NaN/inf for {bad} observations at rollout step "
            f"{self.step_count}; the BC checkpoint is broken: retrain it"
        )

    def _step_envs(
        self, index: npt.NDArray[np.int64], env_actions: npt.NDArray[Any]
    ) -> _StepOutcome:
        n_active = len(index)
        outcome = _StepOutcome(
            next_observations=np.zeros((n_active, self.observation_dim), dtype=np.float32),
            rewards=np.zeros(n_active),
            terminated=np.zeros(n_active, dtype=bool),
            truncated=np.zeros(n_active, dtype=bool),
            failed=np.zeros(n_active, dtype=bool),
        )
        # The only per-environment Python work: the step itself and copying its result.
        for j, env_id in enumerate(index.tolist()):
            try:
                next_obs, reward, terminated, truncated, _ = self.envs[env_id].step(env_actions[j])
            except Exception as exc:  # arbitrary environment code: end the episode, go on
                self.faults.append(Fault(type(exc).__name__, str(exc), env_id, self.step_count))
                logger.warning(
                    "env %d raised %s at step %d: %s",
                    env_id,
                    type(exc).__name__,
                    self.step_count,
                    exc,
                )
                outcome.failed[j] = True
                continue
            outcome.next_observations[j] = next_obs
            outcome.rewards[j] = reward
            outcome.terminated[j] = terminated
            outcome.truncated[j] = truncated
        return outcome

    def _screen(
        self, index: npt.NDArray[np.int64], env_actions: npt.NDArray[Any], outcome: _StepOutcome
    ) -> npt.NDArray[np.bool_]:
        """Which rows are data: the step neither raised nor returned NaN/inf (saved as faults)."""
        finite = np.isfinite(outcome.next_observations).all(1) & np.isfinite(outcome.rewards)
        for j in np.flatnonzero(~finite & ~outcome.failed).tolist():
            env_id = int(index[j])
            self.faults.append(
                Fault("NonFinite", "NaN/inf observation or reward", env_id, self.step_count)
            )
            self.bad_steps.append(
                {
                    "env_index": env_id,
                    "step": self.step_count,
                    "observation": self.observations[env_id].tolist(),
                    "action": np.asarray(env_actions[j]).tolist(),
                    "next_observation": outcome.next_observations[j].tolist(),
                    "reward": float(outcome.rewards[j]),
                }
            )
        ok: npt.NDArray[np.bool_] = finite & ~outcome.failed
        return ok

    def result(self, meta: Mapping[str, Any] | None) -> RolloutResult:
        """The collected episodes as :class:`Transitions` with every weight column."""
        data = self.episodes.output.result()
        lengths = np.asarray(self.episodes.episode_lengths, dtype=np.int64)
        returns = np.asarray(self.episodes.returns, dtype=np.float64)
        dropped = 0
        record = None
        if self.config.filter != "none" or self.config.tries > 1:
            finished = FinishedEpisodes(
                returns=returns,
                lengths=lengths,
                start_rows=np.asarray(self.episodes.start_rows, dtype=np.int64),
                reset_seeds=np.asarray(self.episodes.reset_seeds, dtype=np.int64),
                rewards=data["rewards"],
                next_observations=data["next_observations"],
                terminals=data["terminals"],
                noiseless=np.asarray(self.episode_noiseless, dtype=bool),
            )
            selection = select_episodes(
                finished, self.config, self.episode_filter, self._roll_references
            )
            # Spent like any other (after the budget, which bounds the noisy episodes).
            self.simulator_steps += selection.reference_steps
            keep, record = selection.keep, selection.record
            data = keep_episodes(data, lengths, keep)
            lengths, returns = lengths[keep], returns[keep]
            dropped = int((~keep).sum())
        transitions, weights = simulator_transitions(
            data,
            lengths,
            {
                **dict(meta or {}),
                "rollout": {
                    **self.config.to_json(),
                    "faults": len(self.faults),
                    "episodes_dropped": dropped,
                },
            },
            self.config.max_weight,
        )
        return RolloutResult(
            transitions,
            self.faults,
            returns.tolist(),
            weights.stats,
            self.bad_steps,
            dropped,
            record,
            self.simulator_steps,
        )

    def _roll_references(
        self, reset_seeds: npt.NDArray[np.int64], start_rows: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.float64], int]:
        """``filter: policy``'s references, rolled out in this rollout's environments."""
        return noiseless_returns(
            self.policy, self.envs, reset_seeds, start_rows, self.start_states, self.limit
        )
