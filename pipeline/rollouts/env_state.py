"""Setting an environment to a recorded dataset state: where branched rollouts start.

A dataset records, per observation, the state that puts its env back there (written by
:func:`offaug.datasets.generate.collect_episodes`). Each kind of state has one entry here:

* ``mujoco``: ``infos/qpos`` and ``infos/qvel``
  (:data:`~offaug.datasets.transitions.SIMULATOR_STATE_KEYS`), set with the MuJoCo env's
  ``set_state``; the observation is its ``_get_obs()``;
* ``control``: ``infos/state`` (:data:`~offaug.datasets.transitions.CONTROL_STATE_KEY`), a
  classic-control env's ``unwrapped.state`` (Pendulum [theta, thetadot], CartPole, Acrobot,
  MountainCar), assigned directly; the observation is ``_get_obs()`` where the env has one
  (Pendulum, Acrobot), else the state itself as float32 (CartPole, MountainCar).

The env is reset first (so its time limit and episode bookkeeping start afresh) and then set.
:func:`read_state` copies an env's current state in the same form, so a search can return to it
(:mod:`offaug.pipeline.rollouts.lookahead`).

Rows that record no state (generated or perturbed transitions, rollouts) can have it rebuilt
from the observation where the observation holds all of it (:func:`rebuild_states`):

* ``mujoco``, where the observation is ``(qpos[k:], qvel)`` (Hopper, HalfCheetah, Walker2d,
  Swimmer, InvertedPendulum): the ``k`` positions it leaves out (the root's x; x and y for
  Swimmer) are set to the env's initial ones; these tasks do not depend on them (the forward
  reward is a difference of x);
* ``control``: Pendulum's ``(cos, sin, thetadot)`` and Acrobot's ``(cos, sin, cos, sin, dot,
  dot)`` give their angles back through ``atan2``; CartPole's and MountainCar's observation is
  the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.errors import DataError
from offaug.datasets.sources import load_transitions
from offaug.datasets.transitions import CONTROL_STATE_KEY, SIMULATOR_STATE_KEYS, Transitions

StateRow = Mapping[str, npt.NDArray[Any]]
"""One state: ``infos`` key (without the prefix) -> that observation's values."""


class StateError(RuntimeError):
    """An environment that cannot be set to a recorded state."""


def _set_mujoco(base: Any, state: StateRow) -> npt.NDArray[Any]:
    base.set_state(state["qpos"], state["qvel"])
    return np.asarray(base._get_obs())


def _read_mujoco(base: Any) -> dict[str, npt.NDArray[Any]]:
    return {"qpos": np.array(base.data.qpos), "qvel": np.array(base.data.qvel)}


def _read_control(base: Any) -> dict[str, npt.NDArray[Any]]:
    return {CONTROL_STATE_KEY: np.array(base.state, dtype=np.float64)}


