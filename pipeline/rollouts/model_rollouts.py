"""Rollouts in a learned-dynamics ensemble (MOPO, MOBILE): the model backend's episodes.

Rollouts of horizon H start from dataset states: at each step the rollout policy plus noise
picks actions (with the same log-probabilities as simulator rollouts), a random member of the
ensemble (:class:`offaug.pipeline.models.dynamics.DynamicsEnsemble`) predicts the step, and the
reward is penalised by the ensemble's uncertainty (MOPO's or MOBILE's, as the dynamics module
says).

States are kept within the dataset's bounds: a step whose predicted next state leaves them
(beyond a margin) or is NaN is dropped, and its rollout ends at the step before, as truncated.
The dropped step is the model extrapolating where it has no data; clipping its next state onto
the bounds and bootstrapping from there would give the learner a state the model never
predicted. The weight columns are those of simulator rollouts
(:func:`offaug.pipeline.rollouts.behaviour.weight_columns`); a centred policy (a trained learner)
moves the noise's centre as it does there, and ``filter: data`` drops rollouts whose predicted
(unpenalised) return falls below the data's from the same start
(:class:`offaug.pipeline.rollouts.data.EpisodeFilter`), before the weights are computed.

With ``rollout.lookahead`` the ensemble stands in for the simulator of the rollout algorithm
(:mod:`offaug.pipeline.rollouts.lookahead`): :class:`ModelEnv` is a Gymnasium env whose state is
the observation and whose step is the members' mean prediction with the penalised reward, so the
search compares continuations the model believes in and that stay near the data, and commits the
best window (:func:`model_lookahead_rollout`). This is model-based offline planning around a
behaviour-cloned prior, as MBOP (Argenson & Dulac-Arnold 2021, "Model-Based Offline Planning",
ICLR) does at decision time; here the plans become training episodes, as in the simulator's
search. A step that leaves the data's bounds ends its candidate (scored -inf, so it is never
committed); an episode whose every candidate leaves them ends, truncated, at its last committed
step.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import torch

from offaug.algorithms.batch import to_tensor
from offaug.datasets.transitions import CONTROL_STATE_KEY, Source, Transitions
from offaug.pipeline.models.dynamics import DynamicsEnsemble
from offaug.pipeline.rollouts.behaviour import (
    RolloutPolicy,
    noise_centre,
    policy_step,
    weight_columns,
)
from offaug.pipeline.rollouts.config import RolloutConfig, RolloutResult
from offaug.pipeline.rollouts.data import EpisodeFilter
from offaug.pipeline.rollouts.env_state import STATE_KINDS, StartStates
from offaug.pipeline.rollouts.lookahead import Outcome, lookahead_rollout
from offaug.pipeline.rollouts.noise import DEFAULT_NOISE, ContinuousNoise, NoiseSpec
from offaug.pipeline.rollouts.references import DiscountedValue


def model_rollout(
    model: DynamicsEnsemble,
    policy: RolloutPolicy,
    start_observations: npt.NDArray[np.float32],
    *,
    noise: NoiseSpec = DEFAULT_NOISE,
    max_weight: float = 100.0,
    meta: Mapping[str, Any] | None = None,
    horizon: int | None = None,
    start_rows: npt.NDArray[np.int64] | None = None,
    episode_filter: EpisodeFilter | None = None,
    value: DiscountedValue | None = None,
) -> Transitions:
    """Roll ``policy`` out in the model from every start observation for ``horizon`` steps.

    Args:
        horizon: Steps per rollout (None: the model config's ``horizon``).
        start_rows: The dataset rows the start observations are (for ``episode_filter``).
        episode_filter: Drop rollouts that earn less than the data from the same row; the
            number dropped is ``meta["episodes_dropped"]``.
        value: V(s') and gamma for MOBILE's penalty (the rollout learner's own); required
            when the model's config says ``penalty="mobile"``.
    """
    config = model.config
    if config.penalty == "mobile" and value is None:
        raise ValueError(
            "MOBILE's penalty needs a value function: roll out a learner with a value of its"
            " own (rollout.policy iql, td3bc, cql or rebrac)"
        )
    rng = np.random.default_rng(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    n = len(start_observations)
    horizon = horizon or config.horizon
    if episode_filter is not None and start_rows is None:
        raise ValueError("the episode filter needs the start observations' dataset rows")
    low, high = (bound.numpy() for bound in _bounds(model))
    noise_process = ContinuousNoise(noise, n, model.action_dim, rng)
    obs = to_tensor(start_observations, torch.device("cpu"))  # a copy: may be a read-only map
    alive = np.ones(n, dtype=bool)
    steps: list[dict[str, npt.NDArray[Any]]] = []
    for t in range(horizon):
        observations = obs.numpy().copy()
        mean, log_std = policy(observations)
        if log_std is None:
            raise ValueError("model rollouts need a continuous Gaussian policy")
        centre = noise_centre(policy, observations, mean)
        chosen = policy_step(policy, noise_process, mean, log_std, centre=centre)
        env_actions = np.asarray(chosen.env_actions, dtype=np.float32)
        member = torch.as_tensor(rng.integers(0, config.members, size=n))
        next_obs, rewards, terminals, uncertainty = model.step(
            obs, torch.as_tensor(env_actions), member, generator
        )
        if config.penalty == "mobile":
            assert value is not None
            uncertainty = model.bellman_inconsistency(
                obs, torch.as_tensor(env_actions), value, generator
            )
        next_np = next_obs.numpy()
        raw_reward = rewards.numpy()
        penalised = raw_reward - config.penalty_coefficient * uncertainty.numpy()
        # A draw the learner values at NaN or inf (the model far outside the data) drops the step.
        finite = np.isfinite(next_np).all(1) & np.isfinite(penalised)
        inside = ((next_np >= low) & (next_np <= high)).all(1)
        keep = alive & finite & inside
        steps.append(
            {
                "alive": keep,
                "observations": observations,
                "actions": env_actions,
                "rewards": penalised.astype(np.float32),
                "raw_reward": raw_reward.astype(np.float32),
                "uncertainty": uncertainty.numpy().astype(np.float32),
                "next_observations": next_np.astype(np.float32),
                "terminals": terminals.numpy(),
                "timeouts": np.full(n, t == horizon - 1),
                "rollout_log_prob": chosen.rollout_log_prob,
                "behaviour_log_prob": chosen.behaviour_log_prob,
            }
        )
        alive = keep & ~terminals.numpy()
        # Rollouts that ended keep stepping (batched) from a finite stand-in; none of it is kept.
        obs = torch.as_tensor(np.where(keep[:, None], next_np, observations).astype(np.float32))
        if not alive.any():
            break
    keep = None
    if episode_filter is not None:
        assert start_rows is not None
        alive_steps = np.stack([step["alive"] for step in steps], 1)  # (n, T)
        raw_rewards = np.stack([step["raw_reward"] for step in steps], 1).astype(np.float64)
        returns = (raw_rewards * alive_steps).sum(1)
        keep = episode_filter.keep(returns, alive_steps.sum(1), start_rows)
    meta = {**dict(meta or {}), "penalty": config.penalty}
    return _assemble(steps, n, max_weight, meta, keep)


class ModelBoundsExit(RuntimeError):
    """A model step that left the data's bounds (or predicted NaN): the model cannot judge it."""


class ModelEnv(gym.Env[npt.NDArray[np.float32], npt.NDArray[np.float32]]):
    """The ensemble as an environment the rollout algorithm's search can read and set.

    Its ``state`` is the observation (float64), so the search reads and sets it as it does a
    classic-control env's (:mod:`offaug.pipeline.rollouts.env_state`, kind ``control``). A step
    is :meth:`DynamicsEnsemble.mean_step`: the members' mean next state, the reward penalised by
    the model config's uncertainty (MOPO's, or MOBILE's with ``value``), terminated where the
    members' mean termination probability exceeds one half. :meth:`step_batch` steps many envs
    of one model in one ensemble call (the search steps every candidate so). A reset starts from
    one of ``initial_observations``, drawn by the env's seed.

    Raises (from :meth:`step`):
        ModelBoundsExit: the predicted next state is NaN or leaves the data's bounds (beyond
            the config's margin).
    """

    def __init__(
        self,
        model: DynamicsEnsemble,
        initial_observations: npt.NDArray[np.float32],
        value: DiscountedValue | None = None,
        seed: int = 0,
    ) -> None:
        if model.config.penalty == "mobile" and value is None:
            raise ValueError("ModelEnv with MOBILE's penalty needs the learner's value")
        self.model, self.value = model, value
        self.initial = np.asarray(initial_observations, dtype=np.float32)
        self.low, self.high = _bounds(model)
        self.observation_space = gym.spaces.Box(
            -np.inf, np.inf, (model.observation_dim,), np.float32
        )
        self.action_space = gym.spaces.Box(-np.inf, np.inf, (model.action_dim,), np.float32)
        self.generator = torch.Generator().manual_seed(seed)
        self.state = np.array(self.initial[0], dtype=np.float64)

    def _get_obs(self) -> npt.NDArray[np.float32]:
        return self.state.astype(np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[npt.NDArray[np.float32], dict[str, Any]]:
        super().reset(seed=seed)
        self.state = np.array(
            self.initial[int(self.np_random.integers(len(self.initial)))], dtype=np.float64
        )
        return self._get_obs(), {}

    def step(
        self, action: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        outcome = self.step_batch([self], np.asarray(action, dtype=np.float32).reshape(1, -1))[0]
        if isinstance(outcome, Exception):
            raise outcome
        observation, penalised, terminated = outcome
        return observation, penalised, terminated, False, {}

    @classmethod
    @torch.no_grad()
    def step_batch(
        cls, envs: Sequence[ModelEnv], actions: npt.NDArray[np.float32]
    ) -> list[Outcome | Exception]:
        """One step of each of ``envs`` (all over one model), ``actions`` one row each, in one
        ensemble call: what the search's :meth:`~._Search._transitions` calls. An env whose
        step leaves the data's bounds gets a :class:`ModelBoundsExit` and keeps its state."""
        first = envs[0]
        if any(env.model is not first.model or env.value is not first.value for env in envs):
            raise ValueError("ModelEnv.step_batch steps envs of one model and value only")
        model = first.model
        obs = torch.as_tensor(np.stack([env.state for env in envs]).astype(np.float32))
        act = torch.as_tensor(np.asarray(actions, dtype=np.float32).reshape(len(envs), -1))
        next_obs, reward, terminal, uncertainty = model.mean_step(obs, act)
        if model.config.penalty == "mobile":
            assert first.value is not None
            uncertainty = model.bellman_inconsistency(obs, act, first.value, first.generator)
        penalised = (reward - model.config.penalty_coefficient * uncertainty).double().numpy()
        inside = ((next_obs >= first.low) & (next_obs <= first.high)).all(1)
        valid = (inside & torch.isfinite(next_obs).all(1)).numpy() & np.isfinite(penalised)
        states = next_obs.double().numpy()
        outcomes: list[Outcome | Exception] = []
        for b, env in enumerate(envs):
            if not valid[b]:
                outcomes.append(ModelBoundsExit("the model's next state leaves the data's bounds"))
                continue
            env.state = states[b].copy()
            outcomes.append((env._get_obs(), float(penalised[b]), bool(terminal[b] > 0.5)))
        return outcomes


def model_lookahead_rollout(
    model: DynamicsEnsemble,
    policy: RolloutPolicy,
    config: RolloutConfig,
    start_observations: npt.NDArray[np.float32],
    *,
    start_probabilities: npt.NDArray[np.float64] | None = None,
    value: DiscountedValue | None = None,
    meta: Mapping[str, Any] | None = None,
) -> RolloutResult:
    """``config.episodes`` episodes of the rollout algorithm's search in the model, each from a
    drawn start observation and ``config.horizon`` steps long at most. ``value``: the rollout
    learner's, for MOBILE's penalty and ``lookahead.bootstrap``.

    Rewards are the penalised ones the search compared. The result's ``simulator_steps`` is 0:
    the model's steps (every candidate's) are ``meta["model_steps"]``, and the candidates that
    left the data's bounds ``meta["left_bounds"]``; ``faults`` holds no model exits.
    """
    if config.horizon is None:
        raise ValueError(
            "a lookahead in the model needs rollout.horizon: the model has no time limit of its"
            " own, and its error compounds with the episode's length"
        )
    control = next(kind for kind in STATE_KINDS if kind.name == "control")
    starts = StartStates(control, {CONTROL_STATE_KEY: np.asarray(start_observations, np.float64)})
    counter = itertools.count()

    def factory() -> ModelEnv:
        penalty_value = value if model.config.penalty == "mobile" else None
        return ModelEnv(
            model, start_observations, penalty_value, config.seed * 1009 + next(counter)
        )

    run = dataclasses.replace(config, start="dataset", max_faults=sys.maxsize)
    bootstrap = config.lookahead is not None and config.lookahead.bootstrap
    result = lookahead_rollout(
        policy,
        factory,
        run,
        start_states=starts,
        start_probabilities=start_probabilities,
        value=value if bootstrap else None,
    )
    exits = [f for f in result.faults if f.kind == ModelBoundsExit.__name__]
    data = result.transitions
    transitions = dataclasses.replace(
        data,
        source=np.full(len(data), Source.MODEL, dtype=np.int8),
        meta={
            **data.meta,
            **dict(meta or {}),
            "format": "offaug-model-rollout",
            "penalty": model.config.penalty,
            "model_steps": result.simulator_steps,
            "left_bounds": len(exits),
        },
    )
    return dataclasses.replace(
        result,
        transitions=transitions,
        faults=[f for f in result.faults if f.kind != ModelBoundsExit.__name__],
        simulator_steps=0,
    )


def _bounds(model: DynamicsEnsemble) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest states a model step may reach: the data's range, widened by the
    config's margin on each side."""
    low, high = model.stats["observation_low"], model.stats["observation_high"]
    margin = model.config.bounds_margin * (high - low)
    return low - margin, high + margin


def _assemble(
    steps: list[dict[str, npt.NDArray[Any]]],
    n: int,
    max_weight: float,
    meta: Mapping[str, Any] | None,
    keep: npt.NDArray[np.bool_] | None = None,
) -> Transitions:
    # Reorder step-major records into episode-major rows (one model rollout = one episode).
    alive = np.stack([s["alive"] for s in steps], 1)  # (n, T)
    dropped = 0
    if keep is not None:
        dropped = int((~keep & alive.any(1)).sum())
        alive = alive & keep[:, None]
    # A rollout whose next step is dropped (NaN, out of bounds) ends at its last kept step, as
    # truncated.
    for t in range(alive.shape[1] - 1):
        ended = alive[:, t] & ~alive[:, t + 1]
        steps[t]["timeouts"] = steps[t]["timeouts"] | ended
    rows_episode, rows_time = np.nonzero(alive)

    def gather(key: str) -> npt.NDArray[Any]:
        stacked = np.stack([s[key] for s in steps], 1)  # (n, T, ...)
        return stacked[rows_episode, rows_time]

    lengths = alive.sum(1)
    lengths = lengths[lengths > 0]
    weights = weight_columns(
        gather("behaviour_log_prob"), gather("rollout_log_prob"), lengths, max_weight
    )
    timeouts = gather("timeouts").astype(bool)
    terminals = gather("terminals").astype(bool)
    return Transitions(
        observations=gather("observations").astype(np.float32),
        actions=gather("actions").astype(np.float32),
        rewards=gather("rewards").astype(np.float32),
        next_observations=gather("next_observations").astype(np.float32),
        terminals=terminals,
        timeouts=timeouts & ~terminals,
        episode_ids=np.repeat(np.arange(len(lengths), dtype=np.int64), lengths),
        rollout_log_prob=gather("rollout_log_prob").astype(np.float32),
        behaviour_log_prob=gather("behaviour_log_prob").astype(np.float32),
        importance_weight=weights.importance_weight,
        source=np.full(int(lengths.sum()), Source.MODEL, dtype=np.int8),
        extras={
            "raw_reward": gather("raw_reward"),
            "model_uncertainty": gather("uncertainty"),
            **weights.extras,
        },
        meta={
            **dict(meta or {}),
            "format": "offaug-model-rollout",
            "weight_stats": weights.stats,
            "rollouts": n,
            "episodes_dropped": dropped,
        },
    )
