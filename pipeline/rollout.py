"""Noise-perturbed rollouts of the BC policy in the dataset's own simulator.

Many environments are stepped together: per step, one batched policy call gives every active
environment's mean action and the behaviour model's parameters, the noise picks the actions and
their exact log-densities (:mod:`offaug.pipeline.noise`), and each environment steps. Every
transition carries

* ``rollout_log_prob``: log mu(a|s) of the noisy rollout policy,
* ``behaviour_log_prob``: log beta_hat(a|s) under the BC behaviour model (a Gaussian truncated
  to the action box),
* ``importance_weight``: beta_hat/mu, clipped at ``max_weight``,

and the extras ``cumulative_log_ratio`` (the running sum of log beta_hat - log mu inside the
episode), ``per_decision_weight`` (its exponential, clipped) and ``self_normalised_weight``
(the importance weight divided by its mean over the rollout). Densities are over the
environment's action box.

Terminations and truncations are recorded exactly as Gymnasium reports them; environments are
reset by this loop (no automatic reset), so a step never mixes two episodes.

**Start states.** ``reset`` starts every episode from ``env.reset``. ``dataset`` branches from
dataset states: a random dataset transition's simulator state (``infos/qpos``, ``infos/qvel``,
recorded by MuJoCo datasets made with offaug or Minari's collectors) is set with
``set_state`` after a reset; the time limit then counts from the branch point.

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
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from offaug.pipeline.noise import ContinuousNoise, DiscreteNoise, parse_noise, truncnorm_log_prob

logger = logging.getLogger(__name__)
StartKind = Literal["reset", "dataset"]


class RolloutError(RuntimeError):
    """A rollout that cannot go on (a policy that outputs NaN, an env that never resets)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to roll a policy out."""

    episodes: int = 10
    """Episodes to collect in total."""
    n_envs: int = 8
    """Environments stepped together (one batched policy call per step)."""
    noise: str = "gaussian:0.1"
    """Noise specification (see :mod:`offaug.pipeline.noise`), in normalised action units."""
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


@dataclasses.dataclass(frozen=True)
class Fault:
    """One environment failure handled during a rollout."""

    kind: str
    message: str
    env_index: int
    step: int


class RolloutPolicy(Protocol):
    """What the rollout needs from a policy (a BC trainer adapts to it)."""

    discrete: bool

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        """Mean action in ``[-1, 1]`` (or logits for discrete) and the behaviour log std."""

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Normalised actions to the environment's action space."""

    @property
    def log_abs_det(self) -> float:
        """log |d normalised / d env action|: converts normalised-box densities to env's box."""


