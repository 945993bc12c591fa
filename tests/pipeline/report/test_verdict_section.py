"""The verdict sections on hand-made metrics: the best-against-best sentence first on the page,
then helps, hurts and inconclusive per learner."""

from __future__ import annotations

import html
from typing import Any

from offaug.pipeline.contracts import PLAIN
from offaug.pipeline.outcome.verdict import RunScore, as_json, headline, judge, judge_best
from offaug.pipeline.report import render_html
from offaug.pipeline.report.verdict_section import comparison_html, verdict_html

PLAIN_SCORES = [40.0, 42.0, 44.0, 41.0, 43.0]
ARMS = {
    "branch": [60.0, 62.0, 61.0, 63.0, 64.0],  # helps
    "noisy": [20.0, 22.0, 21.0, 19.0, 18.0],  # hurts
    "mix": [41.0, 43.0, 40.0, 44.0, 42.0],  # inconclusive
}


def _metrics() -> dict[str, Any]:
    runs = [RunScore("cql", PLAIN, s, v) for s, v in enumerate(PLAIN_SCORES)]
    for recipe, scores in ARMS.items():
        runs += [RunScore("cql", recipe, s, v) for s, v in enumerate(scores)]
    recipes = {
        "noisy": {
            "weighting": "behaviour",
            "ess_fraction": 0.03,
            "ood_share": 0.5,
            "augmented_reward_per_step": -6.0,
            "original_reward_per_step": -2.5,
        },
        "branch": {
            "weighting": "none",
            "ess_fraction": 0.9,
            "ood_share": 0.05,
            "noise": ["gaussian:0.01", "gaussian:0.003", "gaussian:0.01"],
            "calibrated": True,
            "episodes_kept": 30,
            "episodes_dropped": 10,
        },
        "mix": {"weighting": "behaviour"},
    }
    verdicts = judge(runs, recipes)  # type: ignore[arg-type]
    return {
        "verdict": as_json(verdicts),
        "verdict_headline": headline(verdicts),
        "recipes": recipes,
        "data_score": 55.0,
        "training": {"cql-plain": {"return": 1.0, "normalised_score": 40.0}},
    }


def test_each_outcome_is_shown_in_its_colour_with_its_numbers_and_reasons() -> None:
    section = verdict_html(_metrics())
    for outcome in ("helps", "hurts", "inconclusive"):
        assert f'<span class="{outcome}">{outcome}</span>' in section
    assert "cql with branch: augmentation helps" in section
    assert "cql with noisy: augmentation hurts" in section
    assert "cql with mix: no clear difference" in section
    # The hurting arm's reasons, and its recipe's diagnostics beside it.
    assert "ESS/N = 0.03" in section and "rollout policy is worse than the data" in section
    assert "50.0%" in section and "-6 vs -2.5" in section
    assert "P(improvement)" in section and "[95% CI]" in section
    assert "score 55 (normalised)" in section
    # The rollouts beside it: each noise the seeds used once, who chose it, what the filter kept.
    assert "gaussian:0.01, gaussian:0.003 (calibrated); kept 30 of 40 episodes" in section


def test_the_verdict_comes_first_and_a_run_without_one_says_why() -> None:
    page = render_html(_metrics())
    assert page.index("<h2>Does augmentation help?</h2>") < page.index("<h2>Headline</h2>")
    assert ".hurts" in page  # its styles are inline too
    empty = render_html({})
    assert "No verdict" in empty


def test_the_page_opens_with_the_best_against_best_sentence() -> None:
    runs = [RunScore("cql", PLAIN, s, v, 1000, 1000, 0) for s, v in enumerate(PLAIN_SCORES)]
    runs += [
        RunScore("iql", "baseline[3000]", s, v - 5, 3000, 3000, 0)
        for s, v in enumerate(PLAIN_SCORES)
    ]
    runs += [RunScore("cql", "branch", s, v, 3000, 1000, 800) for s, v in enumerate(ARMS["branch"])]
    metrics = {**_metrics(), "comparison": judge_best(runs)}
    sentence = metrics["comparison"]["sentence"]
    assert sentence.startswith("Best augmented arm cql with branch")
    page = render_html(metrics)
    body = page[page.index("<body>") :]
    assert body.index(html.escape(sentence)) < body.index("<h2>Does augmentation help?</h2>")
    section = comparison_html(metrics)
    assert '<span class="helps">●</span>' in section
    # cql's plain arm, better at 1,000 steps than iql's at 3,000, is the bar.
    assert "<td>best plain</td><td>cql</td><td>plain</td><td>1,000 (1,000)</td>" in section
    assert "<td>3,000 (1,000)</td><td>800</td>" in section
    assert "No best-against-best verdict" in comparison_html({})
