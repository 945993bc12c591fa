"""Dataset levels by the D4RL recipe: random, medium, expert and medium-replay.

Fu, Kumar, Nachum, Tucker, Levine 2020, "D4RL: Datasets for Deep Data-Driven Reinforcement
Learning" (arXiv:2004.07219), section 5 (Gym-MuJoCo tasks):

* ``random``: a uniformly random policy;
* ``expert``: SAC trained online (here for ``train_steps`` environment steps), the final policy;
* ``medium``: the same run stopped early, at about a third of the expert's performance: the
  first periodic evaluation whose return reaches ``random + medium_fraction * (expert - random)``
  (measured from the random policy's return, so negative-return tasks such as Pendulum work);
* ``medium-replay``: every transition of that run, in order, until the medium policy was reached.

``random``, ``medium`` and ``expert`` collect ``steps`` steps by *sampling* the stochastic policy,
as D4RL does. Everything is written with Minari's own ``create_dataset_from_buffers``, staged and
moved into place so a failure leaves nothing half-written. The policy used is saved next to the
dataset as ``policy.pt`` (a :func:`~offaug.algorithms.base.save_checkpoint` file, algorithm ``sac``:
reload it with :func:`offaug.algorithms.training.checkpoints.load_trainer`), with ``level.json``
(the resolved config, every evaluation, the returns and the step the policy comes from).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from offaug.algorithms.base import config_to_json, load_checkpoint, save_checkpoint
from offaug.algorithms.evaluate import evaluate, make_env
from offaug.algorithms.learners.sac import SAC, SACConfig
from offaug.algorithms.names import Level
from offaug.algorithms.online.loop import OnlineEvaluation, train_online
from offaug.algorithms.runtime import seed_everything
from offaug.datasets.atomic import replace_directory
from offaug.datasets.envs import register_envs
from offaug.datasets.errors import DataError
from offaug.datasets.generate import (
    GeneratedDataset,
    StorageFormat,
    check_dataset_id,
    collect_episodes,
    d4rl_reference_scores,
    write_with_minari,
)
from offaug.datasets.paths import dataset_root, resolve_dataset_dir

LEVELS: tuple[Level, ...] = typing.get_args(Level)
POLICY_FILE = "policy.pt"
LEVEL_FILE = "level.json"
_EVAL_SEED_OFFSET = 10_000


def small_sac_config(hidden: tuple[int, ...] = (64, 64)) -> SACConfig:
    """SAC that learns small tasks (Pendulum) in a few thousand steps on a CPU: small networks,
    larger learning rates, a low starting temperature and an early start."""
    return SACConfig(
        hidden=hidden,
        actor_learning_rate=1e-3,
        critic_learning_rate=1e-3,
        initial_temperature=0.1,
        learning_starts=1000,
    )


@dataclasses.dataclass(frozen=True)
class LevelDataset:
    """What :func:`make_level_dataset` wrote and how the policy was chosen."""

    dataset: GeneratedDataset
    """The Minari dataset."""
    level: Level
    """Which D4RL level it is."""
    policy_checkpoint: Path | None
    """``policy.pt`` next to the dataset (None for ``random``)."""
    policy_step: int | None
    """Training step of the policy used (medium-replay: where the recorded data stops)."""
    policy_return: float | None
    """The policy's deterministic evaluation return at that step."""
    random_return: float
    """Mean return of the uniform random policy on the evaluation episodes."""
    expert_return: float | None
    """Mean return of the final SAC policy (None for ``random``)."""
    reference_scores: tuple[float, float] | None
    """``(ref_min_score, ref_max_score)`` recorded in the dataset, if any."""
    evaluations: tuple[OnlineEvaluation, ...]
    """Every evaluation of the training run."""


def medium_evaluation(
    evaluations: Sequence[OnlineEvaluation],
    random_return: float,
    expert_return: float,
    fraction: float = 1 / 3,
) -> OnlineEvaluation | None:
    """The first evaluation reaching ``random + fraction * (expert - random)``, if any.

    None is possible only when the expert did worse than the random policy.
    """
    threshold = random_return + fraction * (expert_return - random_return)
    return next((e for e in evaluations if e.mean_return >= threshold), None)


def _random_policy(env: gym.Env[Any, Any]) -> Any:
    """Uniform actions for one observation (what :func:`collect_episodes` calls)."""

    def act(_observation: Any) -> Any:
        return env.action_space.sample()

    return act


