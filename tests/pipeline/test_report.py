"""The HTML report: every plot embedded as a PNG, self-contained, rendered by a real browser.

The browser check runs when Debian's ``chromium`` is on PATH (CI installs it) and is skipped
with the reason otherwise.
"""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from offaug.datasets import Transitions
from offaug.pipeline import diagnostics as diag
from offaug.pipeline.report import headline, render_html, render_plots, write_report

IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _episodes(rng: np.random.Generator, lengths: list[int], shift: float) -> Transitions:
    n = sum(lengths)
    ids = np.repeat(np.arange(len(lengths)), lengths)
    observations = (rng.normal(size=(n, 3)) + shift).astype(np.float32)
    last = np.r_[ids[1:] != ids[:-1], True]
    log_ratio = rng.normal(0.0, 1.0, size=n)
    return Transitions(
        observations=observations,
        actions=rng.uniform(-1, 1, size=(n, 2)).astype(np.float32),
        rewards=rng.normal(1.0 + shift, 0.5, size=n).astype(np.float32),
        next_observations=observations,
        terminals=last & (rng.uniform(size=n) < 0.5),
        timeouts=last & ~(last & (rng.uniform(size=n) < 0.5)),
        episode_ids=ids.astype(np.int64),
        rollout_log_prob=np.zeros(n, dtype=np.float32),
        behaviour_log_prob=log_ratio.astype(np.float32),
        importance_weight=np.exp(np.minimum(log_ratio, np.log(10.0))).astype(np.float32),
    )


def full_metrics() -> dict[str, Any]:
    """A metrics dict with every section, made by the diagnostics' own functions."""
    rng = np.random.default_rng(0)
    original = _episodes(rng, [20, 35, 50, 12, 40, 33], 0.0)
    augmented = _episodes(rng, [15, 25, 30, 10], 0.7)
    mc = diag.discounted_returns(original.rewards, original.episode_ids, 0.99)
    q = mc + rng.normal(5.0, 2.0, size=len(mc))
    value_entry = {
        "dataset": diag.value_gap(q, mc),
        "rollout": diag.value_gap(q[:50] - 10, mc[:50]),
        "random_actions": {"q_dataset_actions": 3.0, "q_random_actions": 1.0, "difference": -2.0},
        "scatter": {
            "dataset": {"q": q.tolist(), "mc": mc.tolist()},
            "rollout": {"q": (q[:50] - 10).tolist(), "mc": mc[:50].tolist()},
        },
    }
    diagnostics = {
        "data": diag.data_section(original, augmented, 0.99, 20),
        "weights": diag.importance_weight_diagnostics([("shard-00000.arrow", augmented)], 10.0, 20),
        "coverage": diag.state_coverage(
            original.observations,
            augmented.observations,
            k=3,
            quantile=0.9,
            max_states=1000,
            rng=rng,
            bins=20,
        ),
        "divergence": {
            "states": 100,
            "dataset_nll": 1.5,
            "policies": {
                "bc": {"kind": "gaussian (beta_hat)", "nll": 1.2, "kl_monte_carlo": 0.0},
                "cql-augmented": {"kind": "deterministic (act)", "nll": 3.4},
            },
        },
        "value": {"cql-augmented": value_entry},
        "ope": {
            "settings": {"fqe_steps": 500, "fqe_tau": 0.1, "target_sigma": 0.2},
            "cql-augmented": {"fqe": 10.0, "wpdis": 8.0, "true_discounted_return": 9.0},
        },
        "ranking": diag.rank_results(
            [{"name": "cql-augmented", "mean_return": 9.0, "success_rate": 1.0, "mean_length": 30}]
        ),
        "timings": {"load": 0.5, "ope": 1.25},
    }
    return diag.jsonable(
        {
            "training": {
                "cql-original": {"return": 100.0, "normalised_score": 10.0},
                "cql-augmented": {"return": 120.5, "normalised_score": 12.0},
                "bcq-original": {"return": 90.0, "normalised_score": None},
            },
            "weights": {"n": 80, "ess_fraction": 0.4},
            "diagnostics": diagnostics,
        }
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(full_metrics(), tmp_path_factory.mktemp("report") / "report.html")


def test_every_plot_is_embedded_as_a_png(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    images = IMG.findall(text)
    plots = render_plots(full_metrics())
    assert [p.key for p in plots] == ["weights", "returns", "coverage", "value"]
    assert text.count('<img src="data:image/png;base64,') == len(plots) == len(images)
    for encoded in images:
        image = Image.open(io.BytesIO(base64.b64decode(encoded)))
        assert image.format == "PNG"
        image.verify()


def test_report_is_self_contained(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text and "<link" not in text
    assert "<style>" in text
    for heading in ("Headline", "Scores", "Importance weights", "State coverage", "Policy ranking"):
        assert f"<h2>{heading}</h2>" in text


def test_headline_numbers() -> None:
    rows = dict(headline(full_metrics()))
    assert rows["cql return, original → augmented"] == "100 → 120.5 (normalised 10 → 12)"
    assert rows["bcq return, original → augmented"] == "90 → —"
    assert rows["ESS/N of importance weights"].startswith("0.")
    assert "OOD fraction of augmented states" in rows
    assert rows["Q gap cql-augmented (Q − MC on data)"].startswith("+")


def test_missing_sections_are_reported_not_failed(tmp_path: Path) -> None:
    empty = write_report({}, tmp_path / "empty.html").read_text(encoding="utf-8")
    assert "<img" not in empty
    assert "No augmented data" in empty
    only_training = {"training": {"bc-original": {"return": 1.0, "normalised_score": None}}}
    assert render_plots(only_training) == []
    assert "bc return, original → augmented" in dict(headline(only_training))
    assert "bc" in render_html(only_training)


def test_written_atomically_over_an_old_report(tmp_path: Path) -> None:
    target = tmp_path / "out" / "report.html"
    target.parent.mkdir()
    target.write_text("old")
    write_report({}, target)
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]


def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (CI installs Debian's chromium package)")
    screenshot = tmp_path / "screenshot.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={screenshot}",
            "--window-size=1200,3000",
            report.absolute().as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert screenshot.is_file()
    with Image.open(screenshot) as image:
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 24) or []
        # Plots (anti-aliased lines, bars, scatter points) give hundreds of distinct colours;
        # a blank or text-only page gives far fewer.
        assert len(colours) > 200
        background = max(colours)[0] / (pixels.width * pixels.height)
        assert background < 0.97


def test_report_run_needs_metrics(tmp_path: Path) -> None:
    from offaug.pipeline.report import report_run

    with pytest.raises(FileNotFoundError, match=r"metrics\.json"):
        report_run(tmp_path)
