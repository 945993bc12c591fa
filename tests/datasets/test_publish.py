"""Published datasets are Minari datasets: Minari reads them as it reads its own, offaug reads
them back unchanged, and nothing half-written ever appears under a dataset's name."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import minari
import numpy as np
import pyarrow as pa
import pytest
from minari.data_collector import EpisodeBuffer
from minari.serialization import serialize_space

import offaug.datasets.storage.hdf5 as hdf5_storage
from offaug.datasets import DataError, Source, Transitions, load_transitions, write_shard_set
from offaug.datasets.publish import (
    CARD_NAME,
    CHECKSUMS_NAME,
    METADATA_KEY,
    load_published,
    publish_dataset,
    verify_published,
)

FORMATS = ["hdf5", "arrow"]
KINDS = ["hopper", "point", "cartpole"]
STEP_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")
_ids = itertools.count()


@pytest.fixture
def fresh_id() -> str:
    """A dataset id no other test uses (the Minari root lives for the whole session)."""
    return f"published/ds{next(_ids)}-v0"


def _leaves(observations: Any) -> dict[str, np.ndarray]:
    if isinstance(observations, dict):
        return {k: np.asarray(v) for k, v in observations.items()}
    return {"": np.asarray(observations)}


def _assert_same_array(published: np.ndarray, original: np.ndarray, what: str) -> None:
    """Same dtype, and the same values once the original went through offaug's float32."""
    assert published.dtype == original.dtype, what
    expected = original
    if original.dtype.kind == "f":
        expected = original.astype(np.float32).astype(original.dtype)
    np.testing.assert_array_equal(published, expected, err_msg=what)


def _assert_same_episodes(published: minari.MinariDataset, original: minari.MinariDataset) -> None:
    assert published.total_episodes == original.total_episodes
    assert published.total_steps == original.total_steps
    pairs = zip(published.iterate_episodes(), original.iterate_episodes(), strict=True)
    for mine, theirs in pairs:
        assert mine.id == theirs.id
        for key in STEP_KEYS:
            mine_leaves, their_leaves = _leaves(getattr(mine, key)), _leaves(getattr(theirs, key))
            assert mine_leaves.keys() == their_leaves.keys()
            for leaf, values in mine_leaves.items():
                _assert_same_array(values, their_leaves[leaf], f"episode {mine.id} {key} {leaf}")


def _augmented(transitions: Transitions, seed: int = 0) -> Transitions:
    n = len(transitions)
    rng = np.random.default_rng(seed)
    return transitions.with_columns(
        rollout_log_prob=rng.normal(size=n).astype(np.float32),
        behaviour_log_prob=rng.normal(size=n).astype(np.float32),
        importance_weight=rng.uniform(0.1, 3.0, size=n).astype(np.float32),
        source=np.full(n, Source.SIMULATOR, dtype=np.int8),
    )


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_minari_reads_what_it_would_have_written(
    make_test_dataset, fresh_id: str, kind: str, data_format: str
) -> None:
    made = make_test_dataset(kind, "hdf5")
    original = load_transitions(made.path, cache=False)
    published = publish_dataset([original], fresh_id, data_format=data_format)
    assert (published.episodes, published.steps) == (made.episodes, made.steps)

    dataset = minari.load_dataset(fresh_id)
    _assert_same_episodes(dataset, minari.load_dataset(made.dataset_id))
    assert dataset.spec.env_spec == minari.load_dataset(made.dataset_id).spec.env_spec
    assert load_transitions(fresh_id, cache=False).equals(original)


