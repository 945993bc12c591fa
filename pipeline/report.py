"""The run report: one self-contained HTML file of a run's metrics, readable offline.

:func:`write_report` renders ``metrics.json`` into HTML with inline CSS and every plot embedded
as a base64 PNG ``<img>`` (matplotlib's Agg canvas; no pyplot state, no external URL);
:func:`headline` gives the few numbers the command line prints.

``metrics.json`` (the run's metrics; every key optional, a missing section is reported as
missing rather than failing):

``training``
    ``{name: {"return": float, "normalised_score": float | None}}``, one per training run,
    named ``<algorithm>-original`` / ``<algorithm>-augmented`` (the final evaluation's mean
    return and D4RL-normalised score).
``weights``
    The rollout's pooled importance-weight statistics
    (:func:`offaug.pipeline.rollout.weight_statistics`): ``n``, ``ess``, ``ess_fraction``,
    ``clipped_fraction``, ``max_weight``, ``mean_log_ratio``.
``diagnostics``
    :func:`offaug.pipeline.diagnostics.run_diagnostics`'s dict; its schema is in that module's
    docstring (``data``, ``weights``, ``coverage``, ``divergence``, ``value``, ``evaluation``,
    ``ope``, ``ranking``, ``timings``).

Plots (each only when its data is present, in this order): importance-weight histogram
(``weights``), episode-return distributions (``returns``), k-NN distance histograms with the OOD
threshold (``coverage``), Q-hat against Monte-Carlo returns (``value``).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import itertools
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_COLOURS = {"original": "#1f77b4", "augmented": "#ff7f0e", "threshold": "#d62728"}
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
"""


@dataclasses.dataclass(frozen=True)
class Plot:
    """One rendered figure."""

    key: str
    """``weights``, ``returns``, ``coverage`` or ``value``."""
    title: str
    caption: str
    png: bytes


# -- formatting -----------------------------------------------------------------------------------


def _number(value: Any, digits: int = 3) -> str:
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


def _percent(value: Any) -> str:
    return "—" if value is None else f"{100 * float(value):.1f}%"


def _get(mapping: Any, *keys: str) -> Any:
    """``mapping[k1][k2]...`` or None when any level is missing."""
    for key in keys:
        if not isinstance(mapping, Mapping) or key not in mapping:
            return None
        mapping = mapping[key]
    return mapping


