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
over all its shards). The weight maths lives in :mod:`offaug.pipeline.behaviour`; densities are
over the environment's action box. Rollout tasks, their shards and the shard set are in
:mod:`offaug.pipeline.rollout_tasks`.

Terminations and truncations are recorded exactly as Gymnasium reports them; environments are
reset by this loop (no automatic reset), so a step never mixes two episodes.

**Start states.** ``reset`` starts every episode from ``env.reset``. ``dataset`` branches from
dataset states: a random dataset transition's simulator state (``infos/qpos``, ``infos/qvel``,
the :data:`~offaug.datasets.transitions.SIMULATOR_STATE_KEYS`, recorded by MuJoCo datasets made
with offaug or Minari's collectors) is set with ``set_state`` after a reset; the time limit
then counts from the branch point.

**Faults.** An ``env.step`` that raises ends that environment's episode as truncated (the
previous step becomes a timeout; the failed step is not data), the environment is reset, and
the fault (type, message, step, environment) is counted and logged. A NaN/inf observation or
reward is handled the same way, and the offending step is saved for debugging. A policy that
outputs NaN stops the rollout with :class:`RolloutError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from offaug.datasets.transitions import SIMULATOR_STATE_KEYS, Source, Transitions
from offaug.pipeline.behaviour import RolloutPolicy, policy_step, weight_columns
from offaug.pipeline.noise import DEFAULT_NOISE, ContinuousNoise, DiscreteNoise, NoiseSpec

# Re-exported: the diagnostics import the numpy BC policy from here.
from offaug.pipeline.policies import BCRolloutPolicy as BCRolloutPolicy

logger = logging.getLogger(__name__)
StartKind = Literal["reset", "dataset"]
StartStates = tuple[npt.NDArray[Any], npt.NDArray[Any]]
"""``(qpos, qvel)`` arrays of dataset states to branch from."""


class RolloutError(RuntimeError):
    """A rollout that cannot go on (a policy that outputs NaN, an env that never resets)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to roll a policy out."""

    episodes: int = 10
    """Episodes to collect in total."""
    n_envs: int = 8
    """Environments stepped together (one batched policy call per step)."""
    noise: NoiseSpec = DEFAULT_NOISE
    """Parsed noise specification (see :mod:`offaug.pipeline.noise`), in normalised units."""
    seed: int = 0
    """Seed of resets, noise and start-state choice."""
    max_weight: float = 100.0
    """Importance weights (and per-decision weights) are clipped at this value."""
    start: StartKind = "reset"
    """Where episodes start: environment resets, or branches from dataset states."""
    max_episode_steps: int | None = None
    """Override the environment's time limit."""
    max_faults: int = 1000
    """Stop with an error after this many environment faults."""

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values, the noise as the text it was parsed from."""
        return {**dataclasses.asdict(self), "noise": self.noise.text}


@dataclasses.dataclass(frozen=True)
class Fault:
    """One environment failure handled during a rollout."""

    kind: str
    message: str
    env_index: int
    step: int


@dataclasses.dataclass
class RolloutResult:
    """Collected transitions and what happened on the way."""

    transitions: Transitions
    faults: list[Fault]
    episode_returns: list[float]
    weight_stats: dict[str, float]
    bad_steps: list[dict[str, Any]]


def dataset_start_states(transitions: Transitions) -> StartStates | None:
    """``(qpos, qvel)`` of a dataset's states when it records them (``info_keys`` on load)."""
    keys = [f"infos/{key}" for key in SIMULATOR_STATE_KEYS]
    if all(key in transitions.extras for key in keys):
        qpos, qvel = (np.asarray(transitions.extras[key]) for key in keys)
        return qpos, qvel
    return None


def rollout(
    policy: RolloutPolicy,
    env_factory: Callable[[], Any],
    config: RolloutConfig,
    *,
    start_states: StartStates | None = None,
    meta: Mapping[str, Any] | None = None,
    close_envs: bool = True,
) -> RolloutResult:
    """Collect ``config.episodes`` noisy episodes.

    Args:
        policy: Mean actions and behaviour parameters (e.g.
            :class:`offaug.pipeline.policies.BCRolloutPolicy`).
        env_factory: A zero-argument callable that makes one environment.
        config: Episodes, environments, noise, seed, clipping, start states.
        start_states: ``(qpos, qvel)`` arrays to branch from when ``config.start == "dataset"``.
        meta: Copied into the result's ``Transitions.meta`` (spaces, env spec, provenance).
        close_envs: Close the environments at the end (False when they come from a pool).
    """
    if config.episodes <= 0 or config.n_envs <= 0:
        raise ValueError("episodes and n_envs must be positive")
    if config.start == "dataset" and start_states is None:
        raise RolloutError("start='dataset' needs the dataset's infos/qpos and infos/qvel")
    # Rollout steps multiply small matrices: a multi-threaded BLAS only spins on a busy
    # machine, so numpy's BLAS runs on one thread here.
    with threadpool_limits(limits=1):
        run = _Rollout(policy, env_factory, config, start_states)
        try:
            while run.active.any():
                run.step()
        finally:
            if close_envs:
                for env in run.envs:
                    env.close()
        return run.result(meta)


@dataclasses.dataclass
class _StepOutcome:
    """What the environments returned for one batched step (rows: the stepped envs)."""

    next_observations: npt.NDArray[np.float32]
    rewards: npt.NDArray[np.float64]
    terminated: npt.NDArray[np.bool_]
    truncated: npt.NDArray[np.bool_]
    failed: npt.NDArray[np.bool_]


class _Episodes:
    """Per-env staging for the episodes in progress, and the finished episodes' columns."""

    def __init__(self, columns: Mapping[str, tuple[tuple[int, ...], Any]], n_envs: int, limit: int):
        # Pre-allocated for a whole time limit per environment.
        self.staging = {k: np.zeros((n_envs, limit, *s), dtype=d) for k, (s, d) in columns.items()}
        self.lengths = np.zeros(n_envs, dtype=np.int64)
        self.output = _GrowingColumns(columns)
        self.episode_lengths: list[int] = []
        self.returns: list[float] = []

    def record(self, rows: npt.NDArray[np.int64], values: Mapping[str, npt.NDArray[Any]]) -> None:
        """Append one step to each of ``rows``' episodes."""
        t = self.lengths[rows]
        for name, column in values.items():
            self.staging[name][rows, t] = column
        self.lengths[rows] = t + 1

    def mark_last_timeout(self, env: int) -> None:
        """End ``env``'s episode at its last recorded step, as truncated."""
        if self.lengths[env] > 0:
            self.staging["timeouts"][env, self.lengths[env] - 1] = True

    def finish(self, env: int) -> None:
        """Move ``env``'s episode to the output (if it has steps) and empty its staging."""
        n = int(self.lengths[env])
        if n > 0:
            self.output.append({k: v[env] for k, v in self.staging.items()}, n)
            self.episode_lengths.append(n)
            self.returns.append(float(self.staging["rewards"][env, :n].sum()))
        self.lengths[env] = 0


class _Rollout:
    """The state of one rollout: environments, noise, episodes, faults; one step at a time."""

    def __init__(
        self,
        policy: RolloutPolicy,
        env_factory: Callable[[], Any],
        config: RolloutConfig,
        start_states: StartStates | None,
    ) -> None:
        self.policy, self.config, self.start_states = policy, config, start_states
        self.rng = np.random.default_rng(config.seed)
        n_envs = min(config.n_envs, config.episodes)
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
        self.episodes = _Episodes(columns, n_envs, self.limit)
        self.faults: list[Fault] = []
        self.bad_steps: list[dict[str, Any]] = []
        self.observations = np.zeros((n_envs, self.observation_dim), dtype=np.float32)
        self.active = np.ones(n_envs, dtype=bool)
        self.started = 0
        self.step_count = 0
        for env_index in range(n_envs):
            self.start_episode(env_index)

    def start_episode(self, i: int) -> None:
        """Reset environment ``i`` (branching from a dataset state if asked), retrying faults."""
        config = self.config
        for attempt in range(3):
            try:
                seed = int(config.seed * 100_003 + self.started * 7 + attempt)
                obs, _ = self.envs[i].reset(seed=seed)
                if config.start == "dataset":
                    assert self.start_states is not None
                    qpos, qvel = self.start_states
                    row = int(self.rng.integers(0, len(qpos)))
                    obs = _set_simulator_state(self.envs[i], qpos[row], qvel[row])
                self.observations[i] = np.asarray(obs, dtype=np.float32).reshape(-1)
                break
            except RolloutError:
                raise
            except Exception as exc:  # arbitrary environment code: count it and retry
                self.faults.append(Fault(type(exc).__name__, str(exc), i, self.step_count))
        else:
            raise RolloutError(f"environment {i} failed to reset three times: {self.faults[-1]}")
        self.noise.reset([i])
        self.started += 1

    def finish_episode(self, i: int) -> None:
        """Keep environment ``i``'s episode; start its next one, or retire it."""
        self.episodes.finish(i)
        if self.started < self.config.episodes:
            self.start_episode(i)
        else:
            self.active[i] = False

    def step(self) -> None:
        """One batched policy call and one step of every active environment."""
        if len(self.faults) > self.config.max_faults:
            raise RolloutError(f"{len(self.faults)} environment faults; last: {self.faults[-1]}")
        index = np.flatnonzero(self.active)
        mean, log_std = self.policy(self.observations[index])
        self._check_policy_output(mean, log_std)
        chosen = policy_step(self.policy, self.noise, mean, log_std, index)
        self.step_count += 1
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
        weights = weight_columns(
            data["behaviour_log_prob"], data["rollout_log_prob"], lengths, self.config.max_weight
        )
        transitions = Transitions(
            observations=data["observations"],
            actions=data["actions"],
            rewards=data["rewards"],
            next_observations=data["next_observations"],
            terminals=data["terminals"],
            timeouts=data["timeouts"],
            episode_ids=np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
            rollout_log_prob=data["rollout_log_prob"].astype(np.float32),
            behaviour_log_prob=data["behaviour_log_prob"].astype(np.float32),
            importance_weight=weights.importance_weight,
            source=np.full(int(lengths.sum()), Source.SIMULATOR, dtype=np.int8),
            extras=weights.extras,
            meta={
                **dict(meta or {}),
                "rollout": {
                    **self.config.to_json(),
                    "faults": len(self.faults),
                    "weight_stats": weights.stats,
                },
            },
        )
        return RolloutResult(
            transitions, self.faults, self.episodes.returns, weights.stats, self.bad_steps
        )


class _GrowingColumns:
    """Column arrays that double their capacity as episodes are appended."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        self.capacity = 1024
        self.size = 0
        self.arrays = {k: np.empty((self.capacity, *s), dtype=d) for k, (s, d) in shapes.items()}

    def append(self, block: Mapping[str, npt.NDArray[Any]], rows: int) -> None:
        while self.size + rows > self.capacity:
            self.capacity *= 2
            for name, array in self.arrays.items():
                grown = np.empty((self.capacity, *array.shape[1:]), dtype=array.dtype)
                grown[: self.size] = array[: self.size]
                self.arrays[name] = grown
        for name, values in block.items():
            self.arrays[name][self.size : self.size + rows] = values[:rows]
        self.size += rows

    def result(self) -> dict[str, npt.NDArray[Any]]:
        return {k: v[: self.size].copy() for k, v in self.arrays.items()}


def _set_simulator_state(
    env: Any, qpos: npt.NDArray[Any], qvel: npt.NDArray[Any]
) -> npt.NDArray[Any]:
    base = env.unwrapped
    if not hasattr(base, "set_state"):
        raise RolloutError(
            f"{base.spec.id if base.spec else base}: cannot set simulator state; use start='reset'"
        )
    base.set_state(qpos, qvel)
    return np.asarray(base._get_obs())


def describe(result: RolloutResult) -> str:
    """One line about a rollout: episodes, steps, faults, ESS."""
    stats = result.weight_stats
    return json.dumps(
        {
            "episodes": len(result.episode_returns),
            "steps": len(result.transitions),
            "faults": len(result.faults),
            "ess_fraction": round(stats.get("ess_fraction", 0.0), 4),
        }
    )
