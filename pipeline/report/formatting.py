"""How the report writes numbers, and its headline (what the command line prints too)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

from offaug.pipeline.contracts import PLAIN
from offaug.pipeline.schema.recipes import DEFAULT_RECIPE


def number(value: Any, digits: int = 3) -> str:
    """A cell: ``—`` for None or non-finite, yes/no, ``digits`` significant digits, escaped."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "—"
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.3e}"
    return html.escape(str(value))


def percent(value: Any) -> str:
    """A fraction as a percentage with one decimal (``—`` for None)."""
    return "—" if value is None else f"{100 * float(value):.1f}%"


def get(mapping: Any, *keys: str) -> Any:
    """``mapping[k1][k2]...`` or None when any level is missing."""
    for key in keys:
        if not isinstance(mapping, Mapping) or key not in mapping:
            return None
        mapping = mapping[key]
    return mapping


def training_pairs(training: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{algorithm: {PLAIN: entry, DEFAULT_RECIPE: entry}}`` from ``LEARNER-RECIPE`` keys: the
    learner on the original data alone and on original + augmented data.

    Runs of other recipes and seeds (``cql-RECIPE``, ``cql-augmented@s1``) are left to the
    verdict, which aggregates them.
    """
    pairs: dict[str, dict[str, Any]] = {}
    for name, entry in training.items():
        algorithm, _, data = str(name).rpartition("-")
        if "@" in str(name) or (algorithm and data not in (PLAIN, DEFAULT_RECIPE)):
            continue
        if not algorithm:
            algorithm, data = str(name), PLAIN
        pairs.setdefault(algorithm, {})[data] = entry
    return pairs


def headline(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report's headline as ``(label, value)`` rows, for the command line to print."""
    rows: list[tuple[str, str]] = []
    diagnostics = metrics.get("diagnostics") or {}
    for algorithm, pair in training_pairs(metrics.get("training") or {}).items():
        original, augmented = pair.get(PLAIN), pair.get(DEFAULT_RECIPE)
        text = f"{number(get(original, 'return'), 4)} → {number(get(augmented, 'return'), 4)}"
        scores = (get(original, "normalised_score"), get(augmented, "normalised_score"))
        if any(s is not None for s in scores):
            text += f" (normalised {number(scores[0], 3)} → {number(scores[1], 3)})"
        rows.append((f"{algorithm} return, original → augmented", text))
    weights = diagnostics.get("weights") or metrics.get("weights")
    if weights:
        rows.append(
            (
                "ESS/N of importance weights",
                f"{number(weights.get('ess_fraction'))} over {number(weights.get('n'))} "
                f"transitions, {percent(weights.get('clipped_fraction'))} clipped",
            )
        )
    coverage = diagnostics.get("coverage")
    if coverage:
        rows.append(
            (
                "OOD fraction of augmented states",
                f"{number(coverage['ood_fraction'])} (k={coverage['k']}, threshold "
                f"{number(coverage['threshold'])}; in-distribution data gives "
                f"≈ {number(1 - coverage['quantile'], 2)})",
            )
        )
    for name, entry in (diagnostics.get("value") or {}).items():
        gap = entry.get("dataset") or {}
        if gap.get("n"):
            rows.append(
                (
                    f"Q gap {name} (Q − MC on data)",
                    f"{gap['gap_mean']:+.3g} ({gap['sign']}-estimates; complete returns only: "
                    f"{number(gap.get('complete_gap_mean'))})",
                )
            )
    return rows
