"""What the dataset doctor reports: findings with a code, a severity, the numbers and advice."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
"""``info``: a figure worth knowing; ``warning``: likely to hurt learning; ``error``: broken
data."""

SEVERITIES: tuple[Severity, ...] = ("info", "warning", "error")

Number = float | int | str | bool | None | list[Any]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the doctor saw in a dataset."""

    code: str
    """A stable identifier, e.g. ``reward-scale`` (JSON consumers key on it)."""
    severity: Severity
    message: str
    """What it saw, in one sentence with the figures."""
    advice: str
    """What to do about it (empty for a purely informative finding)."""
    numbers: Mapping[str, Number] = dataclasses.field(default_factory=dict)
    """The figures behind the message, JSON-ready."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become None)."""
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "advice": self.advice,
            "numbers": {name: _json_number(value) for name, value in self.numbers.items()},
        }


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """Every finding on one dataset, plus the facts the checks were based on."""

    findings: tuple[Finding, ...]
    facts: Mapping[str, Number]
    """Steps, episodes, gamma, T_eff, env id and time limit as the doctor saw them."""

    @property
    def worst(self) -> Severity:
        """The most severe finding's severity (``info`` for none)."""
        return max((f.severity for f in self.findings), key=SEVERITIES.index, default="info")

    @property
    def exit_code(self) -> int:
        """0 when nothing worse than info, 1 with warnings, 2 with errors."""
        return SEVERITIES.index(self.worst)

    def codes(self, severity: Severity | None = None) -> list[str]:
        """The codes of the findings, optionally of one severity only."""
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    def with_findings(self, extra: Sequence[Finding]) -> DoctorReport:
        """The same report with more findings appended."""
        return dataclasses.replace(self, findings=(*self.findings, *extra))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``worst``, ``exit_code``, ``facts`` and ``findings``."""
        return {
            "worst": self.worst,
            "exit_code": self.exit_code,
            "facts": {name: _json_number(value) for name, value in self.facts.items()},
            "findings": [f.to_json() for f in self.findings],
        }


def _json_number(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_number(v) for v in value]
    return value
