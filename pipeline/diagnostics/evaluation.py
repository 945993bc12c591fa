"""Fresh evaluation episodes of trained policies, from fixed reset seeds.

Every policy runs one greedy episode per reset seed, so all policies see the same start states.
**Success** of an episode is ``info["success"]`` at its last step when the env reports it, else
"not terminated early" (it ran to the time limit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium.error import Error as GymnasiumError

from offaug.algorithms.evaluate import make_env, normalised_score, reference_scores
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.pipeline.diagnostics.policy_document import (
    CheckpointEvaluation,
    EpisodeRecords,
    EvaluationEntry,
)
from offaug.pipeline.diagnostics.sampling import ActFunction, FloatArray, TrainedPolicy
from offaug.pipeline.diagnostics.settings import DiagnosticsSettings


@dataclasses.dataclass(frozen=True, eq=False)
class Episode:
    """One evaluation episode of a greedy policy."""

    observations: npt.NDArray[np.float32]  # (T, obs)
    actions: npt.NDArray[Any]  # (T, *act)
    rewards: FloatArray  # (T,)
    terminated: bool
    """Ended by the MDP (not by the time limit)."""
    success: bool
    """``info["success"]`` at the last step, else ``not terminated``."""

    @property
    def length(self) -> int:
        """Steps taken."""
        return len(self.rewards)


def run_episodes(act: ActFunction, env: Any, reset_seeds: Sequence[int]) -> list[Episode]:
    """One greedy episode per reset seed (fixed start states for every policy)."""
    episodes = []
    for seed in reset_seeds:
        observation, _ = env.reset(seed=int(seed))
        observations, actions, rewards = [], [], []
        terminated = truncated = False
        info: Mapping[str, Any] = {}
        while not (terminated or truncated):
            obs = np.asarray(observation, dtype=np.float32).reshape(-1)
            action = np.asarray(act(obs[None]))[0]
            observation, reward, terminated, truncated, info = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(float(reward))
        success = bool(info["success"]) if "success" in info else not bool(terminated)
        episodes.append(
            Episode(
                np.asarray(observations, dtype=np.float32),
                np.asarray(actions),
                np.asarray(rewards, dtype=np.float64),
                bool(terminated),
                success,
            )
        )
    return episodes


def episode_records(episodes: Sequence[Episode], gamma: float) -> EpisodeRecords:
    """Returns, lengths, discounted returns and success of evaluation episodes."""
    returns = [float(e.rewards.sum()) for e in episodes]
    discounted = [
        float(np.sum(e.rewards * gamma ** np.arange(e.length))) if e.length else 0.0
        for e in episodes
    ]
    lengths = [e.length for e in episodes]
    return {
        "returns": returns,
        "lengths": lengths,
        "discounted_returns": discounted,
        "successes": [e.success for e in episodes],
        "mean_return": float(np.mean(returns)) if returns else None,
        "mean_discounted_return": float(np.mean(discounted)) if discounted else None,
        "mean_length": float(np.mean(lengths)) if lengths else None,
        "success_rate": float(np.mean([e.success for e in episodes])) if episodes else None,
    }


def evaluate_checkpoint(
    path: str,
    env_meta: Mapping[str, Any],
    reset_seeds: Sequence[int],
    gamma: float = 0.99,
    *,
    env_id: str | None = None,
) -> CheckpointEvaluation:
    """Load a checkpoint and run one greedy episode per reset seed (a Dask-friendly task), in
    the env of ``env_meta`` or ``env_id``."""
    trainer = load_trainer(path, device="cpu")
    env = make_env(env_meta, env_id)
    try:
        episodes = run_episodes(trainer.act, env, reset_seeds)
    finally:
        env.close()
    return {"name": str(path), "path": str(path), **episode_records(episodes, gamma)}


def evaluation_episodes(
    meta: Mapping[str, Any],
    policies: Sequence[TrainedPolicy],
    seed: int,
    settings: DiagnosticsSettings,
) -> dict[str, list[Episode]] | None:
    """Fresh episodes of every policy from the same reset seeds; None without an environment."""
    if not policies:
        return {}
    try:
        env = make_env(meta)
    except (ValueError, GymnasiumError):
        # The dataset records no (or no installed) environment: evaluation-based checks skip.
        return None
    reset_seeds = [seed + 20_000 + i for i in range(settings.evaluation_episodes)]
    try:
        return {policy.name: run_episodes(policy.act, env, reset_seeds) for policy in policies}
    finally:
        env.close()


def evaluation_entry(
    episodes: Sequence[Episode], gamma: float, meta: Mapping[str, Any]
) -> EvaluationEntry:
    """A policy's ``evaluation`` entry: its episode records and D4RL-normalised score."""
    record = episode_records(episodes, gamma)
    mean_return = record["mean_return"]
    normalised = None
    if mean_return is not None:
        normalised = normalised_score(mean_return, reference_scores(meta, None))
    return {**record, "normalised_score": normalised}
