"""The ``report`` fixture: the full metrics' report, written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from offaug.pipeline.report import write_report
from tests.pipeline.report.metrics import full_metrics


@pytest.fixture(scope="package")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(full_metrics(), tmp_path_factory.mktemp("report") / "report.html")
