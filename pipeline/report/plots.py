"""The report's plots, rendered to PNG on matplotlib's Agg canvas (no pyplot state).

Each only when its data is present, in this order: importance-weight histogram (``weights``),
episode-return distributions (``returns``), k-NN distance histograms with the OOD threshold
(``coverage``), Q-hat against Monte-Carlo returns (``value``).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from collections.abc import Mapping
from typing import Any

from offaug.pipeline.report.formatting import get, number, percent

_COLOURS = {"original": "#1f77b4", "augmented": "#ff7f0e", "threshold": "#d62728"}


@dataclasses.dataclass(frozen=True)
class Plot:
    """One rendered figure."""

    key: str
    """``weights``, ``returns``, ``coverage`` or ``value``."""
    title: str
    caption: str
    png: bytes


def _figure(width: float = 7.5, height: float = 3.4) -> Any:
    # Imported here: matplotlib is heavy, and the headline (the command line) does not need it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


def _bars(axes: Any, histogram: Mapping[str, Any], series: str, label: str, colour: str) -> None:
    counts = histogram.get(series)
    if counts is None:
        return
    edges = histogram["edges"]
    widths = [b - a for a, b in itertools.pairwise(edges)]
    axes.bar(
        edges[:-1],
        counts,
        width=widths,
        align="edge",
        alpha=0.55,
        color=colour,
        edgecolor=colour,
        label=label,
    )


def _weights_plot(weights: Mapping[str, Any]) -> Plot:
    figure = _figure()
    axes = figure.add_subplot()
    histogram = weights["histogram"]
    _bars(axes, histogram, "counts", "augmented transitions", _COLOURS["augmented"])
    if weights.get("weight_clip"):
        axes.axvline(
            math.log10(float(weights["weight_clip"])),
            color=_COLOURS["threshold"],
            linestyle="--",
            label=f"clip {weights['weight_clip']:g}",
        )
    axes.axvline(0.0, color="#555555", linestyle=":", label="w = 1")
    axes.set_xlabel("log10 importance weight β̂/μ")
    axes.set_ylabel("transitions")
    axes.legend()
    caption = (
        f"ESS/N = {number(weights.get('ess_fraction'))}; "
        f"{percent(weights.get('clipped_fraction'))} clipped; "
        f"{histogram.get('zeros', 0)} weights are exactly 0 (not shown)."
    )
    return Plot("weights", "Importance weights", caption, _png(figure))


def _returns_plot(data: Mapping[str, Any]) -> Plot:
    figure = _figure()
    axes = figure.add_subplot()
    histogram = data["return_histogram"]
    _bars(axes, histogram, "original", "original episodes", _COLOURS["original"])
    _bars(axes, histogram, "augmented", "augmented episodes", _COLOURS["augmented"])
    axes.set_xlabel("undiscounted episode return")
    axes.set_ylabel("episodes")
    axes.legend()
    caption = "Episode returns of the original data and of the augmented episodes."
    return Plot("returns", "Return distributions", caption, _png(figure))


def _coverage_plot(coverage: Mapping[str, Any]) -> Plot:
    figure = _figure()
    axes = figure.add_subplot()
    histogram = coverage["histogram"]
    _bars(axes, histogram, "original", "original (leave-one-out)", _COLOURS["original"])
    _bars(axes, histogram, "augmented", "augmented", _COLOURS["augmented"])
    axes.axvline(
        coverage["threshold"],
        color=_COLOURS["threshold"],
        linestyle="--",
        label=f"threshold ({coverage['quantile']:g} quantile)",
    )
    axes.set_xlabel(f"distance to the {coverage['k']}-th nearest original state (standardised)")
    axes.set_ylabel("states")
    axes.legend()
    caption = (
        f"{percent(coverage['ood_fraction'])} of augmented states lie beyond the threshold "
        f"{number(coverage['threshold'])}."
    )
    return Plot("coverage", "State coverage (k-NN distances)", caption, _png(figure))


def _value_plot(value: Mapping[str, Any]) -> Plot:
    figure = _figure(7.5, 4.2)
    axes = figure.add_subplot()
    low, high = math.inf, -math.inf
    markers = {"dataset": "o", "rollout": "x"}
    for name, entry in value.items():
        for kind, points in (entry.get("scatter") or {}).items():
            if not points or not points.get("q"):
                continue
            axes.scatter(
                points["mc"],
                points["q"],
                s=12,
                alpha=0.6,
                marker=markers.get(kind, "o"),
                label=f"{name}: {kind}",
            )
            low = min(low, *points["mc"], *points["q"])
            high = max(high, *points["mc"], *points["q"])
    if math.isfinite(low):
        axes.plot([low, high], [low, high], color="#555555", linestyle=":", label="Q = MC")
    axes.set_xlabel("discounted Monte-Carlo return")
    axes.set_ylabel("Q̂(s, a)")
    axes.legend(fontsize="small")
    caption = (
        "Points above the diagonal are over-estimated. Dataset points use dataset actions; "
        "rollout points are fresh episodes of the policy. Returns cut by a time limit read low."
    )
    return Plot("value", "Q̂ against Monte-Carlo returns", caption, _png(figure))


def _has_scatter(value: Mapping[str, Any]) -> bool:
    return any(
        points and points.get("q")
        for entry in value.values()
        for points in (entry.get("scatter") or {}).values()
    )


def render_plots(metrics: Mapping[str, Any]) -> list[Plot]:
    """Every plot whose data is in ``metrics``, in report order."""
    diagnostics = metrics.get("diagnostics") or {}
    plots = []
    weights = diagnostics.get("weights")
    if weights and weights.get("histogram"):
        plots.append(_weights_plot(weights))
    if get(diagnostics, "data", "return_histogram"):
        plots.append(_returns_plot(diagnostics["data"]))
    if diagnostics.get("coverage"):
        plots.append(_coverage_plot(diagnostics["coverage"]))
    if diagnostics.get("value") and _has_scatter(diagnostics["value"]):
        plots.append(_value_plot(diagnostics["value"]))
    return plots