@pytest.mark.parametrize("data_format", FORMATS)
def test_hdf5_and_arrow_layouts_equal_minaris(
    make_test_dataset, fresh_id: str, data_format: str
) -> None:
    made = make_test_dataset("hopper", data_format)
    # With the simulator state as extras, every object Minari wrote has a counterpart.
    original = load_transitions(made.path, cache=False, info_keys=["qpos", "qvel"])
    published = publish_dataset([original], fresh_id, data_format=data_format)
    theirs, mine = made.path / "data", published.data_dir
    if data_format == "hdf5":
        assert _hdf5_layout(mine / "main_data.hdf5") == _hdf5_layout(theirs / "main_data.hdf5")
    else:
        for episode in range(made.episodes):
            their_schema = pa.ipc.open_file(theirs / str(episode) / "part-0.arrow").schema
            my_schema = pa.ipc.open_file(mine / str(episode) / "part-0.arrow").schema
            assert my_schema.equals(their_schema, check_metadata=True)
            their_meta = json.loads((theirs / str(episode) / "metadata.json").read_text())
            their_meta.pop("seed")  # the seed of a reset is not part of offaug's transitions
            assert json.loads((mine / str(episode) / "metadata.json").read_text()) == their_meta
    # Minari's metadata keys, in Minari's order, minus what only the collector knew.
    their_keys = list(json.loads((theirs / "metadata.json").read_text()))
    my_keys = list(json.loads((mine / "metadata.json").read_text()))
    for only_theirs in ("code_permalink", "author", "author_email", "algorithm_name"):
        their_keys.remove(only_theirs)
    their_keys.remove("description")
    their_keys.remove("num_episodes_average_score")
    my_keys.remove(METADATA_KEY)
    assert my_keys == their_keys


