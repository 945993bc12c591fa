"""Shared fixtures: small real Minari datasets made with Minari's own writer.

Every test session gets its own ``MINARI_DATASETS_PATH`` and ``OFFAUG_CACHE_DIR`` so nothing
touches the user's home directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from offaug.datasets.generate import GeneratedDataset, make_dataset


@pytest.fixture(scope="session")
def minari_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private Minari datasets root, also exported as MINARI_DATASETS_PATH."""
    root = tmp_path_factory.mktemp("minari")
    previous = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("MINARI_DATASETS_PATH", None)
    else:
        os.environ["MINARI_DATASETS_PATH"] = previous


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as Dask workers use: on a busy 2-core machine two threads make small
    matrix multiplies tens of times slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def offaug_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, private OFFAUG_CACHE_DIR for every test."""
    cache = tmp_path / "offaug-cache"
    monkeypatch.setenv("OFFAUG_CACHE_DIR", str(cache))
    return cache


DatasetFactory = Callable[..., GeneratedDataset]

# (env id, episodes, time limit): short limits so that datasets hold both terminations and
# truncations, and episodes of many different lengths.
DATASET_SPECS: dict[str, tuple[str, int, int | None]] = {
    "hopper": ("Hopper-v5", 40, 30),
    "point": ("offaug/PointGoal-v0", 15, None),
    "cartpole": ("CartPole-v1", 20, 25),
    "pendulum": ("Pendulum-v1", 8, 40),
}


@pytest.fixture(scope="session")
def make_test_dataset(minari_root: Path) -> DatasetFactory:
    """A factory ``(kind, format) -> GeneratedDataset``, each made once per session."""
    made: dict[tuple[str, str], GeneratedDataset] = {}

    def factory(kind: str, data_format: str = "hdf5") -> GeneratedDataset:
        key = (kind, data_format)
        if key not in made:
            env_id, episodes, limit = DATASET_SPECS[kind]
            made[key] = make_dataset(
                env_id,
                f"test/{kind}-{data_format}-v0",
                episodes=episodes,
                data_format=data_format,  # type: ignore[arg-type]
                seed=7,
                max_episode_steps=limit,
                root=minari_root,
            )
        return made[key]

    return factory
