"""The report page: one self-contained HTML file of a run's metrics, readable offline.

Inline CSS, every plot embedded as a base64 PNG ``<img>`` and every video as a GIF data URI
(:mod:`.media`, within the page's size bound), no external URL; a section whose data is
missing says so instead of failing.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from offaug.datasets.atomic import atomic_path
from offaug.pipeline.contracts import PLAIN
from offaug.pipeline.report.formatting import get, headline, number, percent, training_pairs
from offaug.pipeline.report.media import (
    DEFAULT_MAX_REPORT_MB,
    MEGABYTE,
    best_video_html,
    doctor_html,
    videos_html,
)
from offaug.pipeline.report.plots import Plot, render_plots
from offaug.pipeline.report.quality_section import QUALITY_HEADER, quality_rows
from offaug.pipeline.report.verdict_section import VERDICT_CSS, comparison_html, verdict_html
from offaug.pipeline.rundir.run_layout import RunLayout
from offaug.pipeline.schema.recipes import DEFAULT_RECIPE

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #1b1b1b; background: #ffffff; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.2rem; border-bottom: 2px solid #e3e3e3; padding-bottom: 0.2rem;
     margin-top: 2rem; }
table { border-collapse: collapse; margin: 0.6rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #d0d0d0; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f2f4f7; }
.headline td:first-child { font-weight: 600; }
.headline td { text-align: left; }
.better { color: #137333; font-weight: 600; }
.worse { color: #b3261e; font-weight: 600; }
.missing { color: #6b6b6b; font-style: italic; }
figure { margin: 0.8rem 0; }
figure img { max-width: 100%; border: 1px solid #e3e3e3; }
figcaption { font-size: 0.85rem; color: #444; }
p.note { font-size: 0.85rem; color: #444; }
h3 { font-size: 1rem; margin: 1rem 0 0.3rem; }
.clips { display: flex; flex-wrap: wrap; gap: 1rem; }
.clips figure { margin: 0; max-width: 22rem; }
.clips img { image-rendering: pixelated; }
table.doctor td, table.doctor th { text-align: left; vertical-align: top; }
tr.warning td:first-child { color: #b06000; font-weight: 600; }
tr.error td:first-child { color: #b3261e; font-weight: 600; }
"""


_VIDEOS_SLOT = "<!-- videos -->"
_BEST_SLOT = "<!-- best policy -->"


def _table(header: Sequence[str] | None, rows: Sequence[Sequence[str]], css: str = "") -> str:
    """A table of already-escaped cells under an (escaped here) header row, if any."""
    head = ""
    if header is not None:
        head = (
            "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
        )
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    klass = f' class="{css}"' if css else ""
    return f"<table{klass}>{head}<tbody>{body}</tbody></table>"


def _missing(reason: str) -> str:
    return f'<p class="missing">{html.escape(reason)}</p>'