class BCRolloutPolicy:
    """Adapts an offaug BC trainer (Gaussian policy, or categorical for discrete actions)."""

    def __init__(self, trainer: Any) -> None:
        # torch is imported here, not at module level: the pipeline's stage module imports this
        # one, and a Dask worker should not pay for torch before a stage that needs it.
        import torch

        from offaug.algorithms.bc import BC
        from offaug.algorithms.networks import LOG_STD_MAX, LOG_STD_MIN, TruncatedGaussianActor

        self._log_std_bounds = (LOG_STD_MIN, LOG_STD_MAX)

        if not isinstance(trainer, BC):
            raise TypeError("rollouts need a BC policy (offaug train bc ...)")
        if not trainer.spaces.discrete and not isinstance(trainer.policy, TruncatedGaussianActor):
            raise TypeError(
                "rollouts need a Gaussian BC policy (its log-probabilities weight the data)"
            )
        self.trainer = trainer
        self.discrete = trainer.spaces.discrete
        # The frozen policy as numpy matrices: for a rollout step's small batch numpy's per-call
        # overhead is half of torch's, and the loop never leaves numpy.
        network = trainer.policy if self.discrete else trainer.policy.net
        assert isinstance(network, torch.nn.Module)
        self._layers = [
            (
                m.weight.detach().cpu().numpy().T.astype(np.float32).copy(),
                m.bias.detach().cpu().numpy().astype(np.float32),
            )
            for m in network.modules()
            if isinstance(m, torch.nn.Linear)
        ]
        # The normaliser's affine map, in numpy: the rollout loop stays off torch between calls.
        self._scale = trainer.normaliser.scale.cpu().numpy().astype(np.float64)
        self._offset = trainer.normaliser.offset.cpu().numpy().astype(np.float64)

    def __call__(
        self, observations: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
        x = np.asarray(observations, dtype=np.float32)
        last = len(self._layers) - 1
        for k, (weight, bias) in enumerate(self._layers):
            x = x @ weight + bias
            if k < last:
                np.maximum(x, 0.0, out=x)
        out = x.astype(np.float64)
        if self.discrete:
            return out, None
        mean, log_std = np.split(out, 2, axis=-1)
        return np.tanh(mean), np.clip(log_std, *self._log_std_bounds)

    def to_env(self, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if self.discrete:
            return actions
        return ((actions - self._offset) / self._scale).astype(np.float32)

    @property
    def log_abs_det(self) -> float:
        return 0.0 if self.discrete else float(self.trainer.normaliser.log_abs_det)


class _GrowingColumns:
    """Column arrays that double their capacity as episodes are appended."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        self.shapes = dict(shapes)
        self.capacity = 1024
        self.size = 0
        self.arrays = {
            k: np.empty((self.capacity, *s), dtype=d) for k, (s, d) in self.shapes.items()
        }

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


@dataclasses.dataclass
class RolloutResult:
    """Collected transitions and what happened on the way."""

    transitions: Any  # offaug.datasets.Transitions
    faults: list[Fault]
    episode_returns: list[float]
    weight_stats: dict[str, float]
    bad_steps: list[dict[str, Any]]


def weight_statistics(
    weights: npt.NDArray[Any], raw_log_ratio: npt.NDArray[Any], max_weight: float
) -> dict[str, float]:
    """ESS = (sum w)^2 / sum w^2, ESS/N, clipped fraction, maximum and mean log-ratio."""
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if n == 0:
        return {
            "n": 0,
            "ess": 0.0,
            "ess_fraction": 0.0,
            "clipped_fraction": 0.0,
            "max_weight": 0.0,
            "mean_log_ratio": 0.0,
        }
    ess = float(w.sum() ** 2 / max(float((w**2).sum()), 1e-300))
    return {
        "n": n,
        "ess": ess,
        "ess_fraction": ess / n,
        "clipped_fraction": float(np.mean(raw_log_ratio > math.log(max_weight))),
        "max_weight": float(np.exp(min(float(raw_log_ratio.max()), 700.0))),
        "mean_log_ratio": float(raw_log_ratio.mean()),
    }


def _set_dataset_state(
    env: Any, qpos: npt.NDArray[Any], qvel: npt.NDArray[Any]
) -> npt.NDArray[Any]:
    base = env.unwrapped
    if not hasattr(base, "set_state"):
        raise RolloutError(
            f"{base.spec.id if base.spec else base}: cannot set simulator state; use start='reset'"
        )
    base.set_state(qpos, qvel)
    return np.asarray(base._get_obs())


def rollout(
    policy: RolloutPolicy,
    env_factory: Any,
    config: RolloutConfig,
    *,
    start_states: tuple[npt.NDArray[Any], npt.NDArray[Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
    close_envs: bool = True,
) -> RolloutResult:
    """Collect ``config.episodes`` noisy episodes.

    Args:
        policy: Mean actions and behaviour parameters (e.g. :class:`BCRolloutPolicy`).
        env_factory: A zero-argument callable that makes one environment.
        config: Episodes, environments, noise, seed, clipping, start states.
        start_states: ``(qpos, qvel)`` arrays to branch from when ``config.start == "dataset"``.
        meta: Copied into the result's ``Transitions.meta`` (spaces, env spec, provenance).
        close_envs: Close the environments at the end (False when they come from a pool).
    """
    from threadpoolctl import threadpool_limits

    # Rollout steps multiply small matrices: a multi-threaded BLAS only spins (measured 25x
    # slower on a busy 2-core machine), so numpy's BLAS runs on one thread here.
    with threadpool_limits(limits=1):
        return _rollout(
            policy, env_factory, config, start_states=start_states, meta=meta, close_envs=close_envs
        )


def _rollout(
    policy: RolloutPolicy,
    env_factory: Any,
    config: RolloutConfig,
    *,
    start_states: tuple[npt.NDArray[Any], npt.NDArray[Any]] | None,
    meta: Mapping[str, Any] | None,
    close_envs: bool,
) -> RolloutResult:
    from offaug.datasets.transitions import Source, Transitions

    if config.episodes <= 0 or config.n_envs <= 0:
        raise ValueError("episodes and n_envs must be positive")
    if config.start == "dataset" and start_states is None:
        raise RolloutError("start='dataset' needs the dataset's infos/qpos and infos/qvel")
    rng = np.random.default_rng(config.seed)
    n_envs = min(config.n_envs, config.episodes)
    envs = [env_factory() for _ in range(n_envs)]
    observation_dim = int(np.prod(envs[0].observation_space.shape))
    spec = parse_noise(config.noise)
    if policy.discrete:
        n_actions = int(envs[0].action_space.n)
        noise: ContinuousNoise | DiscreteNoise = DiscreteNoise(spec, n_actions, rng)
        action_shape: tuple[int, ...] = ()
        action_dtype: Any = np.int64
    else:
        action_dim = int(np.prod(envs[0].action_space.shape))
        noise = ContinuousNoise(spec, n_envs, action_dim, rng)
        action_shape, action_dtype = (action_dim,), np.float32
    limit = config.max_episode_steps or getattr(envs[0].spec, "max_episode_steps", None) or 1000
    columns = {
        "observations": ((observation_dim,), np.float32),
        "actions": (action_shape, action_dtype),
        "rewards": ((), np.float32),
        "next_observations": ((observation_dim,), np.float32),
        "terminals": ((), np.bool_),
        "timeouts": ((), np.bool_),
        "rollout_log_prob": ((), np.float64),
        "behaviour_log_prob": ((), np.float64),
    }
    # Per-env staging for the episode in progress, pre-allocated for a whole time limit.
    staging = {k: np.zeros((n_envs, limit, *s), dtype=d) for k, (s, d) in columns.items()}
    lengths = np.zeros(n_envs, dtype=np.int64)
    output = _GrowingColumns(columns)
    episode_lengths: list[int] = []
    faults: list[Fault] = []
    bad_steps: list[dict[str, Any]] = []
    returns: list[float] = []
    observations = np.zeros((n_envs, observation_dim), dtype=np.float32)
    active = np.ones(n_envs, dtype=bool)
    started = 0
    step_count = 0

    def start_episode(i: int) -> None:
        nonlocal started
        for attempt in range(3):
            try:
                obs, _ = envs[i].reset(seed=int(config.seed * 100_003 + started * 7 + attempt))
                if config.start == "dataset":
                    assert start_states is not None
                    row = int(rng.integers(0, len(start_states[0])))
                    obs = _set_dataset_state(envs[i], start_states[0][row], start_states[1][row])
                observations[i] = np.asarray(obs, dtype=np.float32).reshape(-1)
                break
            except RolloutError:
                raise
            except Exception as exc:  # arbitrary environment code: count it and retry
                faults.append(Fault(type(exc).__name__, str(exc), i, step_count))
        else:
            raise RolloutError(f"environment {i} failed to reset three times: {faults[-1]}")
        lengths[i] = 0
        noise.reset([i])
        started += 1

    def finish_episode(i: int) -> None:
        n = int(lengths[i])
        if n > 0:
            output.append({k: v[i] for k, v in staging.items()}, n)
            episode_lengths.append(n)
            returns.append(float(staging["rewards"][i, :n].sum()))
        if started < config.episodes:
            start_episode(i)
        else:
            active[i] = False

    for env_index in range(n_envs):
        start_episode(env_index)

    while active.any():
        if len(faults) > config.max_faults:
            raise RolloutError(f"{len(faults)} environment faults; last: {faults[-1]}")
        index = np.flatnonzero(active)
        obs_batch = observations[index]
        mean, log_std = policy(obs_batch)
        if not np.isfinite(mean).all() or (log_std is not None and not np.isfinite(log_std).all()):
            bad = int((~np.isfinite(mean)).any(-1).sum())
            raise RolloutError(
                f"the policy returned NaN/inf for {bad} observations at rollout step "
                f"{step_count}; the BC checkpoint is broken: retrain it"
            )
        if policy.discrete:
            logits = mean
            greedy = logits.argmax(-1)
            assert isinstance(noise, DiscreteNoise)
            discrete_actions, log_mu = noise.sample(greedy)
            log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            log_beta = np.take_along_axis(log_probs, discrete_actions[:, None], -1)[:, 0]
            env_actions = discrete_actions
        else:
            assert isinstance(noise, ContinuousNoise) and log_std is not None
            # Only the active envs' OU states take part in this step.
            full_state = noise.ou_state
            noise.ou_state = full_state[index]
            actions, log_mu = noise.sample(mean)
            full_state[index] = noise.ou_state
            noise.ou_state = full_state
            log_beta = truncnorm_log_prob(actions, mean, np.exp(log_std))
            env_actions = policy.to_env(actions)
            log_mu = log_mu + policy.log_abs_det
            log_beta = log_beta + policy.log_abs_det
        step_count += 1
        n_active = len(index)
        next_batch = np.zeros((n_active, observation_dim), dtype=np.float32)
        reward_batch = np.zeros(n_active)
        terminated_batch = np.zeros(n_active, dtype=bool)
        truncated_batch = np.zeros(n_active, dtype=bool)
        failed = np.zeros(n_active, dtype=bool)
        # The only per-environment Python work: the step itself and copying its result.
        for j, env_id in enumerate(index.tolist()):
            try:
                next_obs, reward, terminated, truncated, _ = envs[env_id].step(env_actions[j])
            except Exception as exc:  # arbitrary environment code: end the episode, go on
                faults.append(Fault(type(exc).__name__, str(exc), env_id, step_count))
                logger.warning(
                    "env %d raised %s at step %d: %s", env_id, type(exc).__name__, step_count, exc
                )
                failed[j] = True
                continue
            next_batch[j] = next_obs
            reward_batch[j] = reward
            terminated_batch[j] = terminated
            truncated_batch[j] = truncated
        finite = np.isfinite(next_batch).all(1) & np.isfinite(reward_batch)
        for j in np.flatnonzero(~finite & ~failed).tolist():
            faults.append(
                Fault("NonFinite", "NaN/inf observation or reward", int(index[j]), step_count)
            )
            bad_steps.append(
                {
                    "env_index": int(index[j]),
                    "step": step_count,
                    "observation": observations[index[j]].tolist(),
                    "action": np.asarray(env_actions[j]).tolist(),
                    "next_observation": next_batch[j].tolist(),
                    "reward": float(reward_batch[j]),
                }
            )
        ok = finite & ~failed
        rows, t = index[ok], lengths[index[ok]]
        staging["observations"][rows, t] = observations[rows]
        staging["actions"][rows, t] = env_actions[ok]
        staging["rewards"][rows, t] = reward_batch[ok]
        staging["next_observations"][rows, t] = next_batch[ok]
        staging["terminals"][rows, t] = terminated_batch[ok]
        # An episode that reaches the staging limit is truncated there.
        ended_by_limit = (t + 1 >= limit) & ~terminated_batch[ok]
        staging["timeouts"][rows, t] = truncated_batch[ok] | ended_by_limit
        staging["rollout_log_prob"][rows, t] = log_mu[ok]
        staging["behaviour_log_prob"][rows, t] = log_beta[ok]
        lengths[rows] = t + 1
        observations[rows] = next_batch[ok]
        # A failed step is not data: the episode ends at its previous step, as truncated.
        for failed_env in index[~ok].tolist():
            if lengths[failed_env] > 0:
                staging["timeouts"][failed_env, lengths[failed_env] - 1] = True
            finish_episode(failed_env)
        done = terminated_batch[ok] | truncated_batch[ok] | ended_by_limit
        for done_env in rows[done].tolist():
            finish_episode(done_env)
    if close_envs:
        for env in envs:
            env.close()

    data = output.result()
    lengths_array = np.asarray(episode_lengths, dtype=np.int64)
    episode_ids = np.repeat(np.arange(len(lengths_array), dtype=np.int64), lengths_array)
    raw_log_ratio = data["behaviour_log_prob"] - data["rollout_log_prob"]
    log_clip = math.log(config.max_weight)
    weights = np.exp(np.minimum(raw_log_ratio, log_clip))
    # Running sum of log-ratios inside each episode: cumsum minus the sum up to episode start.
    cumulative = np.cumsum(raw_log_ratio)
    starts = np.concatenate(([0], np.cumsum(lengths_array)[:-1]))
    offsets = np.repeat(cumulative[starts] - raw_log_ratio[starts], lengths_array)
    cumulative_log_ratio = cumulative - offsets
    per_decision = np.exp(np.minimum(cumulative_log_ratio, log_clip))
    stats = weight_statistics(weights, raw_log_ratio, config.max_weight)
    transitions = Transitions(
        observations=data["observations"],
        actions=data["actions"],
        rewards=data["rewards"],
        next_observations=data["next_observations"],
        terminals=data["terminals"],
        timeouts=data["timeouts"],
        episode_ids=episode_ids,
        rollout_log_prob=data["rollout_log_prob"].astype(np.float32),
        behaviour_log_prob=data["behaviour_log_prob"].astype(np.float32),
        importance_weight=weights.astype(np.float32),
        source=np.full(len(weights), Source.SIMULATOR, dtype=np.int8),
        extras={
            "cumulative_log_ratio": cumulative_log_ratio.astype(np.float32),
            "per_decision_weight": per_decision.astype(np.float32),
            "self_normalised_weight": (weights / max(float(weights.mean()), 1e-300)).astype(
                np.float32
            )
            if len(weights)
            else weights.astype(np.float32),
        },
        meta={
            **dict(meta or {}),
            "rollout": {**dataclasses.asdict(config), "faults": len(faults), "weight_stats": stats},
        },
    )
    return RolloutResult(transitions, faults, returns, stats, bad_steps)


def save_faults(result: RolloutResult, directory: str | Path) -> Path | None:
    """Write the faults and offending steps to ``faults.json`` (None when there were none)."""
    if not result.faults:
        return None
    from offaug.datasets.atomic import write_json_atomic

    path = Path(directory) / "faults.json"
    write_json_atomic(
        path,
        {"faults": [dataclasses.asdict(f) for f in result.faults], "bad_steps": result.bad_steps},
    )
    return path


def checkpoint_hash(path: str | Path) -> str:
    """The xxh3-128 digest of a policy checkpoint (recorded as provenance)."""
    from offaug.datasets.shards import file_checksum

    return file_checksum(path)


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


def dataset_start_states(transitions: Any) -> tuple[npt.NDArray[Any], npt.NDArray[Any]] | None:
    """``(qpos, qvel)`` of a dataset's states when it records them (``info_keys`` on load)."""
    extras: Mapping[str, npt.NDArray[Any]] = transitions.extras
    if "infos/qpos" in extras and "infos/qvel" in extras:
        return np.asarray(extras["infos/qpos"]), np.asarray(extras["infos/qvel"])
    return None


# Environments kept by each worker process between rollout tasks, keyed by env spec.
_ENV_POOL: dict[str, list[Any]] = {}


@dataclasses.dataclass(frozen=True)
class RolloutTask:
    """One unit of rollout work: a reference, not data, so it can travel to a Dask worker."""

    source: str
    """The dataset the policy was cloned from (its env, spaces and start states)."""
    policy: str
    """Path of the BC checkpoint."""
    config: RolloutConfig
    """Episodes, noise, seed, ... of this task."""
    shard_path: str
    """Where this task's shard goes."""
    env_id: str | None = None
    """Roll out in this env instead of the dataset's."""
    task_index: int = 0
    """Position among the tasks of one rollout stage."""


@dataclasses.dataclass(frozen=True)
class RolloutShard:
    """What a rollout task produced: a shard reference and its statistics."""

    shard: Any  # offaug.datasets.shards.ShardRef
    weight_stats: dict[str, float]
    faults: int
    episode_returns: tuple[float, ...]


def run_rollout_task(task: RolloutTask) -> RolloutShard:
    """Load the policy and dataset, roll out, write one shard atomically."""
    from offaug.algorithms.evaluate import make_env
    from offaug.algorithms.train import load_trainer
    from offaug.datasets.shards import write_shard
    from offaug.datasets.sources import load_transitions

    info_keys = ["qpos", "qvel"] if task.config.start == "dataset" else []
    data = load_transitions(task.source, info_keys=info_keys)
    trainer = load_trainer(task.policy, device="cpu")
    policy = BCRolloutPolicy(trainer)
    kwargs: dict[str, Any] = {}
    if task.config.max_episode_steps is not None:
        kwargs["max_episode_steps"] = task.config.max_episode_steps
    from offaug.datasets.transitions import SPACE_META_KEYS

    meta = {key: data.meta.get(key) for key in SPACE_META_KEYS}
    meta["format"] = "offaug-rollout"
    meta["provenance"] = {
        "source": task.source,
        "policy": task.policy,
        "policy_checkpoint_xxh3": checkpoint_hash(task.policy),
        "noise": task.config.noise,
        "seed": task.config.seed,
        "env_id": task.env_id,
        "task_index": task.task_index,
    }
    pool_key = json.dumps([data.meta.get("env_spec"), task.env_id, kwargs], sort_keys=True)
    pool = _ENV_POOL.setdefault(pool_key, [])
    taken: list[Any] = []

    def pooled_env() -> Any:
        env = pool.pop() if pool else make_env(data.meta, task.env_id, **kwargs)
        taken.append(env)
        return env

    result = rollout(
        policy,
        pooled_env,
        task.config,
        start_states=dataset_start_states(data) if task.config.start == "dataset" else None,
        meta=meta,
        close_envs=False,
    )
    # Back to this process's pool: the next task on this worker skips building them (every
    # episode starts with a seeded reset, so no state carries over).
    pool.extend(taken)
    shard_path = Path(task.shard_path)
    shard_path.parent.mkdir(parents=True, exist_ok=True)
    save_faults(result, shard_path.parent / f"{shard_path.stem}.faults") if result.faults else None
    ref = write_shard(result.transitions, shard_path)
    return RolloutShard(ref, result.weight_stats, len(result.faults), tuple(result.episode_returns))


def split_tasks(
    source: str,
    policy: str,
    config: RolloutConfig,
    out: str | Path,
    tasks: int,
    env_id: str | None = None,
) -> list[RolloutTask]:
    """Split ``config.episodes`` over ``tasks`` tasks, each with its own seed and shard."""
    tasks = max(1, min(tasks, config.episodes))
    counts = [
        config.episodes // tasks + (1 if i < config.episodes % tasks else 0) for i in range(tasks)
    ]
    return [
        RolloutTask(
            source=source,
            policy=str(policy),
            config=dataclasses.replace(config, episodes=count, seed=config.seed * 1000 + i),
            shard_path=str(Path(out) / f"shard-{i:05d}.arrow"),
            env_id=env_id,
            task_index=i,
        )
        for i, count in enumerate(counts)
    ]


def merge_rollout_shards(
    out: str | Path, results: list[RolloutShard], params: Mapping[str, Any]
) -> Any:
    """Write the shard-set manifest over finished rollout tasks (with pooled weight stats)."""
    from offaug.datasets.shards import ShardSet, read_shard

    directory = Path(out).absolute()
    weights = []
    log_ratios = []
    meta: dict[str, Any] = {}
    for result in results:
        part = read_shard(result.shard.path, checksum=result.shard.checksum)
        meta = dict(part.meta)
        if (
            part.importance_weight is not None
            and part.behaviour_log_prob is not None
            and part.rollout_log_prob is not None
        ):
            weights.append(np.asarray(part.importance_weight, dtype=np.float64))
            log_ratios.append(
                np.asarray(part.behaviour_log_prob, dtype=np.float64)
                - np.asarray(part.rollout_log_prob, dtype=np.float64)
            )
    max_weight = float(params.get("max_weight", RolloutConfig.max_weight))
    pooled = weight_statistics(
        np.concatenate(weights) if weights else np.zeros(0),
        np.concatenate(log_ratios) if log_ratios else np.zeros(0),
        max_weight,
    )
    shard_set = ShardSet(
        directory=str(directory),
        shards=tuple(r.shard for r in results),
        source={
            "kind": "rollout",
            **{
                k: v
                for k, v in meta.get("provenance", {}).items()
                if k in ("source", "policy", "policy_checkpoint_xxh3", "env_id")
            },
        },
        params={
            **dict(params),
            "weight_stats": pooled,
            "per_shard": [
                {
                    "weight_stats": r.weight_stats,
                    "faults": r.faults,
                    "episodes": len(r.episode_returns),
                }
                for r in results
            ],
        },
        meta={k: v for k, v in meta.items() if k != "rollout"},
    )
    shard_set.write_manifest()
    return ShardSet.open(directory)
