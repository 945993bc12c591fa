"""MixtureSampler: uniform rows, mixing ratios, weights and shard sets."""

from __future__ import annotations

import dataclasses
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
from offaug.datasets.sampler import Batch, batch_shares, sample_stacked, stack_numpy


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
    weighted = MixtureSampler(
        sets, 64, mixing=[0.5, 0.5], use_weights=True, normalise_weights=False
    ).sample()
    assert set(weighted.weights[weighted.set_index == 0].tolist()) == {1.0}
    assert set(weighted.weights[weighted.set_index == 1].tolist()) == {0.5}
    unweighted = MixtureSampler(sets, 64, mixing=[0.5, 0.5]).sample()
    assert set(unweighted.weights.tolist()) == {1.0}


def _heavy_tailed(n: int, tag: float, seed: int) -> Transitions:
    """A weighted set whose importance weights are log-normal, clipped at 100, some zero."""
    rng = np.random.default_rng(seed)
    weights = np.minimum(np.exp(rng.normal(0.0, 2.0, n)), 100.0)
    weights[rng.random(n) < 0.1] = 0.0
    data = _tagged(n, tag)
    return Transitions(**{**data.columns(), "importance_weight": weights.astype(np.float32)})


def test_weights_are_normalised_within_each_source() -> None:
    sets = [_tagged(500, 0.0), _heavy_tailed(500, 1.0, 0), _heavy_tailed(500, 2.0, 1)]
    sampler = MixtureSampler(sets, 250, mixing=[0.4, 0.4, 0.2], use_weights=True, seed=5)
    raw = MixtureSampler(
        sets, 250, mixing=[0.4, 0.4, 0.2], use_weights=True, normalise_weights=False, seed=5
    )
    for _ in range(5):
        batch, stored = sampler.sample(), raw.sample()
        np.testing.assert_array_equal(batch.rewards, stored.rewards)  # the same rows
        for set_id, count in enumerate(sampler.counts):
            rows = batch.set_index == set_id
            assert rows.sum() == count
            # Each source's weights sum to its row count: its share of mean(w * l).
            np.testing.assert_allclose(batch.weights[rows].sum(), count, rtol=1e-5)
            expected = stored.weights[rows] * count / stored.weights[rows].sum()
            np.testing.assert_allclose(batch.weights[rows], expected, rtol=1e-6)
        assert batch.weights.dtype == np.float32


def test_a_source_whose_rows_all_weigh_zero_stays_zero() -> None:
    zero = Transitions(
        **{**_tagged(20, 1.0).columns(), "importance_weight": np.zeros(20, np.float32)}
    )
    batch = MixtureSampler([_tagged(20, 0.0), zero], 10, mixing=[0.5, 0.5], use_weights=True)
    weights = batch.sample()
    assert np.isfinite(weights.weights).all()
    assert set(weights.weights[weights.set_index == 1].tolist()) == {0.0}
    assert set(weights.weights[weights.set_index == 0].tolist()) == {1.0}


def test_rollout_log_prob_is_gathered_with_nan_for_sets_without_it() -> None:
    original = _tagged(30, 0.0)
    augmented = Transitions(
        **{
            **_tagged(30, 1.0).columns(),
            "rollout_log_prob": np.arange(30, dtype=np.float32) - 100.0,
        }
    )
    sampler = MixtureSampler([original, augmented], 40, mixing=[0.5, 0.5], rollout_log_prob=True)
    assert sampler.sets_with_log_probs == [False, True]
    batch = sampler.sample()
    assert batch.rollout_log_prob is not None
    assert np.isnan(batch.rollout_log_prob[batch.set_index == 0]).all()
    augmented_rows = batch.set_index == 1
    # Row r of the augmented set has reward r and log-probability r - 100.
    np.testing.assert_array_equal(
        batch.rollout_log_prob[augmented_rows], batch.rewards[augmented_rows] - 100.0
    )
    assert MixtureSampler([original, augmented], 40).sample().rollout_log_prob is None


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


def _draws(samplers: list[MixtureSampler], steps: int, stacked: bool) -> list[Batch]:
    return [
        sample_stacked(samplers) if stacked else stack_numpy([s.sample() for s in samplers])
        for _ in range(steps)
    ]


def _assert_same(a: list[Batch], b: list[Batch]) -> None:
    for x, y in zip(a, b, strict=True):
        for field in dataclasses.fields(Batch):
            left, right = getattr(x, field.name), getattr(y, field.name)
            if left is None or right is None:
                assert left is None and right is None, field.name
            else:
                assert left.shape == right.shape and left.dtype == right.dtype, field.name
                np.testing.assert_array_equal(left, right, err_msg=field.name)


def test_stacked_members_draw_what_each_sampler_draws_alone() -> None:
    # Two sets (one weighted, with log-probabilities), next actions, three members' seeds.
    original = _tagged(300, 0.0)
    augmented = Transitions(
        **{
            **_heavy_tailed(200, 1.0, seed=4).columns(),
            "actions": np.random.default_rng(5).normal(size=(200, 2)).astype(np.float32),
            "rollout_log_prob": np.arange(200, dtype=np.float32) - 100.0,
        }
    )

    def members() -> list[MixtureSampler]:
        return [
            MixtureSampler(
                [original, augmented],
                48,
                mixing=[0.7, 0.3],
                use_weights=True,
                rollout_log_prob=True,
                next_actions=True,
                seed=seed,
            )
            for seed in (3, 8, 21)
        ]

    alone, together = members(), members()
    _assert_same(_draws(alone, 4, stacked=False), _draws(together, 4, stacked=True))
    # Each generator advanced as far as its own sample() calls took it.
    assert [s.rng_state() for s in alone] == [s.rng_state() for s in together]
    batch = sample_stacked(together)
    assert batch.observations.shape == (3, 48, 3) and batch.set_index.shape == (3, 48)
    # Each member's weighted rows are normalised within their source, member by member.
    augmented_rows = batch.set_index == 1
    for k in range(3):
        assert batch.weights[k][augmented_rows[k]].mean() == pytest.approx(1.0, rel=1e-5)


def test_stacked_members_on_different_data_each_sample_alone() -> None:
    first, second = _tagged(100, 0.0), _tagged(100, 1.0)
    alone = [MixtureSampler([first], 16, seed=1), MixtureSampler([second], 16, seed=2)]
    together = [MixtureSampler([first], 16, seed=1), MixtureSampler([second], 16, seed=2)]
    _assert_same(_draws(alone, 3, stacked=False), _draws(together, 3, stacked=True))
    assert (sample_stacked(together).observations[1] == 1.0).all()


def test_batch_shares_normalise_and_cap_later_sets_at_their_rows() -> None:
    assert batch_shares([1, 3]) == pytest.approx((0.25, 0.75))
    # 300 kept rows beside 10,000: capped at 300 / 10,300 of a batch, the rest original.
    capped = batch_shares([0.5, 0.5], rows=[10_000, 300])
    assert capped == pytest.approx((1 - 300 / 10_300, 300 / 10_300))
    # A set holding more than its stated share keeps the stated share.
    assert batch_shares([0.5, 0.5], rows=[10_000, 30_000]) == pytest.approx((0.5, 0.5))
    assert batch_shares([0.6, 0.2, 0.2], rows=[100, 10, 300]) == pytest.approx(
        (1 - 0.2 - 10 / 410, 10 / 410, 0.2)
    )
    with pytest.raises(DataError, match="rows="):
        batch_shares([0.5, 0.5], rows=[10])
    with pytest.raises(DataError, match="mixing="):
        batch_shares([0, 0])
