"""The weighted ranking metric: parsing, normalising, refusing bad terms, and the workflow field."""

from __future__ import annotations

from pathlib import Path

import pytest

from offaug.pipeline.schema.rank_metric import (
    MetricTerm,
    RankMetric,
    RankMetricError,
    parse_rank_metric,
)
from offaug.pipeline.schema.validation import WorkflowError
from offaug.pipeline.schema.workflow import load_workflow


def test_weights_are_normalised_and_directions_kept() -> None:
    metric = parse_rank_metric("return:6, success:3,-length:1")
    assert metric == RankMetric(
        (
            MetricTerm("return", 0.6),
            MetricTerm("success", 0.3),
            MetricTerm("length", 0.1, higher_is_better=False),
        )
    )
    assert str(metric) == "return:0.6,success:0.3,-length:0.1"
    assert str(parse_rank_metric(str(metric))) == str(metric)
    assert parse_rank_metric("length:2").terms == (MetricTerm("length", 1.0),)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("retrun:1", "'retrun'"),
        ("return", "'return'"),
        ("return:abc", "'abc'"),
        ("return:-1", "'return:-1'"),
        ("return:inf", "'return:inf'"),
        ("return:1,return:2", "named twice"),
        ("return:0,success:0", "positive"),
        ("", "NAME:WEIGHT"),
        ("return:1,", "NAME:WEIGHT"),
    ],
)
def test_bad_metrics_are_refused_naming_the_term(text: str, named: str) -> None:
    with pytest.raises(RankMetricError) as caught:
        parse_rank_metric(text)
    assert named in str(caught.value)


def test_unknown_metric_lists_the_allowed_names() -> None:
    with pytest.raises(RankMetricError) as caught:
        parse_rank_metric("return:0.5,delay:0.5")
    assert "'delay'" in str(caught.value)
    assert "return, success, length" in str(caught.value)


def _workflow(tmp_path: Path, rank_metric: str) -> Path:
    path = tmp_path / "workflow.yaml"
    path.write_text(
        "name: ranked\n"
        "source:\n  dataset: test/hopper-hdf5-v0\n"
        f"diagnostics:\n  rank_metric: {rank_metric!r}\n"
    )
    return path


def test_workflow_field_is_validated_at_load(tmp_path: Path) -> None:
    workflow = load_workflow(_workflow(tmp_path, "return:3,-length:1"))
    assert workflow.diagnostics.rank_weights == parse_rank_metric("return:0.75,-length:0.25")
    with pytest.raises(WorkflowError) as caught:
        load_workflow(_workflow(tmp_path, "return:1,speed:1"))
    message = str(caught.value)
    assert "rank_metric" in message
    assert "'speed'" in message
