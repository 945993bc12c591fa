"""Small real Gymnasium environments shipped with offaug.

``offaug/PointGoal-v0`` is a goal-conditioned point mass with a ``Dict`` observation space
(``observation``, ``achieved_goal``, ``desired_goal``), the layout of Gymnasium-Robotics tasks.
It lets tests and examples exercise Dict observations without extra packages.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

POINT_GOAL_ID = "offaug/PointGoal-v0"


class PointGoalEnv(gym.Env[dict[str, npt.NDArray[np.float64]], npt.NDArray[np.float32]]):
    """A 2-D point that moves by its action toward a random goal.

    Reward is the negative distance to the goal; the episode terminates when the point is
    within ``goal_radius`` of the goal.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 - gymnasium's API

    def __init__(self, goal_radius: float = 0.1) -> None:
        self.goal_radius = goal_radius
        box = gym.spaces.Box(-2.0, 2.0, shape=(2,), dtype=np.float64)
        self.observation_space = gym.spaces.Dict(
            {"achieved_goal": box, "desired_goal": box, "observation": box}
        )
        self.action_space = gym.spaces.Box(-0.2, 0.2, shape=(2,), dtype=np.float32)
        self._position = np.zeros(2)
        self._goal = np.zeros(2)

    def _obs(self) -> dict[str, npt.NDArray[np.float64]]:
        return {
            "achieved_goal": self._position.copy(),
            "desired_goal": self._goal.copy(),
            "observation": self._position.copy(),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, npt.NDArray[np.float64]], dict[str, Any]]:
        super().reset(seed=seed)
        self._position = self.np_random.uniform(-1.0, 1.0, size=2)
        self._goal = self.np_random.uniform(-1.0, 1.0, size=2)
        return self._obs(), {}

    def step(
        self, action: npt.NDArray[np.float32]
    ) -> tuple[dict[str, npt.NDArray[np.float64]], float, bool, bool, dict[str, Any]]:
        move = np.clip(np.asarray(action, dtype=np.float64), -0.2, 0.2)
        self._position = np.clip(self._position + move, -2.0, 2.0)
        distance = float(np.linalg.norm(self._position - self._goal))
        return self._obs(), -distance, distance < self.goal_radius, False, {}


def register_envs() -> None:
    """Register offaug's environments with Gymnasium (idempotent)."""
    if POINT_GOAL_ID not in gym.registry:
        gym.register(
            id=POINT_GOAL_ID,
            entry_point="offaug.datasets.envs:PointGoalEnv",
            max_episode_steps=50,
        )