def _random_batch_policy(env: gym.Env[Any, Any]) -> Any:
    """Uniform actions for a batch of observations (what :func:`evaluate` calls)."""

    def act(observations: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        return np.stack([env.action_space.sample() for _ in range(len(observations))])

    return act


def _flat(env: gym.Env[Any, Any], observation: Any) -> npt.NDArray[np.float32]:
    """An observation as the flat float32 vector the SAC policy was trained on."""
    flat = gym.spaces.flatten(env.observation_space, observation)
    return np.asarray(flat, dtype=np.float32).reshape(-1)


def _unflatten_rows(space: gym.Space[Any], rows: npt.NDArray[Any]) -> Any:
    """Inverse of ``gym.spaces.flatten`` for a batch ``(N, flat)`` of Box or Dict-of-Box values.

    Training sees Dict observations flattened (in the space's key order); medium-replay writes
    them back in the environment's own space so that every level has the same layout.
    """
    if isinstance(space, gym.spaces.Box):
        return rows.reshape(len(rows), *space.shape).astype(space.dtype, copy=False)
    if isinstance(space, gym.spaces.Dict):
        values, start = {}, 0
        for key, subspace in space.spaces.items():
            width = gym.spaces.flatdim(subspace)
            values[key] = _unflatten_rows(subspace, rows[:, start : start + width])
            start += width
        return values
    raise DataError(f"medium-replay cannot record {space} observations", field="observation_space")


@dataclasses.dataclass(frozen=True)
class LevelConfig:
    """How one D4RL-style level is made: the environment, the level, SAC's run and the collection.

    Where the dataset goes (its id, format and root) is :func:`make_level_dataset`'s to say. The
    resolved config is saved with the dataset (``level.json``).
    """

    env_id: str
    """Gymnasium id with bounded Box actions (``Hopper-v5``, ``Pendulum-v1``)."""
    level: Level
    """``random``, ``medium``, ``expert`` or ``medium-replay``."""
    train_steps: int
    """Environment steps of SAC training, the expert's (ignored for ``random``)."""
    steps: int | None
    """Steps to collect with the chosen policy (whole episodes); ignored for ``medium-replay``,
    whose size is the number of steps until the medium policy."""
    seed: int = 0
    """Seeds training, the first reset of collection, and action sampling."""
    sac: SACConfig = dataclasses.field(default_factory=SACConfig)
    """SAC's hyperparameters (:func:`small_sac_config` learns small tasks quickly on a CPU)."""
    eval_every: int | None = None
    """Steps between evaluations of the training policy: the granularity at which ``medium`` is
    found (None: ``train_steps // 50``, see :attr:`evaluation_interval`)."""
    eval_episodes: int = 5
    """Episodes per evaluation (and for the random policy's return)."""
    medium_fraction: float = 1 / 3
    """Where ``medium`` sits between the random and expert returns."""
    max_episode_steps: int | None = None
    """Override the environment's time limit (None: the environment's own)."""
    device: str | None = None
    """Torch device for training (None: CUDA when there is one)."""
    threads: int | None = None
    """Torch CPU threads (None: torch's default)."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise DataError(f"must be one of {list(LEVELS)}", field=f"level={self.level!r}")
        if self.level != "medium-replay" and (self.steps is None or self.steps <= 0):
            raise DataError(
                f"level {self.level} needs a positive step count", field=f"steps={self.steps}"
            )
        if self.level != "random" and self.train_steps <= 0:
            raise DataError(
                f"level {self.level} needs SAC training", field=f"train_steps={self.train_steps}"
            )

    @property
    def evaluation_interval(self) -> int:
        """Steps between evaluations: ``eval_every``, or 50 evaluations over the run."""
        return self.eval_every if self.eval_every is not None else max(1, self.train_steps // 50)

    @property
    def env_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``gymnasium.make`` (the time limit, when overridden)."""
        if self.max_episode_steps is None:
            return {}
        return {"max_episode_steps": self.max_episode_steps}


def make_level_dataset(
    config: LevelConfig,
    dataset_id: str,
    *,
    data_format: StorageFormat = "hdf5",
    root: str | Path | None = None,
    overwrite: bool = False,
) -> LevelDataset:
    """Train SAC in ``config.env_id`` as D4RL did and write the level's dataset ``dataset_id``.

    Args:
        config: The environment, level, SAC run and collection size.
        dataset_id: Minari id to write, ``[namespace/]name-vK``.
        data_format: Minari storage, ``hdf5`` or ``arrow``.
        root: Datasets root; default ``MINARI_DATASETS_PATH`` (or ``~/.minari/datasets``).
        overwrite: Replace an existing dataset with this id.

    Raises:
        DataError: a malformed id or format.
        FileExistsError: the dataset exists and ``overwrite`` is False (checked before training).
    """
    check_dataset_id(dataset_id)
    if data_format not in ("hdf5", "arrow"):
        raise DataError("must be 'hdf5' or 'arrow'", field=f"format={data_format!r}")
    level, seed = config.level, config.seed
    register_envs()
    datasets_root = dataset_root(root)
    target = resolve_dataset_dir(dataset_id, datasets_root)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: dataset {dataset_id} exists; pass --overwrite")

    with contextlib.ExitStack() as cleanup:
        # Collection uses the raw env, as make_dataset does; SAC trains on make_env's (Dict
        # observations flattened), and medium-replay unflattens what training recorded.
        collect_env = gym.make(config.env_id, **config.env_kwargs)
        cleanup.callback(collect_env.close)
        eval_env = make_env({}, config.env_id, **config.env_kwargs)
        cleanup.callback(eval_env.close)
        staging_root = datasets_root / f".staging-{dataset_id.replace('/', '__')}-{seed}"
        shutil.rmtree(staging_root, ignore_errors=True)
        staging_root.mkdir(parents=True)
        cleanup.callback(shutil.rmtree, staging_root, ignore_errors=True)

        eval_env.action_space.seed(seed)
        random_return = evaluate(
            _random_batch_policy(eval_env),
            eval_env,
            episodes=config.eval_episodes,
            seed=seed + _EVAL_SEED_OFFSET,
        ).mean_return
        trained = None
        if level != "random":
            trained = _train(config, random_return, staging_root / "candidates")
        buffers = _level_episodes(level, trained, collect_env, config.steps, seed)
        scores = d4rl_reference_scores(config.env_id)
        if scores is None and trained is not None:
            scores = (random_return, trained.expert_return)
        record = {
            "env_id": config.env_id,
            "level": level,
            "seed": seed,
            "train_steps": 0 if trained is None else config.train_steps,
            "steps": config.steps,
            "medium_fraction": config.medium_fraction,
            "eval_every": config.evaluation_interval,
            "eval_episodes": config.eval_episodes,
            "max_episode_steps": config.max_episode_steps,
            "sac_config": config_to_json(config.sac),
            "random_return": random_return,
            "expert_return": None if trained is None else trained.expert_return,
            "policy_step": None if trained is None else trained.chosen.step,
            "policy_return": None if trained is None else trained.chosen.mean_return,
            "reference_scores": None if scores is None else list(scores),
            "evaluations": [
                dataclasses.asdict(e) for e in (trained.evaluations if trained else ())
            ],
        }
        staged = _write_minari(
            buffers, collect_env, dataset_id, staging_root, data_format, scores, record
        )
        if trained is not None:
            shutil.copyfile(trained.checkpoint, staged / POLICY_FILE)
        (staged / LEVEL_FILE).write_text(json.dumps(record, indent=2) + "\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_directory(staged, target)
    return LevelDataset(
        dataset=GeneratedDataset(
            dataset_id=dataset_id,
            path=target,
            episodes=len(buffers),
            steps=sum(len(b) for b in buffers),
            data_format=data_format,
        ),
        level=level,
        policy_checkpoint=None if trained is None else target / POLICY_FILE,
        policy_step=None if trained is None else trained.chosen.step,
        policy_return=None if trained is None else trained.chosen.mean_return,
        random_return=random_return,
        expert_return=None if trained is None else trained.expert_return,
        reference_scores=scores,
        evaluations=() if trained is None else trained.evaluations,
    )


def _level_episodes(
    level: Level,
    trained: _Trained | None,
    env: gym.Env[Any, Any],
    steps: int | None,
    seed: int,
) -> list[Any]:
    """The level's Minari ``EpisodeBuffer`` objects: collected, or medium-replay's record."""
    if trained is None:
        return collect_episodes(env, _random_policy(env), steps=steps, seed=seed)
    if level == "medium-replay":
        assert trained.record is not None
        return [
            dataclasses.replace(
                episode, observations=_unflatten_rows(env.observation_space, episode.observations)
            )
            for episode in trained.record
        ]
    trainer = trained.trainer
    seed_everything(seed)

    def sample(observation: Any) -> npt.NDArray[np.float32]:
        return trainer.sample_action(_flat(env, observation)[None])[0]

    return collect_episodes(env, sample, steps=steps, seed=seed)


def _write_minari(
    buffers: list[Any],
    env: gym.Env[Any, Any],
    dataset_id: str,
    staging_root: Path,
    data_format: StorageFormat,
    scores: tuple[float, float] | None,
    record: dict[str, Any],
) -> Path:
    """Write the dataset under ``staging_root`` with Minari's own writer; return its folder."""
    score_kwargs: dict[str, Any] = {}
    if scores is not None:
        score_kwargs = {"ref_min_score": scores[0], "ref_max_score": scores[1]}
    policy_name = "random" if record["policy_step"] is None else "sac"
    description = f"D4RL-style {record['level']} data ({policy_name} policy) on {record['env_id']}"
    if record["policy_step"] is not None:
        description += (
            f": SAC trained {record['train_steps']} steps, policy from step "
            f"{record['policy_step']} (evaluation return {record['policy_return']:.1f}; random "
            f"{record['random_return']:.1f}, expert {record['expert_return']:.1f})"
        )
    return write_with_minari(
        buffers,
        env,
        dataset_id,
        staging_root,
        algorithm_name=f"offaug-{policy_name}-{record['level']}",
        description=f"{description}, generated by offaug (seed {record['seed']})",
        data_format=data_format,
        score_kwargs=score_kwargs,
    )


@dataclasses.dataclass(frozen=True)
class _Trained:
    """What the SAC run left for the level: the chosen policy and how it was chosen."""

    trainer: SAC
    """Holding the chosen policy's weights."""
    chosen: OnlineEvaluation
    """The evaluation the policy comes from."""
    checkpoint: Path
    """The chosen policy's checkpoint (inside the staging root)."""
    expert_return: float
    """The final evaluation's return."""
    evaluations: tuple[OnlineEvaluation, ...]
    """Every evaluation of the run."""
    record: list[Any] | None
    """Medium-replay's episodes (Minari ``EpisodeBuffer``), up to the chosen step."""


def _train(config: LevelConfig, random_return: float, candidates: Path) -> _Trained:
    """Run SAC, keeping a checkpoint of every evaluation that beats all earlier ones.

    The medium policy is the first evaluation to reach a threshold that is known only once the
    expert (final) return is: such an evaluation beats every earlier one, so only those
    record-setting checkpoints can be chosen and only they are written.
    """
    best = -np.inf
    saved: dict[int, Path] = {}
    level = config.level
    keep_candidates = level in ("medium", "medium-replay")

    def on_checkpoint(step: int, trainer: SAC, mean_return: float) -> None:
        nonlocal best
        if keep_candidates and mean_return > best:
            best = mean_return
            saved[step] = _save_policy(candidates / f"step_{step}.pt", trainer, step, mean_return)

    result = train_online(
        config.env_id,
        config.train_steps,
        config.sac,
        config.seed,
        eval_every=config.evaluation_interval,
        eval_episodes=config.eval_episodes,
        record=level == "medium-replay",
        on_checkpoint=on_checkpoint,
        max_episode_steps=config.max_episode_steps,
        device=config.device,
        threads=config.threads,
    )
    final = result.evaluations[-1]
    if final.mean_return <= random_return:
        warnings.warn(
            f"SAC's final return {final.mean_return:.1f} in {config.env_id} is no better than the "
            f"random policy's {random_return:.1f}: train for more steps",
            RuntimeWarning,
            stacklevel=3,
        )
    trainer = result.trainer
    chosen = final
    if level != "expert":
        medium = medium_evaluation(
            result.evaluations, random_return, final.mean_return, config.medium_fraction
        )
        # None: the final policy did worse than random; it is then the best "medium" there is.
        chosen = medium or final
    if chosen.step in saved:
        checkpoint = saved[chosen.step]
        trainer.load_state_dict(load_checkpoint(checkpoint).state)
    else:
        checkpoint = _save_policy(candidates / "final.pt", trainer, final.step, final.mean_return)
    record = None
    if result.record is not None:
        record = result.record.episodes(chosen.step, first_seed=config.seed)
    return _Trained(trainer, chosen, checkpoint, final.mean_return, result.evaluations, record)


def _save_policy(path: Path, trainer: SAC, step: int, mean_return: float) -> Path:
    return save_checkpoint(
        path,
        algorithm="sac",
        config=trainer.config,
        spaces=trainer.spaces,
        state=trainer.state_dict(),
        extra={"step": step, "evaluation_return": mean_return},
    )
