"""What a dataset's metadata says about its environment: id, time limit, terminations, actions.

Read from ``meta["env_spec"]`` (Gymnasium's ``EnvSpec`` as JSON) and ``meta["action_space"]``
(Minari's space JSON) without building the environment.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from offaug.datasets.action_box import ActionBox

# Env families (the id without its version) whose episodes can end in a termination: a body
# that falls, a pole that drops, a goal reached. MuJoCo's locomotion bodies terminate unless
# made with terminate_when_unhealthy=False.
TERMINATING_FAMILIES: frozenset[str] = frozenset(
    {
        "Hopper",
        "Walker2d",
        "Ant",
        "Humanoid",
        "InvertedPendulum",
        "InvertedDoublePendulum",
        "CartPole",
        "Acrobot",
        "MountainCar",
        "MountainCarContinuous",
        "LunarLander",
        "LunarLanderContinuous",
        "BipedalWalker",
        "BipedalWalkerHardcore",
        "offaug/PointGoal",
    }
)
# Families whose episodes only ever end at the time limit.
NEVER_TERMINATING_FAMILIES: frozenset[str] = frozenset(
    {"HalfCheetah", "Swimmer", "Reacher", "Pusher", "HumanoidStandup", "Pendulum"}
)


@dataclasses.dataclass(frozen=True)
class EnvFacts:
    """What the doctor knows about the environment behind a dataset (None: not recorded)."""

    env_id: str | None = None
    max_episode_steps: int | None = None
    """The time limit of the env spec."""
    can_terminate: bool | None = None
    """Whether the env ends episodes with terminations (None: an env offaug does not know)."""
    action_box: ActionBox | None = None


def env_family(env_id: str) -> str:
    """``Hopper-v5`` -> ``Hopper``; ``offaug/PointGoal-v0`` -> ``offaug/PointGoal``."""
    name, _, version = env_id.rpartition("-v")
    return name if name and version.isdigit() else env_id


def can_terminate(env_id: str, kwargs: Mapping[str, Any]) -> bool | None:
    """Whether episodes of ``env_id`` (made with ``kwargs``) can end in a termination."""
    family = env_family(env_id)
    if kwargs.get("terminate_when_unhealthy") is False:
        return False
    if family in TERMINATING_FAMILIES:
        return True
    if family in NEVER_TERMINATING_FAMILIES:
        return False
    return None


def env_facts(meta: Mapping[str, Any]) -> EnvFacts:
    """The env facts recorded in a dataset's ``meta`` (absent ones stay None)."""
    spec = _json_object(meta.get("env_spec"))
    env_id = spec.get("id") if isinstance(spec.get("id"), str) else None
    limit = spec.get("max_episode_steps")
    kwargs = spec.get("kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    action_box = _action_box(_json_object(meta.get("action_space")))
    return EnvFacts(
        env_id=env_id,
        max_episode_steps=int(limit) if isinstance(limit, int) and limit > 0 else None,
        can_terminate=can_terminate(env_id, kwargs) if env_id else None,
        action_box=action_box,
    )


def _json_object(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _action_box(space: Mapping[str, Any]) -> ActionBox | None:
    if space.get("type") == "Discrete" and isinstance(space.get("n"), int):
        start = int(space.get("start") or 0)
        bounds = np.array([start, start + int(space["n"]) - 1], dtype=np.float64)
        return ActionBox(low=bounds[:1], high=bounds[1:])
    if space.get("type") != "Box":
        return None
    shape = tuple(space.get("shape") or ())
    low = np.broadcast_to(np.asarray(space.get("low"), dtype=np.float64), shape).reshape(-1)
    high = np.broadcast_to(np.asarray(space.get("high"), dtype=np.float64), shape).reshape(-1)
    return ActionBox(low=low, high=high)