def _set_control(base: Any, state: StateRow) -> npt.NDArray[Any]:
    base.state = np.array(state[CONTROL_STATE_KEY], dtype=np.float64)
    if hasattr(base, "_get_obs"):
        return np.asarray(base._get_obs())
    return np.asarray(base.state, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class StateKind:
    """One way of recording and setting an environment's state."""

    name: str
    keys: tuple[str, ...]
    """The ``infos/*`` keys it is recorded under."""
    settable: Callable[[Any], bool]
    """Whether an (unwrapped) env can be set this way."""
    apply: Callable[[Any, StateRow], npt.NDArray[Any]]
    """Set the unwrapped env to a state; return the observation there."""
    read: Callable[[Any], dict[str, npt.NDArray[Any]]]
    """The unwrapped env's current state, copied (what ``apply`` takes back)."""


STATE_KINDS: tuple[StateKind, ...] = (
    StateKind(
        "mujoco",
        SIMULATOR_STATE_KEYS,
        lambda base: hasattr(base, "set_state"),
        _set_mujoco,
        _read_mujoco,
    ),
    StateKind(
        "control",
        (CONTROL_STATE_KEY,),
        lambda base: isinstance(getattr(base, CONTROL_STATE_KEY, None), (np.ndarray, tuple)),
        _set_control,
        _read_control,
    ),
)


@dataclasses.dataclass(frozen=True)
class StartStates:
    """A dataset's states, one row per transition (its observation), and how to set them."""

    kind: StateKind
    values: dict[str, npt.NDArray[Any]]
    """key -> (N, dim) values."""

    def __len__(self) -> int:
        return len(next(iter(self.values.values())))

    def row(self, index: int) -> dict[str, npt.NDArray[Any]]:
        """The state of transition ``index``."""
        return {key: value[index] for key, value in self.values.items()}


def dataset_start_states(transitions: Transitions) -> StartStates | None:
    """The states a dataset records (loaded with :func:`load_with_states`), or None."""
    for kind in STATE_KINDS:
        keys = [f"infos/{key}" for key in kind.keys]
        if all(key in transitions.extras for key in keys):
            values = {k: np.asarray(transitions.extras[f"infos/{k}"]) for k in kind.keys}
            return StartStates(kind, values)
    return None


def load_with_states(source: str) -> tuple[Transitions, StateKind | None]:
    """Load ``source`` with the first kind of state it records (None: it records none)."""
    for kind in STATE_KINDS:
        try:
            return load_transitions(source, info_keys=list(kind.keys)), kind
        except DataError:
            # The dataset lacks these infos keys; a dataset that fails to load for another
            # reason fails again below, with its own error.
            continue
    return load_transitions(source), None


def set_state(env: Any, kind: StateKind, state: StateRow) -> npt.NDArray[Any]:
    """Set a (reset) ``env`` to ``state``; return the observation there.

    Raises:
        StateError: the env cannot be set this way (e.g. a MuJoCo state for a non-MuJoCo env).
    """
    base = env.unwrapped
    if not kind.settable(base):
        name = base.spec.id if base.spec else type(base).__name__
        raise StateError(f"{name}: cannot set a {kind.name} state; use start='reset'")
    return kind.apply(base, state)


def env_state_kind(env: Any) -> StateKind:
    """How a (reset) ``env``'s state is read and set.

    Raises:
        StateError: neither a MuJoCo env nor a classic-control env with a ``state``.
    """
    base = env.unwrapped
    for kind in STATE_KINDS:
        if kind.settable(base):
            return kind
    name = base.spec.id if base.spec else type(base).__name__
    raise StateError(f"{name}: its state can be neither read nor set (not MuJoCo, no .state)")


def read_state(env: Any, kind: StateKind) -> dict[str, npt.NDArray[Any]]:
    """A copy of ``env``'s current state, which :func:`set_state` puts back."""
    return kind.read(env.unwrapped)


def _angles(columns: tuple[int, ...], rates: tuple[int, ...]) -> Callable[[Any], Any]:
    """Rebuild [angle..., rate...] from observations holding (cos, sin) pairs at ``columns``."""

    def rebuild(observations: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        angles = [np.arctan2(observations[:, c + 1], observations[:, c]) for c in columns]
        return np.stack([*angles, *(observations[:, r] for r in rates)], 1)

    return rebuild


CONTROL_REBUILDS: dict[str, Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]]] = {
    "PendulumEnv": _angles((0,), (2,)),
    "AcrobotEnv": _angles((0, 2), (4, 5)),
    "CartPoleEnv": lambda observations: observations,
    "MountainCarEnv": lambda observations: observations,
    "Continuous_MountainCarEnv": lambda observations: observations,
}
"""Classic-control envs (by unwrapped class name) whose state is a function of the observation."""


def rebuild_states(env: Any, observations: npt.ArrayLike) -> StartStates:
    """The states behind ``observations`` of a (reset) ``env``, rebuilt from them alone.

    Whether a row's rebuilt state is right shows when it is set: :func:`set_state` returns the
    observation there, which must equal the row's.

    Raises:
        StateError: the env's observation does not hold its state (the reason says why).
    """
    base = env.unwrapped
    obs = np.asarray(observations, dtype=np.float64)
    name = base.spec.id if base.spec else type(base).__name__
    if obs.ndim != 2:
        raise StateError(f"{name}: observations of shape {obs.shape[1:]} are not state vectors")
    if hasattr(base, "set_state") and hasattr(base, "model"):
        nq, nv = int(base.model.nq), int(base.model.nv)
        hidden = nq + nv - obs.shape[1]
        if not 0 <= hidden <= nq:
            raise StateError(
                f"{name}: its {obs.shape[1]}-d observation is not (qpos[k:], qvel) with"
                f" nq={nq}, nv={nv} (it holds more than the simulator state)"
            )
        init = np.broadcast_to(np.asarray(base.init_qpos[:hidden]), (len(obs), hidden))
        qpos = np.concatenate([init, obs[:, : nq - hidden]], 1)
        return StartStates(STATE_KINDS[0], {"qpos": qpos, "qvel": obs[:, nq - hidden :]})
    rebuild = CONTROL_REBUILDS.get(type(base).__name__)
    if rebuild is None:
        raise StateError(f"{name}: no known way to rebuild its state from an observation")
    return StartStates(STATE_KINDS[1], {CONTROL_STATE_KEY: rebuild(obs)})
