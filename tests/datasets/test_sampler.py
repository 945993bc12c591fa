"""MixtureSampler: uniform rows, mixing ratios, weights and shard sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from offaug.datasets import (
    DataError,
    MixtureSampler,
    ShardSet,
    Transitions,
    write_shard_set,
)
from offaug.datasets.minari_reader import read_minari_dir


def _tagged(n: int, tag: float, weights: bool = False) -> Transitions:
    """Transitions whose observations all equal ``tag`` and whose rewards are the row index."""
    return Transitions(
        observations=np.full((n, 3), tag, dtype=np.float32),
        actions=np.zeros((n, 2), dtype=np.float32),
        rewards=np.arange(n, dtype=np.float32),
        next_observations=np.full((n, 3), tag, dtype=np.float32),
        terminals=np.zeros(n, dtype=bool),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=np.zeros(n, dtype=np.int64),
        importance_weight=np.full(n, 0.5, dtype=np.float32) if weights else None,
    )


def test_mixing_ratio_sets_the_rows_per_set() -> None:
    sampler = MixtureSampler([_tagged(100, 0.0), _tagged(1000, 1.0)], 256, mixing=[0.25, 0.75])
    batch = sampler.sample()
    assert len(batch) == 256
    assert (batch.observations[:, 0] == 1.0).sum() == 192
    assert (batch.set_index == 1).sum() == 192


def test_default_mixing_is_uniform_over_all_rows() -> None:
    sampler = MixtureSampler([_tagged(100, 0.0), _tagged(300, 1.0)], 400)
    assert sampler.counts == [100, 300]


def test_rows_are_uniform_within_a_set() -> None:
    sampler = MixtureSampler([_tagged(10, 0.0)], 1000, seed=3)
    counts = np.bincount(
        np.concatenate([sampler.sample().rewards.astype(int) for _ in range(50)]), minlength=10
    )
    expected = 50 * 1000 / 10
    # Chi-square with 9 degrees of freedom: 27.9 is the 0.999 quantile.
    assert ((counts - expected) ** 2 / expected).sum() < 27.9


def test_weights_come_from_importance_weight_when_asked() -> None:
    sets = [_tagged(50, 0.0), _tagged(50, 1.0, weights=True)]
    weighted = MixtureSampler(sets, 64, mixing=[0.5, 0.5], use_weights=True).sample()
    assert set(weighted.weights[weighted.set_index == 0].tolist()) == {1.0}
    assert set(weighted.weights[weighted.set_index == 1].tolist()) == {0.5}
    unweighted = MixtureSampler(sets, 64, mixing=[0.5, 0.5]).sample()
    assert set(unweighted.weights.tolist()) == {1.0}


def test_same_seed_same_batches() -> None:
    data = [_tagged(500, 0.0)]
    a = MixtureSampler(data, 32, seed=11)
    b = MixtureSampler(data, 32, seed=11)
    for _ in range(3):
        np.testing.assert_array_equal(a.sample().rewards, b.sample().rewards)


def test_samples_from_a_multi_shard_memory_mapped_set(make_test_dataset, tmp_path: Path) -> None:
    data = read_minari_dir(make_test_dataset("hopper", "hdf5").path)
    write_shard_set(data, tmp_path / "set", rows_per_shard=150)
    shard_set = ShardSet.open(tmp_path / "set")
    assert len(shard_set.shards) > 2
    batch = MixtureSampler([shard_set], 512, seed=0).sample()
    # Every sampled transition is a real row of the dataset, columns kept together.
    rows = {row.tobytes(): i for i, row in enumerate(data.observations)}
    for obs, next_obs, reward in zip(
        batch.observations, batch.next_observations, batch.rewards, strict=True
    ):
        i = rows[obs.tobytes()]
        np.testing.assert_array_equal(next_obs, data.next_observations[i])
        assert reward == data.rewards[i]


@pytest.mark.parametrize("mixing", [[1.0], [-1.0, 2.0], [0.0, 0.0]])
def test_bad_mixing_is_refused(mixing: list[float]) -> None:
    with pytest.raises(DataError, match="mixing"):
        MixtureSampler([_tagged(5, 0.0), _tagged(5, 1.0)], 4, mixing=mixing)


def test_sets_of_different_observation_shapes_are_refused() -> None:
    other = Transitions(
        **{
            **_tagged(5, 0.0).columns(),
            "observations": np.zeros((5, 4), np.float32),
            "next_observations": np.zeros((5, 4), np.float32),
        }
    )
    with pytest.raises(DataError, match="observation shapes"):
        MixtureSampler([_tagged(5, 0.0), other], 4)
