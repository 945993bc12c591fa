"""The Minari readers equal Minari's own per-episode iteration, for every storage and space."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import minari
import numpy as np
import pytest

from offaug.datasets import DataError, Transitions, load_transitions, minari_reader
from offaug.datasets.minari_reader import read_minari_dir

FORMATS = ["hdf5", "arrow"]
KINDS = ["hopper", "point", "cartpole"]


def _flatten(observations: object, space: gym.Space) -> np.ndarray:  # type: ignore[type-arg]
    if isinstance(space, gym.spaces.Dict):
        assert isinstance(observations, dict)
        return np.concatenate(
            [np.asarray(observations[k]).reshape(len(observations[k]), -1) for k in space.spaces],
            axis=1,
        )
    return np.asarray(observations)


def _reference(path: Path) -> dict[str, np.ndarray]:
    """The transition arrays built the slow, obviously-right way from Minari's iterator."""
    dataset = minari.MinariDataset(path / "data")
    columns: dict[str, list[np.ndarray]] = {
        k: [] for k in ("obs", "next", "act", "rew", "term", "trunc", "ids")
    }
    for episode in dataset.iterate_episodes():
        observations = _flatten(episode.observations, dataset.observation_space)
        assert len(observations) == len(episode) + 1
        columns["obs"].append(observations[:-1])
        columns["next"].append(observations[1:])
        columns["act"].append(np.asarray(episode.actions))
        columns["rew"].append(episode.rewards)
        columns["term"].append(episode.terminations)
        columns["trunc"].append(episode.truncations)
        columns["ids"].append(np.full(len(episode), episode.id))
    return {k: np.concatenate(v) for k, v in columns.items()}


def _assert_matches(transitions: Transitions, reference: dict[str, np.ndarray]) -> None:
    observation_dtype = transitions.observations.dtype
    np.testing.assert_array_equal(
        transitions.observations, reference["obs"].astype(observation_dtype)
    )
    np.testing.assert_array_equal(
        transitions.next_observations, reference["next"].astype(observation_dtype)
    )
    np.testing.assert_array_equal(
        transitions.actions, reference["act"].astype(transitions.actions.dtype)
    )
    np.testing.assert_array_equal(transitions.rewards, reference["rew"].astype(np.float32))
    np.testing.assert_array_equal(transitions.terminals, reference["term"])
    np.testing.assert_array_equal(transitions.timeouts, reference["trunc"])
    np.testing.assert_array_equal(transitions.episode_ids, reference["ids"])


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_reader_equals_minari_iteration(make_test_dataset, kind: str, data_format: str) -> None:
    made = make_test_dataset(kind, data_format)
    transitions = read_minari_dir(made.path)
    assert len(transitions) == made.steps
    assert transitions.num_episodes == made.episodes
    _assert_matches(transitions, _reference(made.path))


@pytest.mark.parametrize("data_format", FORMATS)
def test_next_observations_never_cross_episodes(make_test_dataset, data_format: str) -> None:
    transitions = read_minari_dir(make_test_dataset("hopper", data_format).path)
    lengths = np.diff(transitions.episode_bounds())
    assert len(set(lengths.tolist())) > 3, "the fixture should have episodes of many lengths"
    for episode in transitions.iter_episodes():
        # Within an episode, each next observation is the following step's observation.
        np.testing.assert_array_equal(episode.next_observations[:-1], episode.observations[1:])
        # Every episode ends with a termination or a truncation, and only there.
        assert episode.terminals[-1] or episode.timeouts[-1]
        assert not (episode.terminals[:-1] | episode.timeouts[:-1]).any()
    # Both kinds of ending occur, so a reader that mixed them up would fail above.
    assert transitions.terminals.any() and transitions.timeouts.any()


def test_first_observation_of_each_episode_is_its_reset(make_test_dataset) -> None:
    made = make_test_dataset("hopper", "hdf5")
    transitions = read_minari_dir(made.path)
    dataset = minari.MinariDataset(made.path / "data")
    starts = transitions.episode_bounds()[:-1]
    for episode, start in zip(dataset.iterate_episodes(), starts, strict=True):
        np.testing.assert_array_equal(
            transitions.observations[start], episode.observations[0].astype(np.float32)
        )


