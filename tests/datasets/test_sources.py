"""load_transitions: source resolution, the shard cache and its invalidation, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from offaug.datasets import DataError, DatasetNotFoundError, load_transitions, resolve_source
from offaug.datasets.shards import write_shard_set


def _entries(cache: Path) -> list[Path]:
    root = cache / "transitions"
    return sorted(root.iterdir()) if root.exists() else []


@pytest.mark.parametrize("data_format", ["hdf5", "arrow"])
def test_second_load_memory_maps_the_cache(
    make_test_dataset, offaug_cache: Path, data_format: str
) -> None:
    made = make_test_dataset("hopper", data_format)
    cold = load_transitions(made.dataset_id)
    assert cold.observations.flags.writeable  # freshly read
    assert len(_entries(offaug_cache)) == 1
    warm = load_transitions(made.dataset_id)
    assert not warm.observations.flags.writeable  # a memory map of the cache
    assert warm.equals(cold)
    assert warm.meta["dataset_id"] == made.dataset_id


def test_cache_dir_is_read_at_call_time(make_test_dataset, tmp_path: Path, monkeypatch) -> None:
    made = make_test_dataset("hopper", "hdf5")
    monkeypatch.setenv("OFFAUG_CACHE_DIR", str(tmp_path / "elsewhere"))
    load_transitions(made.dataset_id)
    assert _entries(tmp_path / "elsewhere")


def test_modified_source_gets_a_new_cache_entry(
    make_test_dataset, tmp_path: Path, offaug_cache: Path
) -> None:
    import h5py

    copy = tmp_path / "copy"
    shutil.copytree(make_test_dataset("hopper", "hdf5").path, copy)
    first = load_transitions(copy)
    time.sleep(0.01)  # a distinct modification time
    with h5py.File(copy / "data" / "main_data.hdf5", "r+") as handle:
        rewards = handle["episode_0/rewards"]
        rewards[0] = 123.0
    second = load_transitions(copy)
    assert second.rewards[0] == np.float32(123.0) != first.rewards[0]
    assert len(_entries(offaug_cache)) == 2


def test_corrupted_cache_entry_is_rebuilt(make_test_dataset, offaug_cache: Path) -> None:
    made = make_test_dataset("hopper", "hdf5")
    expected = load_transitions(made.dataset_id)
    (entry,) = _entries(offaug_cache)
    shard = next(entry.glob("*.arrow"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    shard.write_bytes(bytes(raw))
    again = load_transitions(made.dataset_id)
    assert again.equals(expected)
    assert load_transitions(made.dataset_id).equals(expected)  # the rebuilt entry is valid


def test_no_cache_reads_the_source_every_time(make_test_dataset, offaug_cache: Path) -> None:
    load_transitions(make_test_dataset("hopper", "hdf5").dataset_id, cache=False)
    assert not _entries(offaug_cache)


def test_unwritable_cache_does_not_stop_the_load(
    make_test_dataset, tmp_path: Path, monkeypatch
) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("OFFAUG_CACHE_DIR", str(blocker))
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    assert len(data) > 0


def test_missing_dataset_names_the_path_and_the_fetch_command(minari_root: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_transitions("nobody/nothing-v3")
    message = str(info.value)
    assert "MINARI_DATASETS_PATH" in message and str(minari_root) in message
    assert "--download" in message and "minari download nobody/nothing-v3" in message


def test_download_failure_is_clear_and_leaves_nothing(minari_root: Path, monkeypatch) -> None:
    # Hugging Face's client in offline mode fails at once, as it does without a network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetNotFoundError, match="could not download"):
        load_transitions("mujoco/hopper/medium-v0", download=True)
    assert not (minari_root / "mujoco" / "hopper" / "medium-v0").exists()


@pytest.mark.slow
def test_download_without_network_fails_clearly(minari_root: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(DatasetNotFoundError, match="could not download"):
        load_transitions("mujoco/hopper/medium-v0", download=True)
    assert not (minari_root / "mujoco" / "hopper" / "medium-v0").exists()


@pytest.mark.parametrize("bad_id", ["../escape-v0", "/abs/olute-v0", "ns/../../x-v0"])
def test_ids_cannot_escape_the_root(minari_root: Path, bad_id: str) -> None:
    with pytest.raises(DataError):
        resolve_source(bad_id)


def test_shard_set_directory_is_a_source(make_test_dataset, tmp_path: Path) -> None:
    data = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    write_shard_set(data, tmp_path / "set", rows_per_shard=300)
    assert resolve_source(tmp_path / "set").kind == "shards"
    assert load_transitions(tmp_path / "set").equals(data)


def test_other_files_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "data.csv"
    other.write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv"):
        load_transitions(other)


def test_arrow_cache_key_follows_minari_updates(make_test_dataset, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(make_test_dataset("hopper", "arrow").path, copy)
    first = load_transitions(copy)
    # Removing an episode the way Minari would (directory gone, metadata rewritten).
    shutil.rmtree(copy / "data" / str(first.num_episodes - 1))
    metadata_file = copy / "data" / "metadata.json"
    metadata = json.loads(metadata_file.read_text())
    last = first.episode_ids == first.num_episodes - 1
    metadata["total_episodes"] -= 1
    metadata["total_steps"] -= int(last.sum())
    metadata_file.write_text(json.dumps(metadata))
    os.utime(metadata_file)
    second = load_transitions(copy)
    assert len(second) == len(first) - int(last.sum())


def test_cache_written_by_inspect_still_refuses_nan(make_test_dataset, tmp_path: Path) -> None:
    import h5py

    copy = tmp_path / "copy"
    shutil.copytree(make_test_dataset("hopper", "hdf5").path, copy)
    with h5py.File(copy / "data" / "main_data.hdf5", "r+") as handle:
        rewards = handle["episode_1/rewards"]
        rewards[0] = np.nan
    counted = load_transitions(copy, check_finite=False)  # as `offaug inspect` loads
    assert np.isnan(counted.rewards).any()
    with pytest.raises(DataError, match="rewards"):
        load_transitions(copy)  # served from that cache entry, and still refused
