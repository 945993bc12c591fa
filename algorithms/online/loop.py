"""Online SAC: the replay buffer and the environment loop behind D4RL-style dataset levels.

:class:`ReplayBuffer` holds preallocated numpy transitions (a FIFO, or an ever-growing record
of every transition in order, as D4RL's medium-replay needs); :func:`train_online` runs
:class:`~offaug.algorithms.learners.sac.SAC` in a Gymnasium environment, evaluates the deterministic
policy periodically and can record everything it saw. Minibatches cross into torch through
:meth:`~offaug.algorithms.batch.TorchBatch.from_batch`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
from minari.data_collector import EpisodeBuffer

from offaug.algorithms.base import Spaces
from offaug.algorithms.batch import TorchBatch
from offaug.algorithms.evaluate import evaluate, make_env
from offaug.algorithms.learners.sac import SAC, SACConfig
from offaug.algorithms.runtime import configure_torch, seed_everything
from offaug.datasets.generate import _simulator_state
from offaug.datasets.sampler import Batch


def spaces_from_env(env: Any) -> Spaces:
    """:class:`Spaces` of a Gymnasium env with a Box observation and a bounded Box action.

    Raises:
        ValueError: discrete or unbounded actions, or a non-Box observation space.
    """
    observation_space, action_space = env.observation_space, env.action_space
    if not isinstance(observation_space, gym.spaces.Box):
        raise ValueError(f"sac needs a Box observation space, not {observation_space}")
    if not isinstance(action_space, gym.spaces.Box):
        raise ValueError(f"sac needs a Box action space, not {action_space}")
    low = np.broadcast_to(action_space.low, action_space.shape).reshape(-1)
    high = np.broadcast_to(action_space.high, action_space.shape).reshape(-1)
    if not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ValueError(f"sac needs bounded actions, not {action_space}")
    return Spaces(
        observation_dim=int(np.prod(observation_space.shape)),
        action_dim=int(np.prod(action_space.shape)),
        action_low=tuple(float(x) for x in low),
        action_high=tuple(float(x) for x in high),
    )


class ReplayBuffer:
    """Preallocated numpy transitions: a FIFO of ``capacity`` rows, or an ever-growing record.

    Rows are written in order; once a fixed buffer is full the oldest rows are overwritten.
    With ``growable=True`` the arrays double instead, so the buffer keeps every transition in
    the order it happened (what :func:`train_online` records for D4RL's medium-replay).
    Terminations and truncations are kept apart: learners bootstrap through truncations.
    ``states`` holds optional per-step simulator states (``name -> (dim,)``) for the
    observation and the next observation. A record keeps the environment's own dtypes
    (``observation_dtype``, ``action_dtype``); a training buffer holds float32.
    """

    def __init__(
        self,
        capacity: int,
        observation_dim: int,
        action_dim: int,
        *,
        growable: bool = False,
        state_dims: Mapping[str, int] | None = None,
        observation_dtype: npt.DTypeLike = np.float32,
        action_dtype: npt.DTypeLike = np.float32,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = capacity
        self.growable = growable
        self.added = 0
        """Transitions ever added (more than ``capacity`` once a fixed buffer wraps)."""
        self.observations = np.zeros((capacity, observation_dim), observation_dtype)
        self.actions = np.zeros((capacity, action_dim), action_dtype)
        self.rewards = np.zeros(capacity, np.float32)
        self.next_observations = np.zeros((capacity, observation_dim), observation_dtype)
        self.terminals = np.zeros(capacity, np.bool_)
        self.timeouts = np.zeros(capacity, np.bool_)
        self.states = {
            k: np.zeros((capacity, d), np.float64) for k, d in (state_dims or {}).items()
        }
        self.next_states = {k: np.zeros_like(v) for k, v in self.states.items()}

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def _columns(self) -> dict[str, npt.NDArray[Any]]:
        columns = {
            "observations": self.observations,
            "actions": self.actions,
            "rewards": self.rewards,
            "next_observations": self.next_observations,
            "terminals": self.terminals,
            "timeouts": self.timeouts,
        }
        columns.update({f"state/{k}": v for k, v in self.states.items()})
        columns.update({f"next_state/{k}": v for k, v in self.next_states.items()})
        return columns

    def _grow(self) -> None:
        for name, array in self._columns().items():
            grown = np.zeros((2 * self.capacity, *array.shape[1:]), array.dtype)
            grown[: self.capacity] = array
            kind, _, key = name.partition("/")
            if kind == "state":
                self.states[key] = grown
            elif kind == "next_state":
                self.next_states[key] = grown
            else:
                setattr(self, name, grown)
        self.capacity *= 2

    def add(
        self,
        observation: npt.NDArray[Any],
        action: npt.NDArray[Any],
        reward: float,
        next_observation: npt.NDArray[Any],
        terminated: bool,
        truncated: bool,
        *,
        state: Mapping[str, npt.NDArray[Any]] | None = None,
        next_state: Mapping[str, npt.NDArray[Any]] | None = None,
    ) -> None:
        """Append one transition (overwriting the oldest row when a fixed buffer is full)."""
        if self.growable and self.added == self.capacity:
            self._grow()
        row = self.added % self.capacity
        self.observations[row] = np.reshape(observation, -1)
        self.actions[row] = np.reshape(action, -1)
        self.rewards[row] = reward
        self.next_observations[row] = np.reshape(next_observation, -1)
        self.terminals[row] = terminated
        self.timeouts[row] = truncated
        for key in self.states:
            assert state is not None and next_state is not None
            self.states[key][row] = state[key]
            self.next_states[key][row] = next_state[key]
        self.added += 1

    def sample(self, batch_size: int, rng: np.random.Generator) -> Batch:
        """``batch_size`` rows uniformly with replacement from what the buffer holds."""
        index = rng.integers(0, len(self), size=batch_size)
        return Batch(
            observations=self.observations[index],
            actions=self.actions[index],
            rewards=self.rewards[index],
            next_observations=self.next_observations[index],
            terminals=self.terminals[index],
            timeouts=self.timeouts[index],
            weights=np.ones(batch_size, np.float32),
            set_index=np.zeros(batch_size, np.int8),
        )

    def episodes(self, stop: int | None = None, *, first_seed: int | None = None) -> list[Any]:
        """Rows ``[0, stop)`` as Minari ``EpisodeBuffer`` objects, in order.

        Each episode ends at a termination or truncation; a last episode cut off at ``stop``
        is marked truncated there (the data stops, the MDP did not terminate). Simulator
        states become ``infos`` with one row per observation. ``first_seed`` is recorded as
        the first episode's reset seed (later resets were not seeded).

        Raises:
            ValueError: rows before ``stop`` were overwritten (a fixed buffer that wrapped).
        """
        stop = self.added if stop is None else stop
        if not 0 < stop <= self.added:
            raise ValueError(f"stop must be in [1, {self.added}], not {stop}")
        if self.added > self.capacity:
            raise ValueError("the buffer wrapped: its first rows were overwritten")
        ends = np.flatnonzero(self.terminals[:stop] | self.timeouts[:stop]) + 1
        if len(ends) == 0 or ends[-1] != stop:
            ends = np.append(ends, stop)
        starts = np.concatenate([[0], ends[:-1]])
        buffers = []
        for index, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            rows = slice(start, end)
            truncations = self.timeouts[rows].copy()
            if not (self.terminals[end - 1] or truncations[-1]):
                truncations[-1] = True
            infos = None
            if self.states:
                infos = {
                    key: np.concatenate(
                        [self.states[key][rows], self.next_states[key][end - 1 : end]]
                    )
                    for key in self.states
                }
            buffers.append(
                EpisodeBuffer(
                    id=index,
                    seed=first_seed if index == 0 else None,
                    observations=np.concatenate(
                        [self.observations[rows], self.next_observations[end - 1 : end]]
                    ),
                    actions=self.actions[rows].copy(),
                    rewards=self.rewards[rows].astype(np.float64).tolist(),
                    terminations=self.terminals[rows].tolist(),
                    truncations=truncations.tolist(),
                    infos=infos,
                )
            )
        return buffers


@dataclasses.dataclass(frozen=True)
class OnlineEvaluation:
    """One periodic evaluation of the deterministic policy during online training."""

    step: int
    """Environment steps taken when it ran."""
    mean_return: float
    """Mean undiscounted return over the evaluation episodes."""
    returns: tuple[float, ...]
    """Each episode's return."""


@dataclasses.dataclass(frozen=True)
class OnlineResult:
    """What :func:`train_online` leaves behind."""

    trainer: SAC
    """The final trainer."""
    evaluations: tuple[OnlineEvaluation, ...]
    """Every periodic evaluation, in order (the last at the final step)."""
    record: ReplayBuffer | None
    """Every transition in order (with ``record=True``), else None."""
    seconds: float
    """Wall-clock time of the run."""


CheckpointCallback = Callable[[int, SAC, float], None]


def train_online(
    env_id: str,
    steps: int,
    config: SACConfig | None = None,
    seed: int = 0,
    *,
    eval_every: int = 5_000,
    eval_episodes: int = 5,
    record: bool = False,
    on_checkpoint: CheckpointCallback | None = None,
    max_episode_steps: int | None = None,
    device: str | None = None,
    threads: int | None = None,
) -> OnlineResult:
    """Train SAC online in ``env_id`` for ``steps`` environment steps.

    The first ``config.learning_starts`` steps take uniform random actions; afterwards actions
    are sampled from the policy and every ``train_frequency`` steps ``gradient_steps`` updates
    run on uniform minibatches of the replay buffer. Every ``eval_every`` steps, and at the
    last step, the deterministic policy is evaluated on ``eval_episodes`` episodes (reset seeds
    ``seed + 10_000``, ``+ 1``, ...: the same states every time) and
    ``on_checkpoint(step, trainer, mean_return)`` is called.

    Args:
        env_id: Gymnasium id (Box observations and bounded Box actions).
        steps: Environment steps in total.
        config: SAC and online-loop hyperparameters.
        seed: Seeds initialisation, the first reset, random actions and minibatches.
        eval_every: Steps between evaluations (0: only at the last step).
        eval_episodes: Episodes per evaluation.
        record: Keep every transition in order, with MuJoCo simulator states (``qpos``,
            ``qvel``) when the env has them, in ``OnlineResult.record``.
        on_checkpoint: Called after every evaluation.
        max_episode_steps: Override the env's time limit.
        device: Torch device (default CUDA when present).
        threads: Torch CPU threads (1 is usually fastest for SAC's small networks).
    """
    config = config or SACConfig()
    if steps <= 0:
        raise ValueError(f"steps must be positive, not {steps}")
    configure_torch(threads)
    seed_everything(seed)
    env_kwargs: dict[str, Any] = {}
    if max_episode_steps is not None:
        env_kwargs["max_episode_steps"] = max_episode_steps
    env = make_env({}, env_id, **env_kwargs)
    eval_env = make_env({}, env_id, **env_kwargs)
    spaces = spaces_from_env(env)
    trainer = SAC(spaces, config, device=device)
    rng = np.random.default_rng(seed)
    buffer = ReplayBuffer(min(config.buffer_size, steps), spaces.observation_dim, spaces.action_dim)
    recorder: ReplayBuffer | None = None
    state = None
    observation, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    if record:
        state = _simulator_state(env)
        dims = {k: v.shape[0] for k, v in state.items()} if state is not None else {}
        recorder = ReplayBuffer(
            min(steps, 65_536),
            spaces.observation_dim,
            spaces.action_dim,
            growable=True,
            state_dims=dims,
            observation_dtype=env.observation_space.dtype,
            action_dtype=env.action_space.dtype,
        )
    evaluations: list[OnlineEvaluation] = []
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            previous = observation
            obs = np.asarray(observation, np.float32).reshape(-1)
            if step <= config.learning_starts:
                action = env.action_space.sample()
            else:
                action = trainer.sample_action(obs[None])[0]
            observation, reward, terminated, truncated, _ = env.step(action)
            buffer.add(obs, action, float(reward), observation, terminated, truncated)
            if recorder is not None:
                next_state = _simulator_state(env)
                recorder.add(
                    previous,
                    action,
                    float(reward),
                    observation,
                    terminated,
                    truncated,
                    state=state,
                    next_state=next_state,
                )
                state = next_state
            if terminated or truncated:
                observation, _ = env.reset()
                if recorder is not None:
                    state = _simulator_state(env)
            if step > config.learning_starts and step % config.train_frequency == 0:
                for _ in range(config.gradient_steps):
                    batch = buffer.sample(config.batch_size, rng)
                    trainer.update(TorchBatch.from_batch(batch, trainer.device))
            if (eval_every > 0 and step % eval_every == 0) or step == steps:
                result = evaluate(trainer.act, eval_env, episodes=eval_episodes, seed=seed + 10_000)
                evaluations.append(OnlineEvaluation(step, result.mean_return, result.returns))
                if on_checkpoint is not None:
                    on_checkpoint(step, trainer, result.mean_return)
    finally:
        env.close()
        eval_env.close()
    return OnlineResult(trainer, tuple(evaluations), recorder, time.perf_counter() - started)
