"""Shards: exact round trips, zero-copy memory maps, checksums and atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from offaug.datasets import (
    ChecksumError,
    DataError,
    ShardSet,
    Transitions,
    read_shard,
    write_shard,
    write_shard_set,
)
from offaug.datasets import shards as shards_module
from offaug.datasets.minari_reader import read_minari_dir


def _augmented(n: int = 60, seed: int = 0) -> Transitions:
    rng = np.random.default_rng(seed)
    episode_ids = np.repeat(np.arange(6), 10).astype(np.int64)[:n]
    ends = np.r_[np.diff(episode_ids) != 0, True]
    return Transitions(
        observations=rng.normal(size=(n, 4, 3)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(n, 2)).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32),
        next_observations=rng.normal(size=(n, 4, 3)).astype(np.float32),
        terminals=ends & (rng.uniform(size=n) < 0.5),
        timeouts=ends & (rng.uniform(size=n) >= 0.5),
        episode_ids=episode_ids,
        rollout_log_prob=rng.normal(size=n).astype(np.float32),
        behaviour_log_prob=rng.normal(size=n).astype(np.float32),
        importance_weight=rng.uniform(size=n).astype(np.float32),
        source=np.full(n, 1, dtype=np.int8),
        extras={"infos/qpos": rng.normal(size=(n, 6))},
        meta={"env_id": "Hopper-v5", "noise": {"kind": "gaussian", "sigma": 0.1}},
    )


def test_round_trip_with_every_column(tmp_path: Path) -> None:
    data = _augmented()
    ref = write_shard(data, tmp_path / "a.arrow")
    back = read_shard(ref.path, checksum=ref.checksum)
    assert back.equals(data)
    assert back.meta == data.meta
    assert ref.rows == 60 and ref.episodes == 6
    assert "extra:infos/qpos" in ref.columns


def test_read_is_a_zero_copy_read_only_memory_map(tmp_path: Path) -> None:
    ref = write_shard(_augmented(), tmp_path / "a.arrow")
    back = read_shard(ref.path)
    for name, column in back.columns().items():
        assert not column.flags.writeable, name
        assert not column.flags.owndata, name
    with pytest.raises(ValueError):
        back.rewards[0] = 1.0


def test_real_dataset_round_trip_through_a_shard_set(make_test_dataset, tmp_path: Path) -> None:
    data = read_minari_dir(make_test_dataset("hopper", "hdf5").path)
    shard_set = write_shard_set(data, tmp_path / "set", rows_per_shard=200, source={"id": "x"})
    assert len(shard_set.shards) > 1
    assert sum(s.rows for s in shard_set.shards) == len(data)
    reopened = ShardSet.open(tmp_path / "set")
    assert reopened.load().equals(data)
    # Episodes never span two shards.
    seen: set[int] = set()
    for part in reopened.iter_shards():
        ids = set(np.unique(part.episode_ids).tolist())
        assert not ids & seen
        seen |= ids


def test_manifest_records_schema_rows_checksums_and_provenance(tmp_path: Path) -> None:
    write_shard_set(
        _augmented(), tmp_path / "set", rows_per_shard=25, source={"id": "a"}, params={"k": 1}
    )
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert manifest["schema_version"] == shards_module.SCHEMA_VERSION
    assert manifest["checksum_algorithm"] == "xxh3_128"
    assert manifest["rows"] == 60
    assert manifest["source"] == {"id": "a"} and manifest["params"] == {"k": 1}
    for entry in manifest["shards"]:
        assert not os.path.isabs(entry["path"])
        assert len(entry["checksum"]) == 32


def test_flipped_byte_is_caught_naming_the_file(tmp_path: Path) -> None:
    shard_set = write_shard_set(_augmented(), tmp_path / "set", rows_per_shard=25)
    victim = Path(shard_set.shards[1].path)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=victim.name):
        shard_set.load()
    bad = shard_set.verify()
    assert [Path(ref.path).name for ref, _ in bad] == [victim.name]


def test_truncated_shard_without_manifest_is_a_data_error(tmp_path: Path) -> None:
    ref = write_shard(_augmented(), tmp_path / "a.arrow")
    path = Path(ref.path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match=r"a\.arrow"):
        read_shard(path, verify=False)


def test_failed_write_leaves_nothing_under_the_final_name(tmp_path: Path, monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(shards_module, "file_checksum", broken)
    with pytest.raises(OSError, match="disk full"):
        write_shard_set(_augmented(), tmp_path / "set", rows_per_shard=25)
    assert list(tmp_path.iterdir()) == []


def test_existing_set_is_refused_then_replaced_with_overwrite(tmp_path: Path) -> None:
    write_shard_set(_augmented(seed=1), tmp_path / "set")
    with pytest.raises(FileExistsError):
        write_shard_set(_augmented(seed=2), tmp_path / "set")
    replaced = write_shard_set(_augmented(seed=2), tmp_path / "set", overwrite=True)
    assert replaced.load().equals(_augmented(seed=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def test_manifest_row_count_disagreeing_with_file_is_reported(tmp_path: Path) -> None:
    write_shard_set(_augmented(), tmp_path / "set")
    manifest_path = tmp_path / "set" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"][0]["rows"] = 59
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="manifest says 59"):
        ShardSet.open(tmp_path / "set").load()


def test_directory_without_manifest_is_not_a_shard_set(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="manifest"):
        ShardSet.open(tmp_path)


def test_empty_transitions_round_trip(tmp_path: Path) -> None:
    empty = _augmented().slice(0, 0)
    ref = write_shard(empty, tmp_path / "empty.arrow")
    assert read_shard(ref.path, checksum=ref.checksum).equals(empty)


def test_independently_written_shards_are_renumbered_on_load(tmp_path: Path) -> None:
    from offaug.datasets.shards import ShardSet as Set

    a = write_shard(_augmented(seed=1), tmp_path / "a.arrow")
    b = write_shard(_augmented(seed=2), tmp_path / "b.arrow")
    shard_set = Set(str(tmp_path), (a, b), {}, {}, {})
    shard_set.write_manifest()
    loaded = Set.open(tmp_path).load()
    assert loaded.num_episodes == 12
    assert np.all(np.diff(loaded.episode_ids) >= 0)