@pytest.mark.parametrize("data_format", FORMATS)
def test_dict_observations_are_flattened_in_space_order(
    make_test_dataset, data_format: str
) -> None:
    transitions = read_minari_dir(make_test_dataset("point", data_format).path)
    assert transitions.meta["observation_keys"] == ["achieved_goal", "desired_goal", "observation"]
    assert transitions.observation_shape == (6,)
    # achieved_goal and observation are the same position in PointGoal.
    np.testing.assert_array_equal(
        transitions.observations[:, 0:2], transitions.observations[:, 4:6]
    )


@pytest.mark.parametrize("data_format", FORMATS)
def test_discrete_actions_are_int64_indices(make_test_dataset, data_format: str) -> None:
    transitions = read_minari_dir(make_test_dataset("cartpole", data_format).path)
    assert transitions.actions.dtype == np.int64
    assert transitions.actions.shape == (len(transitions),)
    assert set(np.unique(transitions.actions).tolist()) <= {0, 1}
    assert transitions.is_discrete_action


@pytest.mark.parametrize("data_format", FORMATS)
def test_simulator_state_infos_align_with_observations(make_test_dataset, data_format: str) -> None:
    made = make_test_dataset("hopper", data_format)
    transitions = read_minari_dir(made.path, info_keys=["qpos", "qvel"])
    qpos = transitions.extras["infos/qpos"]
    qvel = transitions.extras["infos/qvel"]
    assert qpos.shape == (len(transitions), 6) and qvel.shape == (len(transitions), 6)
    # Hopper's observation is qpos[1:] followed by clipped qvel.
    np.testing.assert_allclose(transitions.observations[:, :5], qpos[:, 1:], rtol=1e-6, atol=1e-6)


def test_parallel_read_equals_serial(make_test_dataset, monkeypatch) -> None:
    made = make_test_dataset("hopper", "hdf5")
    serial = read_minari_dir(made.path, workers=1)
    monkeypatch.setattr(minari_reader, "_PARALLEL_MIN_EPISODES", 2)
    parallel = read_minari_dir(made.path, workers=2, info_keys=["qpos"])
    assert Transitions(**parallel.columns()).equals(Transitions(**serial.columns()))


def test_arrow_is_read_in_one_process(make_test_dataset, monkeypatch) -> None:
    """Arrow gains nothing from reader processes; a large Arrow dataset starts none."""
    made = make_test_dataset("hopper", "arrow")
    monkeypatch.setattr(minari_reader, "_PARALLEL_MIN_EPISODES", 2)

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("an Arrow read started reader processes")

    monkeypatch.setattr(minari_reader, "ProcessPoolExecutor", no_pool)
    read = read_minari_dir(made.path, workers=2, info_keys=["qpos"])
    assert read.num_episodes == made.episodes


