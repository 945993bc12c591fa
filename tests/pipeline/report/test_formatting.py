"""The headline: the numbers the command line prints."""

from __future__ import annotations

from offaug.pipeline.report import headline
from tests.pipeline.report.metrics import full_metrics


def test_headline_numbers() -> None:
    rows = dict(headline(full_metrics()))
    assert rows["cql return, original → augmented"] == "100 → 120.5 (normalised 10 → 12)"
    assert rows["bcq return, original → augmented"] == "90 → —"
    assert rows["ESS/N of importance weights"].startswith("0.")
    assert "OOD fraction of augmented states" in rows
    assert rows["Q gap cql-augmented (Q − MC on data)"].startswith("+")
