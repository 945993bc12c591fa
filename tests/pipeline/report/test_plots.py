"""The plots: every one embedded in the page as a PNG."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

from PIL import Image

from offaug.pipeline.report import render_plots
from tests.pipeline.report.metrics import full_metrics

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def test_every_plot_is_embedded_as_a_png(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    images = IMG.findall(text)
    plots = render_plots(full_metrics())
    assert [p.key for p in plots] == ["weights", "returns", "coverage", "value"]
    assert text.count('<img src="data:image/png;base64,') == len(plots) == len(images)
    for encoded in images:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        assert image.format == "PNG"
        image.verify()
