"""The ``point_policies`` fixture: three trained BC checkpoints of known quality."""

from __future__ import annotations

import pytest

from tests.pipeline.point_policies import PointPolicies, train_point_policies


@pytest.fixture(scope="session")
def point_policies(make_test_dataset, tmp_path_factory: pytest.TempPathFactory) -> PointPolicies:
    root = tmp_path_factory.mktemp("point-policies")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OFFAUG_CACHE_DIR", str(root / "cache"))
        dataset_id = make_test_dataset("point", "hdf5").dataset_id
        return train_point_policies(dataset_id, root)
