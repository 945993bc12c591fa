"""The run directory's reader: stage records decode to their types, or name what is missing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from offaug.datasets import DataError
from offaug.datasets.shards import ShardRef
from offaug.pipeline.contracts import DatasetRef, FilterRecord, ModelRef, RolloutShard
from offaug.pipeline.rundir.files import StageRecords, read_stage_records
from offaug.pipeline.rundir.run_layout import RunLayout


def test_stage_records_decode_to_their_types(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    source = DatasetRef("a/b-v0", 10, 2, "id", True, {"format": "hdf5"})
    model = ModelRef("bc", str(tmp_path / "bc.pt"), "x", {"train": {}})
    records = StageRecords(layout)
    records.record("source", "k1", source, 1.0, None, [])
    records.record("train:bc-plain", "k2", model, 2.0, "tcp://w", ["source"])
    read = read_stage_records(tmp_path)
    assert read.result("source", DatasetRef) == source
    assert read.results("train:", ModelRef) == [model]
    assert "source" in read and "rollout" not in read
    with pytest.raises(DataError, match="no finished 'rollout' stage"):
        read.result("rollout", ModelRef)
    with pytest.raises(DataError, match="not a ModelRef"):
        read.result("source", ModelRef)
    with pytest.raises(FileNotFoundError, match=r"stages\.json"):
        read_stage_records(tmp_path / "elsewhere")


def test_a_rollout_shards_filter_record_round_trips(tmp_path: Path) -> None:
    record = FilterRecord((1.0, 2.0), (0.5, float("nan")), (True, False), (3, 4), (-1, 7))
    shard = RolloutShard(ShardRef("s.arrow", 5, 1, "c", 1, ("rewards",)), {}, 0, (1.0,), 1, record)
    records = StageRecords(RunLayout(tmp_path))
    records.record("rollout:0", "k", shard, 1.0, None, [])
    read = read_stage_records(tmp_path).result("rollout:0", RolloutShard).filter_record
    assert isinstance(read, FilterRecord)
    assert read.kept == (True, False) and read.start_rows == (-1, 7)
    assert read.references[0] == 0.5 and math.isnan(read.references[1])
