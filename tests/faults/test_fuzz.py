"""Property-based fuzzing: readers and the workflow loader raise only their documented errors.

Hypothesis feeds the workflow loader arbitrary YAML documents and mutated valid workflows, the
D4RL reader arbitrary arrays and corrupted bytes, and the Minari/shard readers files with random
bytes overwritten. Anything but ``WorkflowError`` / ``DataError`` (or a successful read) fails.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import h5py
import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offaug.datasets import DataError, load_transitions, read_shard, write_shard
from offaug.datasets.d4rl_reader import read_d4rl_hdf5
from offaug.datasets.minari_reader import read_minari_dir
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_subnormal=False),
    st.text(max_size=12),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)

VALID = {
    "name": "fuzz",
    "source": {"dataset": "a/b-v0"},
    "rollout": {"episodes": 10, "tasks": 2, "noise": "gaussian:0.1"},
    "train": {"algorithms": ["cql"], "steps": 10},
}


@SETTINGS
@given(document=documents)
def test_workflow_loader_on_arbitrary_documents(tmp_path_factory, document: object) -> None:
    path = tmp_path_factory.mktemp("wf") / "wf.yaml"
    path.write_text(yaml.safe_dump(document))
    with contextlib.suppress(WorkflowError):
        load_workflow(path)


@SETTINGS
@given(section=st.sampled_from(sorted(VALID)), key=st.text(min_size=1, max_size=8), value=scalars)
def test_workflow_loader_on_mutated_workflows(
    tmp_path_factory, section: str, key: str, value: object
) -> None:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in VALID.items()}
    if isinstance(data[section], dict):
        data[section][key] = value
    else:
        data[section] = value
    path = tmp_path_factory.mktemp("wf") / "wf.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_workflow(path)
    except WorkflowError as exc:
        assert "wf.yaml" in str(exc)


@SETTINGS
@given(
    rows=st.integers(0, 30),
    obs_dim=st.integers(1, 4),
    drop=st.sampled_from([None, "actions", "rewards", "terminals", "observations"]),
    mismatch=st.booleans(),
    with_timeouts=st.booleans(),
    nan=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_d4rl_reader_on_arbitrary_arrays(
    tmp_path_factory,
    rows: int,
    obs_dim: int,
    drop: str | None,
    mismatch: bool,
    with_timeouts: bool,
    nan: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    arrays = {
        "observations": rng.normal(size=(rows, obs_dim)),
        "actions": rng.normal(size=(rows, 2)),
        "rewards": rng.normal(size=rows),
        "terminals": rng.uniform(size=rows) < 0.1,
    }
    if with_timeouts:
        arrays["timeouts"] = rng.uniform(size=rows) < 0.1
    if mismatch and rows:
        arrays["actions"] = arrays["actions"][:-1]
    if nan and rows:
        arrays["rewards"][0] = np.nan
    if drop is not None:
        arrays.pop(drop)
    path = tmp_path_factory.mktemp("d4rl") / "file.hdf5"
    with h5py.File(path, "w") as handle:
        for key, value in arrays.items():
            handle.create_dataset(key, data=value)
    try:
        data = read_d4rl_hdf5(path)
    except DataError as exc:
        assert "file.hdf5" in str(exc)
        return
    for episode in data.iter_episodes():
        assert episode.terminals[-1] or episode.timeouts[-1] or episode is None


def _corrupt(path: Path, data: st.DataObject) -> None:
    raw = bytearray(path.read_bytes())
    count = data.draw(st.integers(1, 8))
    for _ in range(count):
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))


@SETTINGS
@given(data=st.data(), data_format=st.sampled_from(["hdf5", "arrow"]))
def test_minari_reader_on_corrupted_files(
    make_test_dataset, tmp_path_factory, data: st.DataObject, data_format: str
) -> None:
    source = make_test_dataset("cartpole", data_format).path
    copy = tmp_path_factory.mktemp("minari") / "copy"
    shutil.copytree(source, copy)
    files = sorted(p for p in (copy / "data").rglob("*") if p.is_file())
    _corrupt(data.draw(st.sampled_from(files)), data)
    with contextlib.suppress(DataError):
        read_minari_dir(copy)


@SETTINGS
@given(data=st.data())
def test_shard_reader_on_corrupted_files(
    make_test_dataset, tmp_path_factory, data: st.DataObject
) -> None:
    transitions = load_transitions(make_test_dataset("cartpole", "hdf5").dataset_id).slice(0, 40)
    path = tmp_path_factory.mktemp("shard") / "s.arrow"
    ref = write_shard(transitions, path)
    _corrupt(path, data)
    with contextlib.suppress(DataError):
        read_shard(path, checksum=ref.checksum)
    with contextlib.suppress(DataError):
        read_shard(path, verify=False)
