"""The report's quality table: how real each recipe's augmented data is.

Reads each recipe's ``quality`` in ``metrics["recipes"]`` (one
:class:`offaug.pipeline.diagnostics.quality_document.QualityReport` per augmented source): one
row per recipe and source with the state error (how far its states are from ones the env can
be in) and the dynamics and reward errors in the true env, the novelty and
OOD share against the data, and terminal rates and reward per step of both; where the env's
state could not be had, the row says why.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from offaug.pipeline.report.formatting import get, number, percent

QUALITY_HEADER = (
    "recipe",
    "source",
    "state",
    "state error (median, σ units)",
    "dynamics error (median, σ units)",
    "reward error (mean)",
    "terminal mismatch",
    "novelty (median)",
    "OOD share",
    "terminal rate (augmented / data)",
    "reward per step (augmented / data)",
)
"""The table's columns."""


def _pair(report: Mapping[str, Any], *keys: str) -> tuple[Any, Any]:
    return get(report, *keys, "augmented"), get(report, *keys, "source")


def quality_row(recipe: str, source: str, report: Mapping[str, Any]) -> list[str]:
    """One table row of already-escaped cells."""
    state = report.get("state") or {}
    kind = html.escape(str(state.get("kind", "—")))
    if state.get("reason"):
        kind += f' <span class="missing">({html.escape(str(state["reason"]))})</span>'
    terminal = _pair(report, "terminal_rate")
    augmented_steps = get(report, "returns", "augmented", "reward_per_step")
    source_steps = get(report, "returns", "source", "reward_per_step")
    return [
        html.escape(recipe),
        html.escape(source),
        kind,
        number(get(report, "state_error", "median")),
        number(get(report, "dynamics_error", "median")),
        number(get(report, "reward_error", "mean")),
        percent(report.get("terminal_mismatch")),
        number(get(report, "novelty", "median")),
        percent(get(report, "ood", "share")),
        f"{percent(terminal[0])} / {percent(terminal[1])}",
        f"{number(augmented_steps)} / {number(source_steps)}",
    ]


def quality_rows(recipes: Mapping[str, Any]) -> list[list[str]]:
    """Every recipe's rows (none for a recipe without quality reports)."""
    return [
        quality_row(name, source, report)
        for name, summary in recipes.items()
        for source, report in ((summary or {}).get("quality") or {}).items()
    ]