def test_arrow_episode_files_under_other_names_or_schemas_read_the_same(
    make_test_dataset, tmp_path: Path
) -> None:
    """An episode file not named part-0.arrow is found by listing its folder, and an episode
    whose file holds a column more than the others is read by its columns."""
    import pyarrow as pa

    made = make_test_dataset("hopper", "arrow")
    expected = read_minari_dir(made.path, info_keys=["qpos"])
    copy = _copy_dataset(made, tmp_path)
    (copy / "data" / "2" / "part-0.arrow").rename(copy / "data" / "2" / "episode.arrow")
    wider = copy / "data" / "4" / "part-0.arrow"
    table = pa.ipc.open_file(pa.py_buffer(wider.read_bytes())).read_all()
    table = table.append_column("extra", pa.array(np.zeros(table.num_rows)))
    with pa.OSFile(str(wider), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    read = read_minari_dir(copy, info_keys=["qpos"])
    assert Transitions(**read.columns()).equals(Transitions(**expected.columns()))
    np.testing.assert_array_equal(read.extras["infos/qpos"], expected.extras["infos/qpos"])


def test_load_by_id_and_by_directory_agree(make_test_dataset) -> None:
    made = make_test_dataset("hopper", "hdf5")
    by_id = load_transitions(made.dataset_id, cache=False)
    by_dir = load_transitions(made.path, cache=False)
    by_data_dir = load_transitions(made.path / "data", cache=False)
    assert by_id.equals(by_dir) and by_dir.equals(by_data_dir)


def _copy_dataset(made, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(made.path, target)
    return target


def test_truncated_hdf5_file_names_the_file(make_test_dataset, tmp_path: Path) -> None:
    copy = _copy_dataset(make_test_dataset("hopper", "hdf5"), tmp_path)
    data_file = copy / "data" / "main_data.hdf5"
    with open(data_file, "r+b") as handle:
        handle.truncate(data_file.stat().st_size // 2)
    with pytest.raises(DataError, match=r"main_data\.hdf5"):
        read_minari_dir(copy)


def test_corrupted_arrow_file_names_the_file(make_test_dataset, tmp_path: Path) -> None:
    copy = _copy_dataset(make_test_dataset("hopper", "arrow"), tmp_path)
    episode_file = copy / "data" / "3" / "part-0.arrow"
    episode_file.write_bytes(episode_file.read_bytes()[:100])
    with pytest.raises(DataError, match=r"3/part-0\.arrow"):
        read_minari_dir(copy)


def test_arrow_file_without_its_footer_is_refused(make_test_dataset, tmp_path: Path) -> None:
    copy = _copy_dataset(make_test_dataset("hopper", "arrow"), tmp_path)
    episode_file = copy / "data" / "3" / "part-0.arrow"
    episode_file.write_bytes(episode_file.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"3/part-0\.arrow"):
        read_minari_dir(copy)


def test_missing_arrow_episode_is_reported(make_test_dataset, tmp_path: Path) -> None:
    copy = _copy_dataset(make_test_dataset("hopper", "arrow"), tmp_path)
    shutil.rmtree(copy / "data" / "5")
    with pytest.raises(DataError, match="episode 5"):
        read_minari_dir(copy)


def test_step_count_mismatch_with_metadata_is_reported(make_test_dataset, tmp_path: Path) -> None:
    copy = _copy_dataset(make_test_dataset("hopper", "hdf5"), tmp_path)
    metadata_file = copy / "data" / "metadata.json"
    metadata = json.loads(metadata_file.read_text())
    metadata["total_steps"] += 1
    metadata_file.write_text(json.dumps(metadata))
    with pytest.raises(DataError, match="total_steps"):
        read_minari_dir(copy)


def test_nan_observation_is_refused_with_its_field(make_test_dataset, tmp_path: Path) -> None:
    import h5py

    copy = _copy_dataset(make_test_dataset("hopper", "hdf5"), tmp_path)
    with h5py.File(copy / "data" / "main_data.hdf5", "r+") as handle:
        observations = handle["episode_2/observations"]
        values = observations[()]
        values[1, 3] = np.nan
        observations[...] = values
    with pytest.raises(DataError, match="observations"):
        read_minari_dir(copy)
    # inspect-style loading counts instead of refusing.
    loaded = read_minari_dir(copy, check_finite=False)
    assert np.isnan(loaded.observations).any()


def test_a_shape_larger_than_the_file_is_refused_before_allocating(
    make_test_dataset, tmp_path: Path
) -> None:
    """A corrupted shape header (the fuzz test found one declaring 4,294,967,307 rows) is a
    DataError naming the field, not a 32 GiB allocation."""
    import h5py

    copy = _copy_dataset(make_test_dataset("hopper", "hdf5"), tmp_path)
    with h5py.File(copy / "data" / "main_data.hdf5", "r+") as handle:
        del handle["episode_2/rewards"]
        # Chunked and never written: the shape is declared, the bytes are not in the file.
        handle.create_dataset("episode_2/rewards", shape=(2**32 + 11,), chunks=(1024,), dtype="f8")
    with pytest.raises(DataError, match=r"episode_2/rewards.*more than the .*-byte file"):
        read_minari_dir(copy)


def test_not_a_dataset_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not a Minari dataset"):
        read_minari_dir(tmp_path)


def test_parallel_read_from_an_unguarded_script_runs_its_top_level_once(
    make_test_dataset, tmp_path: Path
) -> None:
    """A plain script (no ``if __name__ == "__main__":``) that loads a large dataset works.

    Reader processes come from a forkserver, which would otherwise re-run the script's top
    level in each of them and break the pool.
    """
    import subprocess
    import sys

    made = make_test_dataset("hopper", "hdf5")
    script = tmp_path / "user_script.py"
    script.write_text(
        "import sys\n"
        "from offaug.datasets import minari_reader\n"
        "print('top level ran', flush=True)\n"
        "minari_reader._PARALLEL_MIN_EPISODES = 2\n"
        "data = minari_reader.read_minari_dir(sys.argv[1], workers=2)\n"
        "print('rows', len(data.rewards), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script), str(made.path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    serial = read_minari_dir(made.path, workers=1)
    assert done.stdout.splitlines() == ["top level ran", f"rows {len(serial.rewards)}"]
