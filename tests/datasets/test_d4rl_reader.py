"""D4RL-format HDF5 files: offaug's rules, and the comparison with d4rl's qlearning_dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from offaug.datasets import DataError, load_transitions
from offaug.datasets.d4rl_reader import read_d4rl_hdf5
from offaug.datasets.minari_reader import read_minari_dir


def _d4rl_arrays(make_test_dataset) -> dict[str, np.ndarray]:
    """Flat D4RL-style arrays of real Hopper-v5 episodes (one row per step)."""
    data = read_minari_dir(make_test_dataset("hopper", "hdf5").path, info_keys=["qpos"])
    return {
        "observations": data.observations.astype(np.float32),
        "actions": data.actions,
        "rewards": data.rewards,
        "terminals": data.terminals,
        "timeouts": data.timeouts,
        "next_observations": data.next_observations,
        "infos/qpos": data.extras["infos/qpos"],
        "episode_ids": data.episode_ids,
    }


def _write(path: Path, arrays: dict[str, Any], keys: list[str]) -> Path:
    with h5py.File(path, "w") as handle:
        for key in keys:
            handle.create_dataset(key, data=arrays[key])
    return path


def _qlearning_dataset(
    arrays: dict[str, np.ndarray], keys: list[str], max_steps: int
) -> dict[str, np.ndarray]:
    os.environ.setdefault("D4RL_SUPPRESS_IMPORT_ERROR", "1")
    d4rl = pytest.importorskip("d4rl")

    class _Env:  # qlearning_dataset only reads the time limit from the env
        _max_episode_steps = max_steps

    return d4rl.qlearning_dataset(_Env(), dataset={k: arrays[k] for k in keys})


def test_matches_qlearning_dataset_with_timeouts(make_test_dataset, tmp_path: Path) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    keys = ["observations", "actions", "rewards", "terminals", "timeouts"]
    ours = read_d4rl_hdf5(_write(tmp_path / "v2.hdf5", arrays, keys))
    theirs = _qlearning_dataset(arrays, keys, max_steps=1000)
    n = len(arrays["rewards"])
    # qlearning_dataset keeps rows 0..N-2 that are not timeouts; offaug keeps every row that is
    # not a timeout, plus the last row when it is terminal.
    their_rows = np.flatnonzero(~arrays["timeouts"][: n - 1])
    our_rows = np.flatnonzero(~arrays["timeouts"] & (arrays["terminals"] | (np.arange(n) < n - 1)))
    np.testing.assert_array_equal(their_rows, our_rows[our_rows < n - 1])
    common = np.isin(our_rows, their_rows)
    for key in ("observations", "actions", "rewards", "terminals"):
        np.testing.assert_array_equal(getattr(ours, key)[common], theirs[key])
    # The documented difference: at terminal rows d4rl borrows the next episode's first
    # observation; offaug never crosses the boundary (and the value is never bootstrapped).
    terminal = ours.terminals[common]
    np.testing.assert_array_equal(
        ours.next_observations[common][~terminal], theirs["next_observations"][~terminal]
    )
    assert not np.array_equal(
        ours.next_observations[common][terminal], theirs["next_observations"][terminal]
    )
    np.testing.assert_array_equal(
        ours.next_observations[ours.terminals], ours.observations[ours.terminals]
    )


def test_next_observations_stay_inside_episodes(make_test_dataset, tmp_path: Path) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    keys = ["observations", "actions", "rewards", "terminals", "timeouts"]
    ours = read_d4rl_hdf5(_write(tmp_path / "v2.hdf5", arrays, keys))
    for episode in ours.iter_episodes():
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
        # A dropped timeout step leaves its predecessor as the episode's (timeout) end.
        assert episode.terminals[-1] or episode.timeouts[-1]
    # Every non-terminal next observation equals the true one from the Minari episode.
    truth = arrays["next_observations"]
    keep = ~arrays["timeouts"] & (arrays["terminals"] | (np.arange(len(truth)) < len(truth) - 1))
    non_terminal = ~arrays["terminals"][keep]
    np.testing.assert_array_equal(ours.next_observations[non_terminal], truth[keep][non_terminal])
    assert ours.meta["dropped_steps"] == int((~keep).sum())


def test_stored_next_observations_are_used_and_nothing_dropped(
    make_test_dataset, tmp_path: Path
) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    keys = [
        "observations",
        "actions",
        "rewards",
        "terminals",
        "timeouts",
        "next_observations",
        "infos/qpos",
    ]
    ours = read_d4rl_hdf5(_write(tmp_path / "full.hdf5", arrays, keys), info_keys=["qpos"])
    assert len(ours) == len(arrays["rewards"])
    np.testing.assert_array_equal(ours.next_observations, arrays["next_observations"])
    np.testing.assert_array_equal(ours.extras["infos/qpos"], arrays["infos/qpos"])
    assert ours.num_episodes == len(np.unique(arrays["episode_ids"]))


def test_v0_without_terminals_matches_qlearning_dataset(make_test_dataset, tmp_path: Path) -> None:
    arrays = dict(_d4rl_arrays(make_test_dataset))
    arrays["terminals"] = np.zeros_like(arrays["terminals"])
    keys = ["observations", "actions", "rewards", "terminals"]
    limit = 12
    ours = read_d4rl_hdf5(_write(tmp_path / "v0.hdf5", arrays, keys), max_episode_steps=limit)
    theirs = _qlearning_dataset(arrays, keys, max_steps=limit)
    assert ours.meta["has_timeouts"] is False and ours.meta["max_episode_steps"] == limit
    for key in ("observations", "actions", "rewards", "next_observations", "terminals"):
        np.testing.assert_array_equal(getattr(ours, key), theirs[key], err_msg=key)
    # Episodes of limit steps keep limit - 1 transitions; each ends as a timeout.
    lengths = np.diff(ours.episode_bounds())
    assert set(lengths[:-1].tolist()) == {limit - 1}
    assert ours.timeouts.sum() == ours.num_episodes


def _v0_rule(terminals: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """offaug's documented v0 rule, written as a plain loop: (kept rows, episode ids)."""
    kept, ids = [], []
    step, episode = 0, 0
    for i, terminal in enumerate(terminals):
        at_limit = step == limit - 1 and not terminal
        last_row = i == len(terminals) - 1
        if not (at_limit or (last_row and not terminal)):
            kept.append(i)
            ids.append(episode)
        if terminal or at_limit:
            step, episode = 0, episode + 1
        else:
            step += 1
    return np.asarray(kept), np.asarray(ids)


