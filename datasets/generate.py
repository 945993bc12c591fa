"""Make real Minari datasets by running a policy in a Gymnasium environment.

Tests, benchmarks and the quickstart build their datasets here, through Minari's own
``create_dataset_from_buffers``, so what they read is exactly what Minari writes. MuJoCo
environments also record the simulator state (``infos/qpos``, ``infos/qvel``, one row per
observation), and classic-control environments their ``unwrapped.state`` (``infos/state``, e.g.
Pendulum's [theta, thetadot]), so that rollouts can later branch from dataset states.

:func:`make_dataset` runs the uniform random policy. The D4RL levels made by a trained policy
(SAC's medium, expert and medium-replay) are
:func:`offaug.algorithms.online.levels.make_level_dataset`'s, which collects and writes through
:func:`collect_episodes` and :func:`write_with_minari` here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import runpy
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import minari
import numpy as np
import numpy.typing as npt
from minari.data_collector import EpisodeBuffer

from offaug.datasets.atomic import replace_directory, tmp_name
from offaug.datasets.envs import register_envs
from offaug.datasets.errors import DataError
from offaug.datasets.paths import dataset_root, resolve_dataset_dir
from offaug.datasets.storage import StorageFormat, storage_backend
from offaug.datasets.transitions import CONTROL_STATE_KEY, SIMULATOR_STATE_KEYS

__all__ = [
    "GeneratedDataset",
    "Policy",
    "StorageFormat",
    "check_dataset_id",
    "collect_episodes",
    "d4rl_reference_scores",
    "make_dataset",
    "write_with_minari",
]

Policy = Callable[[Any], Any]

# D4RL's reference scores are per environment family; offaug maps Gymnasium ids onto them.
_D4RL_ENV_NAMES = {
    "Hopper": "hopper",
    "HalfCheetah": "halfcheetah",
    "Walker2d": "walker2d",
    "Ant": "ant",
}
_DATASET_ID = re.compile(r"^(?:[A-Za-z0-9_.\-]+/)*[A-Za-z0-9_.\-]+-v\d+$")


def check_dataset_id(dataset_id: str) -> None:
    """Refuse an id that is not Minari's ``[namespace/]name-vK`` (or climbs out of the root).

    Raises:
        DataError: naming the id.
    """
    if not _DATASET_ID.match(dataset_id) or ".." in dataset_id.split("/"):
        raise DataError(
            "dataset id must look like [namespace/]name-vK (letters, digits, '_', '.', '-')",
            field=f"dataset_id={dataset_id!r}",
        )


@dataclasses.dataclass(frozen=True)
class GeneratedDataset:
    """What :func:`make_dataset` wrote."""

    dataset_id: str
    path: Path
    episodes: int
    steps: int
    data_format: StorageFormat


def d4rl_reference_scores(env_id: str) -> tuple[float, float] | None:
    """D4RL's (random, expert) reference returns for a MuJoCo locomotion env, if d4rl is installed.

    Only d4rl's ``infos.py`` is executed: importing the whole ``d4rl`` package pulls in the
    unmaintained ``gym`` and ``mujoco-py``.
    """
    family = env_id.split("/")[-1].split("-")[0]
    name = _D4RL_ENV_NAMES.get(family)
    spec = importlib.util.find_spec("d4rl")
    if name is None or spec is None or not spec.submodule_search_locations:
        return None
    infos_path = Path(next(iter(spec.submodule_search_locations))) / "infos.py"
    if not infos_path.is_file():
        return None
    infos = runpy.run_path(str(infos_path))
    key = f"{name}-random-v2"
    try:
        return float(infos["REF_MIN_SCORE"][key]), float(infos["REF_MAX_SCORE"][key])
    except KeyError:
        return None


def _random_policy(env: gym.Env[Any, Any]) -> Policy:
    def act(_observation: Any) -> Any:
        return env.action_space.sample()

    return act


def _stack(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {key: _stack([v[key] for v in values]) for key in values[0]}
    return np.asarray(values)


def _simulator_state(env: gym.Env[Any, Any]) -> dict[str, npt.NDArray[np.float64]] | None:
    """The state that sets ``env`` back to where it is: MuJoCo's qpos/qvel, or the
    ``unwrapped.state`` vector of a classic-control env (None when it has neither)."""
    data = getattr(env.unwrapped, "data", None)
    if data is not None and all(hasattr(data, key) for key in SIMULATOR_STATE_KEYS):
        return {key: np.array(getattr(data, key)) for key in SIMULATOR_STATE_KEYS}
    state = getattr(env.unwrapped, CONTROL_STATE_KEY, None)
    if isinstance(state, (np.ndarray, tuple)):
        vector = np.asarray(state)
        if vector.ndim == 1 and vector.dtype.kind in "fiu":
            # Copied as float64: MountainCar keeps a tuple, others an array they update in place.
            return {CONTROL_STATE_KEY: vector.astype(np.float64)}
    return None


def collect_episodes(
    env: gym.Env[Any, Any],
    policy: Policy,
    *,
    steps: int | None = None,
    episodes: int | None = None,
    seed: int = 0,
) -> list[Any]:
    """Run ``policy`` in ``env`` and return Minari ``EpisodeBuffer`` objects.

    Exactly one of ``steps`` (stop at the end of the episode that reaches it) and ``episodes``
    must be given. Each episode is reset with its own seed (``seed + episode index``), which is
    recorded in the buffer.
    """
    if (steps is None) == (episodes is None):
        raise ValueError("give exactly one of steps and episodes")
    buffers: list[Any] = []
    total = 0
    env.action_space.seed(seed)
    while (episodes is not None and len(buffers) < episodes) or (
        steps is not None and total < steps
    ):
        episode_seed = seed + len(buffers)
        observation, _ = env.reset(seed=episode_seed)
        observations, actions, rewards, terminations, truncations = [observation], [], [], [], []
        state = _simulator_state(env)
        states: list[Any] | None = [state] if state is not None else None
        while True:
            action = policy(observation)
            observation, reward, terminated, truncated, _ = env.step(action)
            observations.append(observation)
            actions.append(action)
            rewards.append(float(reward))
            terminations.append(bool(terminated))
            truncations.append(bool(truncated))
            if states is not None:
                states.append(_simulator_state(env))
            if terminated or truncated:
                break
        total += len(rewards)
        buffers.append(
            EpisodeBuffer(
                id=len(buffers),
                seed=episode_seed,
                observations=_stack(observations),
                actions=_stack(actions),
                rewards=rewards,
                terminations=terminations,
                truncations=truncations,
                infos=_stack(states) if states is not None else None,
            )
        )
    return buffers


def write_with_minari(
    buffers: list[Any],
    env: gym.Env[Any, Any],
    dataset_id: str,
    root: Path,
    *,
    algorithm_name: str,
    description: str,
    data_format: StorageFormat,
    score_kwargs: dict[str, Any],
) -> Path:
    """Write episode buffers with Minari's own ``create_dataset_from_buffers`` under ``root``.

    Returns the dataset directory (``root / dataset_id``); callers stage ``root`` and move the
    result into place.
    """
    with _datasets_path(root), warnings.catch_warnings():
        # Minari warns about every unset optional metadata field (author, permalink, ...).
        warnings.simplefilter("ignore", UserWarning)
        minari.create_dataset_from_buffers(
            dataset_id=dataset_id,
            buffer=buffers,
            env=env,
            algorithm_name=algorithm_name,
            author="offaug",
            author_email="offaug@users.noreply.invalid",
            code_permalink="https://pypi.org/project/offaug/",
            description=description,
            data_format=data_format,
            **score_kwargs,
        )
    return root / dataset_id


def make_dataset(
    env_id: str,
    dataset_id: str,
    *,
    policy: Literal["random"] | str = "random",
    steps: int | None = None,
    episodes: int | None = None,
    data_format: StorageFormat = "hdf5",
    seed: int = 0,
    max_episode_steps: int | None = None,
    root: str | Path | None = None,
    overwrite: bool = False,
    env_kwargs: dict[str, Any] | None = None,
) -> GeneratedDataset:
    """Generate a Minari dataset with Minari's own writer.

    Args:
        env_id: Gymnasium environment id (``Hopper-v5``, ``CartPole-v1``, ``offaug/PointGoal-v0``).
        dataset_id: Minari id, ``[namespace/]name-vK``.
        policy: ``"random"``, the only policy this function runs. Data from a trained policy
            (D4RL's medium, expert and medium-replay levels, made with SAC) is
            :func:`offaug.algorithms.online.levels.make_level_dataset`'s
            (``offaug make-dataset --policy sac``).
        steps: Collect at least this many steps (whole episodes).
        episodes: Or exactly this many episodes.
        data_format: Minari storage, ``hdf5`` or ``arrow``.
        seed: Seed of the first episode's reset and of the action sampler.
        max_episode_steps: Override the environment's time limit (short episodes for tests).
        root: Datasets root; default ``MINARI_DATASETS_PATH`` (or ``~/.minari/datasets``).
        overwrite: Replace an existing dataset with this id.
        env_kwargs: Extra keyword arguments for ``gymnasium.make``.
    """
    check_dataset_id(dataset_id)
    storage_backend(data_format)  # refuses an unknown format before any work
    register_envs()
    datasets_root = dataset_root(root)
    target = resolve_dataset_dir(dataset_id, datasets_root)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: dataset {dataset_id} exists; pass --overwrite")
    env = gym.make(env_id, max_episode_steps=max_episode_steps, **(env_kwargs or {}))
    if policy != "random":
        raise DataError(
            "make_dataset runs the random policy only; a SAC-trained level (medium, expert, "
            "medium-replay) is made by offaug.algorithms.online.levels.make_level_dataset",
            field=f"policy={policy!r}",
            hint="use --policy random, or --policy sac --level LEVEL",
        )
    buffers = collect_episodes(env, _random_policy(env), steps=steps, episodes=episodes, seed=seed)
    scores = d4rl_reference_scores(env_id)
    score_kwargs: dict[str, Any] = {}
    if scores is not None:
        score_kwargs = {"ref_min_score": scores[0], "ref_max_score": scores[1]}
    # Minari resolves ids under MINARI_DATASETS_PATH; write there through a hidden staging root
    # and move the result into place, so that a failure never leaves a half-written dataset
    # behind and an overwritten one is replaced only once the new one is complete.
    staging_root = tmp_name(datasets_root / f"staging-{dataset_id.replace('/', '__')}")
    staging_root.mkdir(parents=True)
    try:
        write_with_minari(
            buffers,
            env,
            dataset_id,
            staging_root,
            algorithm_name=f"offaug-{policy}",
            description=f"{policy} policy on {env_id}, generated by offaug (seed {seed})",
            data_format=data_format,
            score_kwargs=score_kwargs,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_directory(staging_root / dataset_id, target, overwrite=overwrite)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
        env.close()  # type: ignore[no-untyped-call]
    return GeneratedDataset(
        dataset_id=dataset_id,
        path=target,
        episodes=len(buffers),
        steps=sum(len(b) for b in buffers),
        data_format=data_format,
    )


@contextlib.contextmanager
def _datasets_path(root: Path) -> Iterator[None]:
    """Temporarily point ``MINARI_DATASETS_PATH`` at another root."""
    previous = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = previous