def _figure_html(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (
        f'<figure id="plot-{plot.key}"><img src="data:image/png;base64,{data}" '
        f'alt="{html.escape(plot.title)}"><figcaption>{html.escape(plot.caption)}'
        "</figcaption></figure>"
    )


def _scores_html(training: Mapping[str, Any]) -> str:
    if not training:
        return _missing("No training results in metrics.json.")
    rows = []
    for algorithm, pair in training_pairs(training).items():
        original = get(pair, PLAIN, "return")
        augmented = get(pair, DEFAULT_RECIPE, "return")
        change = "—"
        if original is not None and augmented is not None:
            delta = float(augmented) - float(original)
            klass = "better" if delta > 0 else "worse" if delta < 0 else ""
            change = f'<span class="{klass}">{delta:+.4g}</span>'
        rows.append(
            [
                html.escape(algorithm),
                number(original, 4),
                number(augmented, 4),
                change,
                number(get(pair, PLAIN, "normalised_score")),
                number(get(pair, DEFAULT_RECIPE, "normalised_score")),
            ]
        )
    header = [
        "learner",
        "return (original)",
        "return (augmented)",
        "change",
        "normalised (original)",
        "normalised (augmented)",
    ]
    return _table(header, rows)


def _weights_html(weights: Mapping[str, Any] | None, plots: Mapping[str, Plot]) -> str:
    if not weights:
        return _missing("No augmented data: no importance weights.")
    parts = []
    if not weights.get("present", True):
        parts.append(_missing("The augmented data carries no importance_weight (all 1)."))
    summary = [
        [
            "all",
            number(weights.get("n")),
            number(weights.get("ess")),
            number(weights.get("ess_fraction")),
            percent(weights.get("clipped_fraction")),
        ]
    ]
    shards = [
        [
            html.escape(str(s.get("shard"))),
            number(s.get("n")),
            number(s.get("ess")),
            number(s.get("ess_fraction")),
            percent(s.get("clipped_fraction")),
        ]
        for s in weights.get("per_shard") or []
    ]
    parts.append(_table(["shard", "n", "ESS", "ESS/N", "clipped"], summary + shards))
    episodes = weights.get("episodes")
    if episodes:
        values = episodes["log_quantiles"]["values"]
        levels = episodes["log_quantiles"]["levels"]
        parts.append(
            "<p>Per-episode cumulative weight ∏ β̂/μ (natural log) quantiles: "
            + ", ".join(f"q{lv:g} = {number(v)}" for lv, v in zip(levels, values, strict=True))
            + f"; episode ESS/N = {number(episodes.get('ess_fraction'))}.</p>"
        )
    if "weights" in plots:
        parts.append(_figure_html(plots["weights"]))
    return "".join(parts)


def _data_html(data: Mapping[str, Any] | None, plots: Mapping[str, Plot]) -> str:
    if not data:
        return _missing("No data summary.")
    fields = [
        ("episodes", ("episodes",)),
        ("steps", ("steps",)),
        ("reward mean", ("reward_mean",)),
        ("reward std", ("reward_std",)),
        ("episode length mean", ("episode_length", "mean")),
        ("episode length min", ("episode_length", "min")),
        ("episode length max", ("episode_length", "max")),
        ("return mean", ("return", "mean")),
        ("return std", ("return", "std")),
        ("terminals", ("terminals",)),
        ("timeouts", ("timeouts",)),
    ]
    rows = [
        [label, number(get(data, "original", *keys)), number(get(data, "augmented", *keys))]
        for label, keys in fields
    ]
    parts = [
        _table(["", "original", "augmented"], rows),
        f"<p>γ = {number(data.get('gamma'))}, effective horizon 1/(1−γ) = "
        f"{number(data.get('effective_horizon'))} steps.</p>",
    ]
    if "returns" in plots:
        parts.append(_figure_html(plots["returns"]))
    return "".join(parts)


def _coverage_html(coverage: Mapping[str, Any] | None, plots: Mapping[str, Plot]) -> str:
    if not coverage:
        return _missing("No augmented data: no coverage check.")
    violation = coverage.get("range_violation") or {}
    rows = [
        ["k", number(coverage["k"])],
        ["quantile", number(coverage["quantile"])],
        ["threshold (standardised distance)", number(coverage["threshold"])],
        ["OOD fraction", number(coverage["ood_fraction"])],
        ["states (original / augmented)", _states(coverage.get("states"))],
        ["outside the original range in any dimension", percent(violation.get("any_dimension"))],
        [
            "worst dimension",
            f"{number(violation.get('worst_dimension'))} "
            f"({percent(violation.get('worst_fraction'))})",
        ],
    ]
    parts = [_table(["", "value"], rows)]
    if "coverage" in plots:
        parts.append(_figure_html(plots["coverage"]))
    return "".join(parts)


def _quality_html(recipes: Mapping[str, Any]) -> str:
    rows = quality_rows(recipes)
    if not rows:
        return _missing("No quality report (no augmented data, or no diagnostics).")
    note = (
        '<p class="note">Dynamics and reward errors: the augmented rows replayed in the true'
        " environment (0 for real transitions); novelty: distance to the nearest real"
        " transition in units of the data's own nearest-neighbour distance (docs/diagnostics.md)."
        "</p>"
    )
    return _table(QUALITY_HEADER, rows) + note


def _states(states: Mapping[str, Any] | None) -> str:
    if not states:
        return "—"
    return f"{number(states.get('original'))} / {number(states.get('augmented'))}"


def _divergence_html(divergence: Mapping[str, Any] | None) -> str:
    if not divergence:
        return _missing("No divergence check.")
    rows = [
        [
            html.escape(name),
            html.escape(str(entry.get("kind"))),
            number(entry.get("nll")),
            number(entry.get("kl_monte_carlo")),
            number(entry.get("kl_on_rollout_states")),
            number(entry.get("action_distance")),
        ]
        for name, entry in (divergence.get("policies") or {}).items()
    ]
    header = ["policy", "kind", "−E log β̂(π(s)|s)", "KL (MC)", "KL on rollout", "action dist."]
    return (
        f"<p>{number(divergence.get('states'))} dataset states; dataset actions have "
        f"−E log β̂(a|s) = {number(divergence.get('dataset_nll'))} (the reference level). "
        "Deterministic policies have no finite KL: their actions' negative log-likelihood under "
        "β̂ is shown. Densities over the normalised action box.</p>" + _table(header, rows)
    )


def _value_html(value: Mapping[str, Any] | None, plots: Mapping[str, Plot]) -> str:
    if not value:
        return _missing("No trained critic (no learner with q_values).")
    rows = []
    for name, entry in value.items():
        for kind in ("dataset", "rollout"):
            gap = entry.get(kind)
            if not gap or not gap.get("n"):
                continue
            rows.append(
                [
                    f"{html.escape(name)} ({kind})",
                    number(gap.get("q_mean")),
                    number(gap.get("mc_mean")),
                    number(gap.get("gap_mean")),
                    number(gap.get("complete_gap_mean")),
                    percent(gap.get("overestimated_fraction")),
                ]
            )
    random_rows = [
        [
            html.escape(name),
            number(get(entry, "random_actions", "q_dataset_actions")),
            number(get(entry, "random_actions", "q_random_actions")),
            number(get(entry, "random_actions", "difference")),
        ]
        for name, entry in value.items()
    ]
    parts = [
        _table(["critic", "mean Q̂", "mean MC", "gap", "gap (complete MC)", "over-estimated"], rows),
        _table(
            ["critic", "Q̂ at dataset actions", "Q̂ at random actions", "difference"], random_rows
        ),
    ]
    if "value" in plots:
        parts.append(_figure_html(plots["value"]))
    return "".join(parts)


def _ope_html(ope: Mapping[str, Any] | None) -> str:
    entries = {k: v for k, v in (ope or {}).items() if k != "settings"}
    if not entries:
        return _missing("No off-policy evaluation.")
    settings = (ope or {}).get("settings") or {}
    rows = [
        [
            html.escape(name),
            number(entry.get("true_discounted_return")),
            number(entry.get("fqe")),
            number(entry.get("wpdis")),
            number(entry.get("wpdis_ess_fraction")),
        ]
        for name, entry in entries.items()
    ]
    note = (
        f'<p class="note">FQE: {number(settings.get("fqe_steps"))} steps, τ = '
        f"{number(settings.get('fqe_tau'))}. WPDIS stands a deterministic policy in with a "
        f"Gaussian of σ = {number(settings.get('target_sigma'))} (normalised box) around π(s). "
        "Both start from the dataset's episode starts; the truth is the mean discounted return "
        "of fresh evaluation episodes.</p>"
    )
    header = ["policy", "true discounted return", "FQE", "WPDIS", "WPDIS ESS/N"]
    return _table(header, rows) + note


def _ranking_html(ranking: Sequence[Mapping[str, Any]] | None) -> str:
    if not ranking:
        return _missing("No evaluation episodes (no environment or no trained policy).")
    weighted = [entry.get("weighted") for entry in ranking]
    rows = [
        [
            html.escape(str(entry.get("name"))),
            number(entry.get("rank")),
            number(entry.get("mean_return"), 4),
            number(entry.get("mean_length"), 4),
            percent(entry.get("success_rate")),
        ]
        + (
            [f"{number(w['score'], 3)} [{number(w['low'], 3)}, {number(w['high'], 3)}]"]
            if w
            else []
        )
        for entry, w in zip(ranking, weighted, strict=True)
    ]
    header = ["policy", "rank", "mean return", "mean length", "success"]
    if not all(weighted):
        return _table(header, rows)
    metric = html.escape(str(ranking[0]["weighted"]["metric"]))
    note = (
        f'<p class="note">Ranked by the weighted score {metric}: each metric scaled to 0 (worst '
        "episode of any policy) .. 1 (best), weighted, averaged over the shared start states; "
        "95 % bootstrap interval over start states.</p>"
    )
    return _table([*header, "weighted score [95 % CI]"], rows) + note


def render_html(metrics: Mapping[str, Any], *, title: str = "offaug run report") -> str:
    """The report as one HTML string (what :func:`write_report` writes)."""
    diagnostics = metrics.get("diagnostics") or {}
    plots = {plot.key: plot for plot in render_plots(metrics)}
    head_rows = [[html.escape(label), html.escape(value)] for label, value in headline(metrics)]
    timings = diagnostics.get("timings") or {}
    sections = [
        ("Best augmented against best plain, at equal gradient steps", comparison_html(metrics)),
        ("The best policy", _BEST_SLOT),
        ("Does augmentation help?", verdict_html(metrics)),
        ("Headline", _table(None, head_rows, "headline") if head_rows else _missing("—")),
        ("Scores", _scores_html(metrics.get("training") or {})),
        ("Videos", _VIDEOS_SLOT),
        ("Importance weights", _weights_html(diagnostics.get("weights"), plots)),
        ("Data", _data_html(diagnostics.get("data"), plots)),
        ("Dataset doctor", doctor_html(metrics.get("doctor"))),
        ("State coverage", _coverage_html(diagnostics.get("coverage"), plots)),
        ("Augmented data quality", _quality_html(metrics.get("recipes") or {})),
        ("Policy divergence from β̂", _divergence_html(diagnostics.get("divergence"))),
        ("Value over-estimation", _value_html(diagnostics.get("value"), plots)),
        ("Off-policy evaluation", _ope_html(diagnostics.get("ope"))),
        ("Policy ranking", _ranking_html(diagnostics.get("ranking"))),
    ]
    body = "".join(f"<h2>{html.escape(name)}</h2>{content}" for name, content in sections)
    if timings:
        body += '<p class="note">Diagnostics took ' + ", ".join(
            f"{html.escape(str(k))} {number(v, 2)} s" for k, v in timings.items()
        )
        body += ".</p>"
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}{VERDICT_CSS}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )
    # The best policy's clip, then the videos, get what the rest of the page leaves of the
    # size bound: the best clip at most half of it.
    videos, best = metrics.get("videos"), metrics.get("best_video")
    bound = (videos or best or {}).get("max_report_mb") or DEFAULT_MAX_REPORT_MB
    limit = int(float(bound) * MEGABYTE)
    left = limit - len(page.encode("utf-8")) + len(_VIDEOS_SLOT) + len(_BEST_SLOT)
    page = page.replace(_BEST_SLOT, best_video_html(best, left // 2))
    budget = limit - len(page.encode("utf-8")) + len(_VIDEOS_SLOT)
    return page.replace(_VIDEOS_SLOT, videos_html(videos, budget))


def write_report(metrics: Mapping[str, Any], out_html: Path) -> Path:
    """Write the self-contained HTML report atomically (temporary name, then rename).

    Args:
        metrics: The run's metrics (:class:`~offaug.pipeline.report.metrics_document.Metrics`).
        out_html: The file to write; its directory is created.

    Returns:
        ``out_html``.
    """
    final = Path(out_html)
    final.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(metrics)
    with atomic_path(final) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return final


def report_run(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html`` from ``RUN_DIR/metrics.json`` (``offaug report``).

    Raises:
        FileNotFoundError: no ``metrics.json``.
    """
    layout = RunLayout(Path(run_dir))
    if not layout.metrics.is_file():
        raise FileNotFoundError(f"{layout.metrics}: no metrics; run the workflow first")
    return write_report(json.loads(layout.metrics.read_text()), layout.report)