def test_v0_with_terminals_follows_the_documented_rule(make_test_dataset, tmp_path: Path) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    keys = ["observations", "actions", "rewards", "terminals"]
    limit = 12
    ours = read_d4rl_hdf5(_write(tmp_path / "v0.hdf5", arrays, keys), max_episode_steps=limit)
    kept, ids = _v0_rule(arrays["terminals"], limit)
    np.testing.assert_array_equal(ours.rewards, arrays["rewards"][kept])
    np.testing.assert_array_equal(
        np.unique(ours.episode_ids, return_inverse=True)[1], np.unique(ids, return_inverse=True)[1]
    )
    # The documented difference: d4rl's step counter restarts at 1, not 0, after a terminal
    # (it is reset and then incremented in the same iteration), so its episode after a terminal
    # is cut one step early. offaug counts from the episode's true first step.
    theirs = _qlearning_dataset(arrays, keys, max_steps=limit)
    assert len(theirs["rewards"]) < len(ours)


def test_missing_required_key_names_file_and_key(make_test_dataset, tmp_path: Path) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    path = _write(tmp_path / "bad.hdf5", arrays, ["observations", "actions", "terminals"])
    with pytest.raises(DataError, match=r"bad\.hdf5.*'rewards'"):
        read_d4rl_hdf5(path)


def test_mismatched_lengths_name_the_field(make_test_dataset, tmp_path: Path) -> None:
    arrays = dict(_d4rl_arrays(make_test_dataset))
    arrays["actions"] = arrays["actions"][:-3]
    path = _write(
        tmp_path / "bad.hdf5", arrays, ["observations", "actions", "rewards", "terminals"]
    )
    with pytest.raises(DataError, match="'actions'"):
        read_d4rl_hdf5(path)


def test_nan_reward_names_the_field(make_test_dataset, tmp_path: Path) -> None:
    arrays = dict(_d4rl_arrays(make_test_dataset))
    arrays["rewards"] = arrays["rewards"].copy()
    arrays["rewards"][7] = np.inf
    path = _write(
        tmp_path / "nan.hdf5",
        arrays,
        ["observations", "actions", "rewards", "terminals", "timeouts"],
    )
    with pytest.raises(DataError, match=r"nan\.hdf5.*'rewards'"):
        read_d4rl_hdf5(path)


def test_not_hdf5_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.hdf5"
    path.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(DataError, match=r"junk\.hdf5"):
        load_transitions(path)


def test_d4rl_file_loads_through_the_cache(make_test_dataset, tmp_path: Path) -> None:
    arrays = _d4rl_arrays(make_test_dataset)
    path = _write(
        tmp_path / "v2.hdf5",
        arrays,
        ["observations", "actions", "rewards", "terminals", "timeouts"],
    )
    first = load_transitions(path)
    second = load_transitions(path)
    assert second.equals(first)
    assert not second.observations.flags.writeable  # the memory-mapped cache
