"""The ``hopper`` fixture: the hopper test dataset, its record and untrained checkpoints."""

from __future__ import annotations

import pytest

from offaug.algorithms import registry
from offaug.datasets import load_transitions
from offaug.pipeline.contracts import DatasetRef
from tests.pipeline.diagnostics.helpers import Hopper, checkpoint


@pytest.fixture(scope="package")
def hopper(make_test_dataset, tmp_path_factory: pytest.TempPathFactory) -> Hopper:
    root = tmp_path_factory.mktemp("diagnostics")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFAUG_CACHE_DIR", str(root / "cache"))
        dataset_id = make_test_dataset("hopper", "hdf5").dataset_id
        data = load_transitions(dataset_id)
    ref = DatasetRef(
        source=dataset_id,
        rows=len(data),
        episodes=data.num_episodes,
        identity="test",
        has_simulator_state=False,
        meta=dict(data.meta),
    )
    bc = checkpoint(
        "bc", data, root / "bc" / "checkpoint.pt", {"policy": "gaussian", "hidden": (32, 32)}
    )
    critic = None
    if "cql" in registry.available():
        critic = checkpoint(
            "cql", data, root / "cql-original" / "checkpoint.pt", {"hidden": (32, 32)}
        )
    return Hopper(data, ref, bc, critic, root)
