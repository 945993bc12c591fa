"""Policy evaluation in the dataset's own environment, and normalised scores."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
from gymnasium.envs.registration import EnvSpec

from offaug.datasets.envs import register_envs
from offaug.datasets.generate import d4rl_reference_scores

Policy = Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """Returns of evaluation episodes and their normalised score (when reference scores exist)."""

    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    normalised_score: float | None
    """``100 * (mean return - ref_min) / (ref_max - ref_min)``, D4RL's convention."""

    @property
    def mean_return(self) -> float:
        """Mean undiscounted return."""
        return float(np.mean(self.returns))


def make_env(meta: Mapping[str, Any], env_id: str | None = None, **kwargs: Any) -> Any:
    """The environment a dataset came from: ``env_id`` if given, else its recorded env spec.

    Dict observation spaces are flattened in the space's key order, as the readers do.
    """
    register_envs()
    if env_id is not None:
        env = gym.make(env_id, **kwargs)
    else:
        spec_text = meta.get("eval_env_spec") or meta.get("env_spec")
        if not spec_text:
            raise ValueError(
                "the dataset records no environment; pass env_id (e.g. --env Hopper-v5)"
            )
        spec = EnvSpec.from_json(spec_text if isinstance(spec_text, str) else json.dumps(spec_text))
        env = gym.make(spec, **kwargs)
    if isinstance(env.observation_space, gym.spaces.Dict):
        env = gym.wrappers.FlattenObservation(env)
    return env


def reference_scores(meta: Mapping[str, Any], env_id: str | None) -> tuple[float, float] | None:
    """Minari's ``ref_min_score/ref_max_score``, else D4RL's for the env family, else None."""
    low, high = meta.get("ref_min_score"), meta.get("ref_max_score")
    if low is not None and high is not None:
        return float(low), float(high)
    if env_id is None:
        spec_text = meta.get("env_spec")
        if isinstance(spec_text, str):
            env_id = json.loads(spec_text).get("id")
    if env_id is None:
        return None
    return d4rl_reference_scores(env_id)


def evaluate(
    policy: Policy,
    env: Any,
    *,
    episodes: int,
    seed: int = 0,
    scores: tuple[float, float] | None = None,
) -> EvaluationResult:
    """Run ``episodes`` greedy episodes (seeds ``seed``, ``seed + 1``, ...)."""
    returns, lengths = [], []
    for episode in range(episodes):
        observation, _ = env.reset(seed=seed + episode)
        total, steps, done = 0.0, 0, False
        while not done:
            action = policy(np.asarray(observation, dtype=np.float32)[None])[0]
            observation, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            steps += 1
            done = bool(terminated or truncated)
        returns.append(total)
        lengths.append(steps)
    normalised = normalised_score(float(np.mean(returns)), scores)
    return EvaluationResult(tuple(returns), tuple(lengths), normalised)


def normalised_score(mean_return: float, scores: tuple[float, float] | None) -> float | None:
    """D4RL's ``100 * (mean return - ref_min) / (ref_max - ref_min)`` (None without scores)."""
    if scores is None or scores[1] == scores[0]:
        return None
    return 100.0 * (mean_return - scores[0]) / (scores[1] - scores[0])
