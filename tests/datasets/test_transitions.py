"""The Transitions contract: shapes, dtypes, episodes and concatenation."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.datasets import DataError, Transitions, concatenate


def _make(n: int = 6, episodes: list[int] | None = None) -> Transitions:
    ids = np.asarray(episodes if episodes is not None else [0, 0, 0, 1, 1, 2], dtype=np.int64)
    return Transitions(
        observations=np.arange(n * 2, dtype=np.float32).reshape(n, 2),
        actions=np.zeros((n, 1), dtype=np.float32),
        rewards=np.ones(n, dtype=np.float32),
        next_observations=np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 2,
        terminals=np.zeros(n, dtype=bool),
        timeouts=np.zeros(n, dtype=bool),
        episode_ids=ids,
    )


def test_episode_bounds_and_iteration() -> None:
    data = _make()
    assert data.num_episodes == 3
    np.testing.assert_array_equal(data.episode_bounds(), [0, 3, 5, 6])
    assert [len(e) for e in data.iter_episodes()] == [3, 2, 1]


def test_episode_returns_sum_each_episode_of_any_length() -> None:
    data = _make()
    rewards = np.asarray([1.0, 2.0, 3.0, np.nan, 5.0, 6.0], dtype=np.float32)
    broken = data.with_columns(rewards=rewards)
    np.testing.assert_array_equal(data.episode_returns(), [3.0, 2.0, 1.0])
    np.testing.assert_array_equal(broken.episode_returns(finite=True), [6.0, 5.0, 6.0])
    assert np.isnan(broken.episode_returns()[1])
    np.testing.assert_array_equal(data.episode_sums(np.arange(6)), [3.0, 7.0, 5.0])
    assert data.slice(0, 0).episode_returns().shape == (0,)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("rewards", np.ones((6, 1), dtype=np.float32), "rank 1"),
        ("rewards", np.ones(6, dtype=np.float64), "float32"),
        ("terminals", np.zeros(6, dtype=np.int8), "bool"),
        ("actions", np.zeros((5, 1), dtype=np.float32), "5 rows"),
        ("observations", np.zeros((6, 2), dtype=np.float64), "float32"),
        ("next_observations", np.zeros((6, 3), dtype=np.float32), "differs"),
    ],
)
def test_contract_violations_name_the_field(field: str, value: np.ndarray, match: str) -> None:
    columns = _make().columns()
    columns[field] = value
    with pytest.raises(DataError, match=match) as info:
        Transitions(**columns)
    assert field in str(info.value)


def test_concatenate_renumbers_episodes() -> None:
    joined = concatenate([_make(), _make()])
    assert len(joined) == 12
    assert joined.num_episodes == 6
    assert np.all(np.diff(joined.episode_ids) >= 0)


def test_concatenate_refuses_mismatched_columns() -> None:
    weighted = _make().with_columns(importance_weight=np.ones(6, dtype=np.float32))
    with pytest.raises(DataError, match="columns"):
        concatenate([_make(), weighted])


def test_take_and_slice_keep_extras() -> None:
    data = Transitions(**_make().columns(), extras={"infos/qpos": np.arange(6.0)[:, None]})
    np.testing.assert_array_equal(data.take([5, 0]).extras["infos/qpos"][:, 0], [5.0, 0.0])
    assert data.slice(1, 3).extras["infos/qpos"].shape == (2, 1)


def test_check_finite_names_field_and_row() -> None:
    data = _make()
    bad = data.with_columns(rewards=np.array([1, 1, 1, np.nan, 1, 1], dtype=np.float32))
    with pytest.raises(DataError, match=r"'rewards'.*row 3, episode 1"):
        bad.check_finite(origin="somewhere.hdf5")