def _training_pairs(training: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{algorithm: {"original": entry, "augmented": entry}}`` from ``name-data`` keys."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, entry in training.items():
        algorithm, _, data = str(name).rpartition("-")
        if data not in ("original", "augmented") or not algorithm:
            algorithm, data = str(name), "original"
        pairs.setdefault(algorithm, {})[data] = entry
    return pairs


# -- headline -------------------------------------------------------------------------------------


def headline(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report's headline as ``(label, value)`` rows, for the command line to print."""
    rows: list[tuple[str, str]] = []
    diagnostics = metrics.get("diagnostics") or {}
    for algorithm, pair in _training_pairs(metrics.get("training") or {}).items():
        original, augmented = pair.get("original"), pair.get("augmented")
        text = f"{_number(_get(original, 'return'), 4)} → {_number(_get(augmented, 'return'), 4)}"
        scores = (_get(original, "normalised_score"), _get(augmented, "normalised_score"))
        if any(s is not None for s in scores):
            text += f" (normalised {_number(scores[0], 3)} → {_number(scores[1], 3)})"
        rows.append((f"{algorithm} return, original → augmented", text))
    weights = diagnostics.get("weights") or metrics.get("weights")
    if weights:
        rows.append(
            (
                "ESS/N of importance weights",
                f"{_number(weights.get('ess_fraction'))} over {_number(weights.get('n'))} "
                f"transitions, {_percent(weights.get('clipped_fraction'))} clipped",
            )
        )
    coverage = diagnostics.get("coverage")
    if coverage:
        rows.append(
            (
                "OOD fraction of augmented states",
                f"{_number(coverage['ood_fraction'])} (k={coverage['k']}, threshold "
                f"{_number(coverage['threshold'])}; in-distribution data gives "
                f"≈ {_number(1 - coverage['quantile'], 2)})",
            )
        )
    for name, entry in (diagnostics.get("value") or {}).items():
        gap = entry.get("dataset") or {}
        if gap.get("n"):
            rows.append(
                (
                    f"Q gap {name} (Q − MC on data)",
                    f"{gap['gap_mean']:+.3g} ({gap['sign']}-estimates; complete returns only: "
                    f"{_number(gap.get('complete_gap_mean'))})",
                )
            )
    return rows


# -- plots ----------------------------------------------------------------------------------------


def _figure(width: float = 7.5, height: float = 3.4) -> Any:
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
        f"ESS/N = {_number(weights.get('ess_fraction'))}; "
        f"{_percent(weights.get('clipped_fraction'))} clipped; "
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
        f"{_percent(coverage['ood_fraction'])} of augmented states lie beyond the threshold "
        f"{_number(coverage['threshold'])}."
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
    if _get(diagnostics, "data", "return_histogram"):
        plots.append(_returns_plot(diagnostics["data"]))
    if diagnostics.get("coverage"):
        plots.append(_coverage_plot(diagnostics["coverage"]))
    if diagnostics.get("value") and _has_scatter(diagnostics["value"]):
        plots.append(_value_plot(diagnostics["value"]))
    return plots


# -- HTML -----------------------------------------------------------------------------------------


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
    for algorithm, pair in _training_pairs(training).items():
        original = _get(pair, "original", "return")
        augmented = _get(pair, "augmented", "return")
        change = "—"
        if original is not None and augmented is not None:
            delta = float(augmented) - float(original)
            klass = "better" if delta > 0 else "worse" if delta < 0 else ""
            change = f'<span class="{klass}">{delta:+.4g}</span>'
        rows.append(
            [
                html.escape(algorithm),
                _number(original, 4),
                _number(augmented, 4),
                change,
                _number(_get(pair, "original", "normalised_score")),
                _number(_get(pair, "augmented", "normalised_score")),
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
            _number(weights.get("n")),
            _number(weights.get("ess")),
            _number(weights.get("ess_fraction")),
            _percent(weights.get("clipped_fraction")),
        ]
    ]
    shards = [
        [
            html.escape(str(s.get("shard"))),
            _number(s.get("n")),
            _number(s.get("ess")),
            _number(s.get("ess_fraction")),
            _percent(s.get("clipped_fraction")),
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
            + ", ".join(f"q{lv:g} = {_number(v)}" for lv, v in zip(levels, values, strict=True))
            + f"; episode ESS/N = {_number(episodes.get('ess_fraction'))}.</p>"
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
        [label, _number(_get(data, "original", *keys)), _number(_get(data, "augmented", *keys))]
        for label, keys in fields
    ]
    parts = [
        _table(["", "original", "augmented"], rows),
        f"<p>γ = {_number(data.get('gamma'))}, effective horizon 1/(1−γ) = "
        f"{_number(data.get('effective_horizon'))} steps.</p>",
    ]
    if "returns" in plots:
        parts.append(_figure_html(plots["returns"]))
    return "".join(parts)


def _coverage_html(coverage: Mapping[str, Any] | None, plots: Mapping[str, Plot]) -> str:
    if not coverage:
        return _missing("No augmented data: no coverage check.")
    violation = coverage.get("range_violation") or {}
    rows = [
        ["k", _number(coverage["k"])],
        ["quantile", _number(coverage["quantile"])],
        ["threshold (standardised distance)", _number(coverage["threshold"])],
        ["OOD fraction", _number(coverage["ood_fraction"])],
        ["states (original / augmented)", _states(coverage.get("states"))],
        ["outside the original range in any dimension", _percent(violation.get("any_dimension"))],
        [
            "worst dimension",
            f"{_number(violation.get('worst_dimension'))} "
            f"({_percent(violation.get('worst_fraction'))})",
        ],
    ]
    parts = [_table(["", "value"], rows)]
    if "coverage" in plots:
        parts.append(_figure_html(plots["coverage"]))
    return "".join(parts)


def _states(states: Mapping[str, Any] | None) -> str:
    if not states:
        return "—"
    return f"{_number(states.get('original'))} / {_number(states.get('augmented'))}"


def _divergence_html(divergence: Mapping[str, Any] | None) -> str:
    if not divergence:
        return _missing("No divergence check.")
    rows = [
        [
            html.escape(name),
            html.escape(str(entry.get("kind"))),
            _number(entry.get("nll")),
            _number(entry.get("kl_monte_carlo")),
            _number(entry.get("kl_on_rollout_states")),
            _number(entry.get("action_distance")),
        ]
        for name, entry in (divergence.get("policies") or {}).items()
    ]
    header = ["policy", "kind", "−E log β̂(π(s)|s)", "KL (MC)", "KL on rollout", "action dist."]
    return (
        f"<p>{_number(divergence.get('states'))} dataset states; dataset actions have "
        f"−E log β̂(a|s) = {_number(divergence.get('dataset_nll'))} (the reference level). "
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
                    _number(gap.get("q_mean")),
                    _number(gap.get("mc_mean")),
                    _number(gap.get("gap_mean")),
                    _number(gap.get("complete_gap_mean")),
                    _percent(gap.get("overestimated_fraction")),
                ]
            )
    random_rows = [
        [
            html.escape(name),
            _number(_get(entry, "random_actions", "q_dataset_actions")),
            _number(_get(entry, "random_actions", "q_random_actions")),
            _number(_get(entry, "random_actions", "difference")),
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
            _number(entry.get("true_discounted_return")),
            _number(entry.get("fqe")),
            _number(entry.get("wpdis")),
            _number(entry.get("wpdis_ess_fraction")),
        ]
        for name, entry in entries.items()
    ]
    note = (
        f'<p class="note">FQE: {_number(settings.get("fqe_steps"))} steps, τ = '
        f"{_number(settings.get('fqe_tau'))}. WPDIS stands a deterministic policy in with a "
        f"Gaussian of σ = {_number(settings.get('target_sigma'))} (normalised box) around π(s). "
        "Both start from the dataset's episode starts; the truth is the mean discounted return "
        "of fresh evaluation episodes.</p>"
    )
    header = ["policy", "true discounted return", "FQE", "WPDIS", "WPDIS ESS/N"]
    return _table(header, rows) + note


def _ranking_html(ranking: Sequence[Mapping[str, Any]] | None) -> str:
    if not ranking:
        return _missing("No evaluation episodes (no environment or no trained policy).")
    rows = [
        [
            html.escape(str(entry.get("name"))),
            _number(entry.get("rank")),
            _number(entry.get("mean_return"), 4),
            _number(entry.get("mean_length"), 4),
            _percent(entry.get("success_rate")),
        ]
        for entry in ranking
    ]
    return _table(["policy", "rank", "mean return", "mean length", "success"], rows)


def render_html(metrics: Mapping[str, Any], *, title: str = "offaug run report") -> str:
    """The report as one HTML string (what :func:`write_report` writes)."""
    diagnostics = metrics.get("diagnostics") or {}
    plots = {plot.key: plot for plot in render_plots(metrics)}
    head_rows = [[html.escape(label), html.escape(value)] for label, value in headline(metrics)]
    timings = diagnostics.get("timings") or {}
    sections = [
        ("Headline", _table(None, head_rows, "headline") if head_rows else _missing("—")),
        ("Scores", _scores_html(metrics.get("training") or {})),
        ("Importance weights", _weights_html(diagnostics.get("weights"), plots)),
        ("Data", _data_html(diagnostics.get("data"), plots)),
        ("State coverage", _coverage_html(diagnostics.get("coverage"), plots)),
        ("Policy divergence from β̂", _divergence_html(diagnostics.get("divergence"))),
        ("Value over-estimation", _value_html(diagnostics.get("value"), plots)),
        ("Off-policy evaluation", _ope_html(diagnostics.get("ope"))),
        ("Policy ranking", _ranking_html(diagnostics.get("ranking"))),
    ]
    body = "".join(f"<h2>{html.escape(name)}</h2>{content}" for name, content in sections)
    if timings:
        body += '<p class="note">Diagnostics took ' + ", ".join(
            f"{html.escape(str(k))} {_number(v, 2)} s" for k, v in timings.items()
        )
        body += ".</p>"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def write_report(metrics: Mapping[str, Any], out_html: Path) -> Path:
    """Write the self-contained HTML report atomically (temporary name, then rename).

    Args:
        metrics: The run's metrics (module docstring).
        out_html: The file to write; its directory is created.

    Returns:
        ``out_html``.
    """
    final = Path(out_html)
    final.parent.mkdir(parents=True, exist_ok=True)
    text = render_html(metrics)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def report_run(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html`` from ``RUN_DIR/metrics.json`` (``offaug report``).

    Raises:
        FileNotFoundError: no ``metrics.json``.
    """
    import json

    from offaug.pipeline.layout import RunLayout

    layout = RunLayout(Path(run_dir))
    if not layout.metrics.is_file():
        raise FileNotFoundError(f"{layout.metrics}: no metrics; run the workflow first")
    return write_report(json.loads(layout.metrics.read_text()), layout.report)
