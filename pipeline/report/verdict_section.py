"""The report's first sections: the best augmented arm against the best plain arm at equal
gradient steps (:func:`comparison_html`, from ``metrics["comparison"]``), then does augmentation
help? One row per recipe and learner (:func:`verdict_html`).

Reads ``metrics["verdict"]`` (:class:`offaug.pipeline.outcome.verdict.ArmVerdict` entries) and
``metrics["recipes"]`` (each recipe's ESS/N, OOD share, reward per step, rollout noise and the
filter's kept episodes): the arm's IQM with
its interval, plain's, the IQM difference with its interval, P(improvement) and the outcome in
colour, then the plain sentence and, where augmentation did not help, the reasons.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from offaug.pipeline.report.formatting import number, percent

VERDICT_CSS = """
.helps { color: #137333; font-weight: 600; }
.hurts { color: #b3261e; font-weight: 600; }
.inconclusive { color: #8a5a00; font-weight: 600; }
p.verdict-headline { font-size: 1.05rem; }
ul.reasons { font-size: 0.9rem; margin: 0.2rem 0 0.8rem 1.2rem; }
"""
"""The verdict section's styles (the page adds them to its own)."""

_OUTCOME_WORDS = {"helps": "helps", "hurts": "hurts", "inconclusive": "inconclusive"}


def _interval(values: Any, digits: int = 3) -> str:
    if not isinstance(values, (list, tuple)) or len(values) != 2:
        return "—"
    return f"[{number(values[0], digits)}, {number(values[1], digits)}]"


def _signed(value: Any) -> str:
    return "—" if value is None else f"{float(value):+.3g}"


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "—"


def _rewards(recipe: Mapping[str, Any]) -> str:
    augmented = recipe.get("augmented_reward_per_step")
    original = recipe.get("original_reward_per_step")
    if augmented is None and original is None:
        return "—"
    return f"{number(augmented)} vs {number(original)}"


def _rollouts(recipe: Mapping[str, Any]) -> str:
    """The noise the seeds' rollouts used (and whether calibration chose it) and the filter's
    kept share of episodes."""
    noises = list(dict.fromkeys(str(n) for n in recipe.get("noise") or []))
    text = ", ".join(noises) if noises else "—"
    if recipe.get("calibrated"):
        text += " (calibrated)"
    kept, dropped = recipe.get("episodes_kept"), recipe.get("episodes_dropped")
    if kept is not None and dropped is not None:
        text += f"; kept {kept} of {kept + dropped} episodes"
    return html.escape(text)


def comparison_html(metrics: Mapping[str, Any]) -> str:
    """The study's answer: its sentence, then the two arms side by side (already escaped)."""
    comparison = metrics.get("comparison") or {}
    sentence = comparison.get("sentence")
    if not sentence:
        return '<p class="missing">No best-against-best verdict in this run\'s metrics.</p>'
    outcome = str(comparison.get("outcome"))
    klass = outcome if outcome in _OUTCOME_WORDS else ""
    lead = f'<p class="verdict-headline"><span class="{klass}">●</span> {html.escape(sentence)}</p>'
    augmented, plain = comparison.get("augmented"), comparison.get("plain")
    if not augmented or not plain:
        return lead
    score = "normalised score" if metrics.get("verdict_score") != "return" else "return"
    header = ["arm", "learner", "recipe", "gradient steps (own)", "simulator steps"]
    header.append(f"IQM {score} [95% CI]")
    rows = []
    for label, arm in (("best augmented", augmented), ("best plain", plain)):
        cells = [
            label,
            html.escape(str(arm.get("learner"))),
            html.escape(str(arm.get("recipe"))),
            f"{_count(arm.get('steps'))} ({_count(arm.get('own_steps'))})",
            _count(arm.get("simulator_steps")),
            f"{number(arm.get('iqm'))} {_interval(arm.get('iqm_interval'))}",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(rows)
    table = f'<table class="verdict"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    explain = (
        '<p class="note">The best augmented arm (highest IQM over seeds, over every learner and '
        "recipe) against the best plain arm trained for the same total gradient steps or fewer: "
        "the augmented arm's count includes its rollout policy's training (the BC clone, or the "
        "learner that rolls out, every round) and the plain run it starts from. It helps when "
        "the 95% interval of the IQM difference lies above zero, hurts when below.</p>"
    )
    return lead + table + explain


def verdict_html(metrics: Mapping[str, Any]) -> str:
    """The section's HTML (already escaped); a line saying why when there is no verdict."""
    verdicts = metrics.get("verdict") or []
    if not verdicts:
        return (
            '<p class="missing">No verdict: no learner was trained on both the original data '
            "alone and an augmentation recipe.</p>"
        )
    recipes: Mapping[str, Any] = metrics.get("recipes") or {}
    score = "normalised score" if metrics.get("verdict_score") != "return" else "return"
    header = [
        "learner",
        "recipe",
        "outcome",
        f"IQM {score} [95% CI]",
        "plain IQM [95% CI]",
        "difference [95% CI]",
        "P(improvement)",
        "seeds",
        "ESS/N",
        "OOD share",
        "reward/step aug. vs orig.",
        "rollout noise; filter",
    ]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = []
    notes = []
    for verdict in verdicts:
        outcome = str(verdict.get("outcome"))
        klass = outcome if outcome in _OUTCOME_WORDS else ""
        recipe = recipes.get(str(verdict.get("recipe"))) or {}
        cells = [
            html.escape(str(verdict.get("learner"))),
            html.escape(str(verdict.get("recipe"))),
            f'<span class="{klass}">{html.escape(_OUTCOME_WORDS.get(outcome, outcome))}</span>',
            f"{number(verdict.get('iqm'))} {_interval(verdict.get('iqm_interval'))}",
            f"{number(verdict.get('plain_iqm'))} {_interval(verdict.get('plain_iqm_interval'))}",
            f'<span class="{klass}">{_signed(verdict.get("difference"))}</span> '
            f"{_interval(verdict.get('interval'))}",
            number(verdict.get("probability_of_improvement"), 2),
            number(len(verdict.get("seeds") or [])),
            number(recipe.get("ess_fraction")),
            percent(recipe.get("ood_share")) if recipe.get("ood_share") is not None else "—",
            _rewards(recipe),
            _rollouts(recipe),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        reasons = "".join(f"<li>{html.escape(str(r))}</li>" for r in verdict.get("reasons") or [])
        notes.append(
            f'<p><span class="{klass}">●</span> {html.escape(str(verdict.get("sentence")))}</p>'
            + (f'<ul class="reasons">{reasons}</ul>' if reasons else "")
        )
    body = "".join(rows)
    table = f'<table class="verdict"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    line = metrics.get("verdict_headline")
    lead = f'<p class="verdict-headline">{html.escape(str(line))}</p>' if line else ""
    data = metrics.get("data_score")
    data_line = (
        f'<p class="note">The data\'s own episodes score {number(data)} (normalised).</p>'
        if data is not None
        else ""
    )
    explain = (
        '<p class="note">Each arm against the same learner trained on the original data alone '
        "for train.steps (fewer gradient steps than the arm spent in all), over the seeds both "
        "have: interquartile means (IQM) of the final evaluation, 95% "
        "stratified bootstrap intervals, and P(improvement) = P(a run of the arm beats a plain "
        "run). An arm helps when the interval of the difference lies above zero.</p>"
    )
    return lead + table + data_line + "".join(notes) + explain
