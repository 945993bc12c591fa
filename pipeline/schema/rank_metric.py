"""The weighted ranking metric: which per-episode metrics rank policies, and how much each counts.

Written ``NAME:WEIGHT[,NAME:WEIGHT...]``, e.g. ``return:0.6,success:0.3,length:0.1``, and parsed
once (at the command line or when a workflow loads) into a :class:`RankMetric`:

* ``return`` — the episode's undiscounted return; higher is better;
* ``success`` — ``info["success"]`` at its last step, else "ran to the time limit"; higher is
  better;
* ``length`` — steps taken; **longer** is better (survival tasks, where falling ends an
  episode). Write ``-length`` where shorter is better (reaching a goal sooner); any metric may
  take the ``-`` prefix, meaning lower is better.

Weights are non-negative, at least one is positive, and are normalised to sum to 1; a metric
named twice is an error. This module has no offaug imports, so the workflow schema can use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

MetricName = Literal["return", "success", "length"]
METRIC_NAMES: tuple[MetricName, ...] = get_args(MetricName)
"""The per-episode metrics a policy can be ranked on."""


class RankMetricError(ValueError):
    """A ranking metric string that does not parse; the message names the bad term."""


@dataclasses.dataclass(frozen=True)
class MetricTerm:
    """One weighted metric of a :class:`RankMetric`."""

    name: MetricName
    weight: float
    """Its share of the score (the terms' weights sum to 1)."""
    higher_is_better: bool = True
    """False for a ``-NAME`` term."""

    @property
    def label(self) -> str:
        """The metric as written: ``length``, or ``-length`` when lower is better."""
        return self.name if self.higher_is_better else f"-{self.name}"

    def __str__(self) -> str:
        return f"{self.label}:{self.weight:.6g}"


@dataclasses.dataclass(frozen=True)
class RankMetric:
    """A weighted mix of per-episode metrics, weights normalised to sum to 1."""

    terms: tuple[MetricTerm, ...]

    def __str__(self) -> str:
        """The canonical text (normalised weights); it parses back to the same text."""
        return ",".join(str(term) for term in self.terms)


def parse_rank_metric(text: str) -> RankMetric:
    """``"return:0.6,success:0.3,length:0.1"`` as a :class:`RankMetric` (weights normalised).

    Raises:
        RankMetricError: an empty string, a term without ``:WEIGHT``, an unknown metric, a
            metric named twice, a weight that is not a finite non-negative number, or all
            weights zero.
    """
    allowed = ", ".join(METRIC_NAMES)
    by_name: dict[str, MetricName] = {name: name for name in METRIC_NAMES}
    terms: list[tuple[MetricName, float, bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        name_part, colon, weight_part = term.partition(":")
        if not term or not colon:
            raise RankMetricError(
                f"term {term!r} in {text!r}: write NAME:WEIGHT, e.g. return:0.6 "
                f"(metrics: {allowed}; prefix - for lower is better)"
            )
        higher = not name_part.strip().startswith("-")
        written = name_part.strip().removeprefix("-").strip()
        name = by_name.get(written)
        if name is None:
            raise RankMetricError(
                f"term {term!r}: unknown metric {written!r}; choose from {allowed}"
            )
        try:
            weight = float(weight_part)
        except ValueError:
            raise RankMetricError(
                f"term {term!r}: weight {weight_part!r} is not a number"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise RankMetricError(
                f"term {term!r}: weight must be a finite number >= 0, got {weight_part!r}"
            )
        if any(name == seen for seen, _, _ in terms):
            raise RankMetricError(f"term {term!r}: metric {name!r} is named twice in {text!r}")
        terms.append((name, weight, higher))
    total = sum(weight for _, weight, _ in terms)
    if total <= 0:
        raise RankMetricError(f"{text!r}: at least one weight must be positive")
    return RankMetric(
        tuple(MetricTerm(name, weight / total, higher) for name, weight, higher in terms)
    )
