"""The run report: one self-contained HTML file of a run's metrics, readable offline.

:func:`write_report` renders ``metrics.json`` (typed in :mod:`.metrics_document`) into HTML with
inline CSS and every plot embedded as a base64 PNG (:mod:`.plots`; the page itself is :mod:`.page`);
:func:`headline` (:mod:`.formatting`) gives the few numbers the command line prints.
"""

from offaug.pipeline.report.formatting import headline
from offaug.pipeline.report.metrics_document import Metrics
from offaug.pipeline.report.page import render_html, report_run, write_report
from offaug.pipeline.report.plots import Plot, render_plots

__all__ = [
    "Metrics",
    "Plot",
    "headline",
    "render_html",
    "render_plots",
    "report_run",
    "write_report",
]
