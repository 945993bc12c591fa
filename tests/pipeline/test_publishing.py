"""The ``publish`` stage publishes a run's data through the same publisher as ``offaug publish``."""

from __future__ import annotations

import pytest

from offaug.datasets import DataError, load_transitions, write_shard_set
from offaug.pipeline.contracts import AugmentedRef, DatasetRef
from offaug.pipeline.schema.run_sections import PublishModel
from offaug.pipeline.stages.publishing import publish_stage


def test_the_publish_stage_publishes_the_parts_include_asks_for(
    make_test_dataset, tmp_path
) -> None:
    made = make_test_dataset("cartpole", "hdf5")
    data = load_transitions(made.dataset_id, cache=False)
    ref = DatasetRef(made.dataset_id, len(data), data.num_episodes, "", False, dict(data.meta))
    first = data.slice(0, int(data.episode_bounds()[2]))
    shards = write_shard_set(first, tmp_path / "augmented")
    augmented = AugmentedRef(str(shards.directory), shards.rows, shards.episodes, 1, "", {}, 0)
    provenance = {"workflow": "w", "workflow_hash": "h"}

    both = PublishModel(dataset_id="stage/both-v0", root=str(tmp_path / "minari"))
    record = publish_stage(ref, augmented, both, provenance)
    assert record["include"] == "both"
    published = load_transitions(record["path"], cache=False)
    assert len(published) == len(data) + len(first)

    only = PublishModel(dataset_id="stage/only-v0", include="original", root=both.root)
    assert len(load_transitions(publish_stage(ref, None, only, provenance)["path"])) == len(data)
    wanted = PublishModel(dataset_id="stage/none-v0", include="augmented", root=both.root)
    with pytest.raises(DataError, match="no augmented data"):
        publish_stage(ref, None, wanted, provenance)