def test_hdf5_built_in_memory_or_on_disk_is_the_same_dataset(
    make_test_dataset, fresh_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small files are built by HDF5's core driver; larger ones directly on disk. Same result."""
    made = make_test_dataset("hopper", "hdf5")
    original = load_transitions(made.path, cache=False, info_keys=["qpos", "qvel"])
    in_memory = publish_dataset([original], fresh_id, data_format="hdf5")
    monkeypatch.setattr(hdf5_storage, "IN_MEMORY_BYTES", 0)
    on_disk = publish_dataset([original], f"{fresh_id[:-3]}-disk-v0", data_format="hdf5")
    mine, theirs = (p.data_dir / "main_data.hdf5" for p in (in_memory, on_disk))
    assert _hdf5_layout(mine) == _hdf5_layout(theirs)
    with h5py.File(mine, "r") as a, h5py.File(theirs, "r") as b:
        for name in ("episode_0/observations", "episode_3/infos/qvel", "episode_5/actions"):
            np.testing.assert_array_equal(a[name][()], b[name][()])
    for published in (in_memory, on_disk):
        assert load_transitions(published.path, cache=False).equals(
            load_transitions(made.path, cache=False)
        )


def _hdf5_layout(path: Path) -> dict[str, Any]:
    layout: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            layout[name] = (obj.shape, obj.dtype, obj.chunks, obj.maxshape, obj.compression)
        else:
            attrs = {k: v for k, v in obj.attrs.items() if k != "seed"}
            layout[name] = (type(obj).__name__, attrs)

    with h5py.File(path, "r") as handle:
        handle.visititems(visit)
    return layout


@pytest.mark.parametrize("data_format", FORMATS)
def test_augmented_columns_come_back_through_step_infos(
    make_test_dataset, fresh_id: str, data_format: str
) -> None:
    made = make_test_dataset("hopper", "hdf5")
    augmented = _augmented(load_transitions(made.path, cache=False, info_keys=["qpos"]))
    publish_dataset(
        [augmented], fresh_id, data_format=data_format, provenance={"workflow_hash": "abc123"}
    )

    # Minari: N+1 rows per episode, row t is transition t, the last row is padding.
    bounds = augmented.episode_bounds()
    for episode, (start, stop) in zip(
        minari.load_dataset(fresh_id).iterate_episodes(), itertools.pairwise(bounds), strict=True
    ):
        infos = episode.infos
        assert set(infos) == {
            "rollout_log_prob",
            "behaviour_log_prob",
            "importance_weight",
            "source",
            "qpos",
        }
        for name in ("rollout_log_prob", "behaviour_log_prob", "importance_weight", "source"):
            column = getattr(augmented, name)
            assert infos[name].shape == (stop - start + 1,)
            np.testing.assert_array_equal(infos[name][:-1], column[start:stop])
        assert np.isnan(infos["importance_weight"][-1]) and infos["source"][-1] == -1
        np.testing.assert_array_equal(
            infos["qpos"][:-1], augmented.extras["infos/qpos"][start:stop]
        )

    # offaug: exactly the published transitions, optional columns and extras included.
    assert load_published(fresh_id, cache=False).equals(augmented)
    with_infos = load_transitions(fresh_id, cache=False, info_keys=["importance_weight"])
    np.testing.assert_array_equal(
        with_infos.extras["infos/importance_weight"], augmented.importance_weight
    )


@pytest.mark.parametrize("data_format", FORMATS)
def test_original_and_augmented_shard_sets_together(
    make_test_dataset, fresh_id: str, tmp_path: Path, data_format: str
) -> None:
    original = load_transitions(make_test_dataset("hopper", "hdf5").path, cache=False)
    augmented = _augmented(original.slice(0, int(original.episode_bounds()[10])), seed=1)
    shard_set = write_shard_set(
        augmented, tmp_path / "augmented", rows_per_shard=50, source={"id": "aug"}
    )
    assert len(shard_set.shards) > 1
    published = publish_dataset(
        [original, shard_set],
        fresh_id,
        data_format=data_format,
        provenance={"source": "test/hopper", "source_checksum": "0" * 32, "noise": {"std": 0.1}},
        card="Made by the publishing test.",
    )
    assert published.episodes == original.num_episodes + augmented.num_episodes
    assert published.steps == len(original) + len(augmented)

    back = load_published(fresh_id, cache=False)
    n = len(original)
    # The original part lacks the optional columns: its rows get the documented fills.
    assert back.importance_weight is not None and back.source is not None
    assert back.rollout_log_prob is not None
    np.testing.assert_array_equal(back.importance_weight[:n], 1.0)
    np.testing.assert_array_equal(back.source[:n], -1)
    assert np.isnan(back.rollout_log_prob[:n]).all()
    np.testing.assert_array_equal(back.importance_weight[n:], augmented.importance_weight)
    np.testing.assert_array_equal(back.source[n:], augmented.source)
    np.testing.assert_array_equal(back.observations[n:], augmented.observations)
    np.testing.assert_array_equal(back.next_observations[:n], original.next_observations)

    weights = augmented.importance_weight.astype(np.float64)
    ess = weights.sum() ** 2 / np.square(weights).sum()
    metadata = json.loads((published.data_dir / "metadata.json").read_text())
    summary = metadata[METADATA_KEY]["importance_weights"]
    assert summary["rows"] == len(augmented)
    assert summary["effective_sample_size"] == pytest.approx(ess)
    assert summary["ess_fraction"] == pytest.approx(ess / len(augmented))
    assert metadata[METADATA_KEY]["provenance"]["source_checksum"] == "0" * 32
    assert "offaug_version" in metadata[METADATA_KEY]["provenance"]
    assert [p["kind"] for p in metadata[METADATA_KEY]["parts"]] == ["transitions", "shard_set"]

    card = (Path(published.path) / CARD_NAME).read_text()
    assert f"{ess:.6g}" in card and "ESS / N" in card
    assert "source_checksum" in card and '"std": 0.1' in card
    assert "simulator: " in card and "Made by the publishing test." in card


def test_shard_sets_and_transitions_publish_the_same_bytes(
    make_test_dataset, fresh_id: str, tmp_path: Path
) -> None:
    original = load_transitions(make_test_dataset("cartpole", "hdf5").path, cache=False)
    shard_set = write_shard_set(original, tmp_path / "set", rows_per_shard=40)
    from_memory = publish_dataset([original], fresh_id)
    from_shards = publish_dataset([shard_set], fresh_id.replace("-v0", "-shards-v0"))
    checksums = [
        json.loads((Path(p.path) / CHECKSUMS_NAME).read_text())["files"]
        for p in (from_memory, from_shards)
    ]
    assert checksums[0]["data/main_data.hdf5"] == checksums[1]["data/main_data.hdf5"]


def test_minari_cli_shows_it(make_test_dataset, fresh_id: str, minari_root: Path) -> None:
    original = load_transitions(make_test_dataset("hopper", "hdf5").path, cache=False)
    publish_dataset([original], fresh_id, description="published by the CLI test")
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "minari"), "show", fresh_id],
        env={**os.environ, "MINARI_DATASETS_PATH": str(minari_root), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert fresh_id in shown.stdout and "published by the CLI test" in shown.stdout
    assert "Hopper-v5" in shown.stdout


def test_recover_environment_and_append_with_minari(make_test_dataset, fresh_id: str) -> None:
    original = load_transitions(make_test_dataset("hopper", "hdf5").path, cache=False)
    for data_format in FORMATS:
        dataset_id = fresh_id.replace("-v0", f"-{data_format}-v0")
        publish_dataset([original], dataset_id, data_format=data_format)
        dataset = minari.load_dataset(dataset_id)
        env = dataset.recover_environment()
        try:
            assert env.spec is not None and env.spec.id == "Hopper-v5"
            observation, _ = env.reset(seed=0)
            assert dataset.observation_space.contains(observation)
        finally:
            env.close()
        # Minari can keep writing to it: the datasets are resizable, the totals consistent.
        extra = next(minari.load_dataset(dataset_id).iterate_episodes())
        dataset.update_dataset_from_buffer(
            [
                EpisodeBuffer(
                    observations=extra.observations,
                    actions=extra.actions,
                    rewards=extra.rewards,
                    terminations=extra.terminations,
                    truncations=extra.truncations,
                )
            ]
        )
        reloaded = minari.load_dataset(dataset_id)
        assert reloaded.total_episodes == original.num_episodes + 1
        assert reloaded.total_steps == len(original) + len(extra)
        last = next(iter(reloaded.iterate_episodes([reloaded.total_episodes - 1])))
        np.testing.assert_array_equal(last.observations, extra.observations)


def test_existing_id_is_refused_and_overwrite_replaces(
    make_test_dataset, fresh_id: str, minari_root: Path
) -> None:
    original = load_transitions(make_test_dataset("cartpole", "hdf5").path, cache=False)
    first = publish_dataset([original], fresh_id)
    with pytest.raises(FileExistsError):
        publish_dataset([original], fresh_id)
    smaller = original.slice(0, int(original.episode_bounds()[3]))
    second = publish_dataset([smaller], fresh_id, data_format="arrow", overwrite=True)
    assert second.path == first.path and second.episodes == 3
    assert minari.load_dataset(fresh_id).total_episodes == 3
    assert not (Path(second.path) / "data" / "main_data.hdf5").exists()
    assert verify_published(fresh_id) == []
    assert _hidden_leftovers(minari_root / "published") == []


def _hidden_leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("data_format", FORMATS)
def test_failure_mid_write_leaves_nothing_and_keeps_the_old_dataset(
    make_test_dataset, fresh_id: str, minari_root: Path, data_format: str
) -> None:
    original = load_transitions(make_test_dataset("cartpole", "hdf5").path, cache=False)
    # The second part has the wrong action rank: it fails after the first part is on disk.
    broken = original.slice(0, 30)
    broken = Transitions(
        **{**broken.columns(), "actions": np.zeros((30, 2), dtype=np.float32)}, meta=broken.meta
    )
    with pytest.raises(DataError, match="actions"):
        publish_dataset([original, broken], fresh_id, data_format=data_format)
    assert not (minari_root / fresh_id).exists()
    assert _hidden_leftovers(minari_root / "published") == []

    kept = publish_dataset([original], fresh_id, data_format=data_format)
    with pytest.raises(DataError, match="actions"):
        publish_dataset([original, broken], fresh_id, data_format=data_format, overwrite=True)
    assert verify_published(fresh_id) == []
    assert load_transitions(kept.path, cache=False).equals(original)
    assert _hidden_leftovers(minari_root / "published") == []


def test_checksums_catch_changed_missing_and_extra_files(make_test_dataset, fresh_id: str) -> None:
    original = load_transitions(make_test_dataset("cartpole", "hdf5").path, cache=False)
    published = Path(publish_dataset([original], fresh_id, data_format="arrow").path)
    assert verify_published(published) == []
    with open(published / "data" / "0" / "part-0.arrow", "r+b") as handle:
        handle.seek(-20, os.SEEK_END)
        handle.write(b"\xff")
    (published / "data" / "1" / "metadata.json").unlink()
    (published / "notes.txt").write_text("hello")
    assert sorted(verify_published(published)) == [
        ("data/0/part-0.arrow", "checksum mismatch"),
        ("data/1/metadata.json", "missing"),
        ("notes.txt", "not listed in checksums.json"),
    ]


@pytest.mark.parametrize("data_format", FORMATS)
def test_discrete_observations_and_actions(fresh_id: str, data_format: str) -> None:
    # FrozenLake's spaces, with 3 short episodes of different lengths.
    lengths = [3, 1, 4]
    states = [np.array(s, dtype=np.int64) for s in ([0, 1, 5, 6], [2, 3], [7, 8, 9, 10, 11])]
    transitions = Transitions(
        observations=np.concatenate([s[:-1] for s in states]),
        actions=np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int64),
        rewards=np.arange(8, dtype=np.float32) / 4,
        next_observations=np.concatenate([s[1:] for s in states]),
        terminals=np.array([0, 0, 1, 1, 0, 0, 0, 0], dtype=bool),
        timeouts=np.array([0, 0, 0, 0, 0, 0, 0, 1], dtype=bool),
        episode_ids=np.repeat(np.arange(3), lengths).astype(np.int64),
        meta={
            "observation_space": serialize_space(gym.spaces.Discrete(16)),
            "action_space": serialize_space(gym.spaces.Discrete(4)),
        },
    )
    publish_dataset([transitions], fresh_id, data_format=data_format)
    episodes = list(minari.load_dataset(fresh_id).iterate_episodes())
    for episode, stored in zip(episodes, states, strict=True):
        np.testing.assert_array_equal(episode.observations, stored)
    assert load_transitions(fresh_id, cache=False).equals(transitions)


