"""Making a dataset by its generating policy: the one place that picks between the uniform random
policy (:func:`offaug.datasets.generate.make_dataset`) and SAC trained online to a D4RL level
(:func:`offaug.algorithms.online.levels.make_level_dataset`).

``offaug make-dataset``, a workflow's ``source.make`` and the learning benchmark all call
:func:`make_source_dataset`. Only SAC needs torch, so its module is imported in that branch alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from offaug.algorithms.names import GeneratingPolicy, Level
from offaug.datasets.generate import GeneratedDataset, make_dataset
from offaug.datasets.storage import StorageFormat

if TYPE_CHECKING:
    from offaug.algorithms.learners.sac import SACConfig
    from offaug.algorithms.online.levels import LevelDataset


def make_source_dataset(
    env_id: str,
    dataset_id: str,
    *,
    policy: GeneratingPolicy = "random",
    level: Level = "medium",
    train_steps: int = 100_000,
    steps: int | None = None,
    episodes: int | None = None,
    data_format: StorageFormat = "hdf5",
    seed: int = 0,
    max_episode_steps: int | None = None,
    root: str | Path | None = None,
    overwrite: bool = False,
    sac_config: SACConfig | None = None,
    threads: int | None = None,
) -> GeneratedDataset | LevelDataset:
    """Write the Minari dataset ``dataset_id`` collected in ``env_id`` by ``policy``.

    Args:
        env_id: Gymnasium environment id.
        dataset_id: Minari id to write, ``[namespace/]name-vK``.
        policy: ``random``, or ``sac`` (trained online, then collected at ``level``).
        level: With ``sac``: ``random``, ``medium``, ``expert`` or ``medium-replay``.
        train_steps: With ``sac``: SAC's environment steps (its final policy is the expert).
        steps: Collect at least this many steps (whole episodes).
        episodes: Or exactly this many episodes (``random`` only).
        data_format: Minari storage, ``hdf5`` or ``arrow``.
        seed: Seed of resets and actions (and of SAC's training).
        max_episode_steps: Override the env's time limit.
        root: Datasets root; default ``MINARI_DATASETS_PATH``.
        overwrite: Replace an existing dataset with this id.
        sac_config: With ``sac``: its hyperparameters (default ``SACConfig()``).
        threads: With ``sac``: torch CPU threads.

    Returns:
        What was written: a :class:`~offaug.datasets.generate.GeneratedDataset`, or for ``sac``
        a :class:`~offaug.algorithms.online.levels.LevelDataset` (the dataset and how its
        policy was chosen).

    Raises:
        ValueError: ``episodes`` with ``sac`` (it collects ``steps``).
    """
    if policy == "random":
        return make_dataset(
            env_id,
            dataset_id,
            policy=policy,
            steps=steps,
            episodes=episodes,
            data_format=data_format,
            seed=seed,
            max_episode_steps=max_episode_steps,
            root=root,
            overwrite=overwrite,
        )
    if episodes is not None:
        raise ValueError("a SAC level collects steps, not episodes")
    # Imports torch: only SAC needs it.
    from offaug.algorithms.online.levels import LevelConfig, make_level_dataset

    config = LevelConfig(
        env_id,
        level,
        train_steps=train_steps,
        steps=steps,
        seed=seed,
        max_episode_steps=max_episode_steps,
        threads=threads,
    )
    if sac_config is not None:
        config = dataclasses.replace(config, sac=sac_config)
    return make_level_dataset(
        config, dataset_id, data_format=data_format, root=root, overwrite=overwrite
    )