def test_refuses_what_minari_cannot_hold(make_test_dataset, fresh_id: str) -> None:
    original = load_transitions(make_test_dataset("cartpole", "hdf5").path, cache=False)
    for bad_id in ("../escape-v0", "published/no-version", "/abs/olute-v0"):
        with pytest.raises(DataError, match="dataset_id"):
            publish_dataset([original], bad_id)

    # A next observation that is not the following row's observation inside an episode.
    shifted = original.next_observations.copy()
    shifted[2] += 1.0
    with pytest.raises(DataError, match=r"next_observations\[2\]"):
        publish_dataset([original.with_columns(next_observations=shifted)], fresh_id)

    renamed = Transitions(
        **original.columns(), extras={"qpos": original.observations}, meta=original.meta
    )
    # An extra that is not named infos/KEY cannot be a step info: it is left out, not written.
    published = publish_dataset([renamed], fresh_id)
    assert "qpos" not in load_published(published.path).extras
    shutil.rmtree(published.path)

    with pytest.raises(DataError, match="no observation/action space"):
        publish_dataset([Transitions(**original.columns())], fresh_id)

    # A Box(int64) space cannot hold fractional observations.
    integer_box = serialize_space(gym.spaces.Box(-10, 10, shape=(4,), dtype=np.int64))
    with pytest.raises(DataError, match="dtype"):
        publish_dataset([original], fresh_id, observation_space=integer_box)
    assert not (Path(os.environ["MINARI_DATASETS_PATH"]) / fresh_id).exists()


def test_d3rlpy_trains_on_a_published_dataset_through_the_recipe(
    make_test_dataset, fresh_id: str
) -> None:
    import d3rlpy

    from offaug.datasets.interop import to_d3rlpy

    original = load_transitions(make_test_dataset("hopper", "hdf5").dataset_id)
    publish_dataset([original], fresh_id)
    published = load_transitions(fresh_id)
    dataset = to_d3rlpy(published)
    assert dataset.transition_count == len(published)
    batch = dataset.sample_transition_batch(64)
    assert batch.observations.shape == (64, published.observations.shape[1])
    cql = d3rlpy.algos.CQLConfig(
        batch_size=32,
        actor_encoder_factory=d3rlpy.models.VectorEncoderFactory([16]),
        critic_encoder_factory=d3rlpy.models.VectorEncoderFactory([16]),
    ).create(device="cpu:0")
    cql.fit(
        dataset,
        n_steps=5,
        n_steps_per_epoch=5,
        show_progress=False,
        save_interval=10**9,
        logger_adapter=d3rlpy.logging.NoopAdapterFactory(),
    )
    assert cql.predict(published.observations[:3]).shape == (3, 3)
