"""The HTML page: self-contained, rendered by a real browser, written atomically.

The browser check runs when Debian's ``chromium`` is on PATH (CI installs it) and is skipped
with the reason otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from offaug.pipeline import diagnostics as diag
from offaug.pipeline.report import headline, render_html, render_plots, write_report
from offaug.pipeline.schema.rank_metric import parse_rank_metric


def test_report_is_self_contained(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    assert "<script" not in text and "<link" not in text
    assert "<style>" in text
    for heading in ("Headline", "Scores", "Importance weights", "State coverage", "Policy ranking"):
        assert f"<h2>{heading}</h2>" in text


def test_missing_sections_are_reported_not_failed(tmp_path: Path) -> None:
    empty = write_report({}, tmp_path / "empty.html").read_text(encoding="utf-8")
    assert "<img" not in empty
    assert "No augmented data" in empty
    only_training = {"training": {"bc-plain": {"return": 1.0, "normalised_score": None}}}
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


def test_ranking_shows_the_weighted_score_when_there_is_one() -> None:
    results = [
        {"name": name, "returns": r, "successes": [1, 0], "lengths": [5, 9]}
        | {"mean_return": sum(r) / 2, "success_rate": 0.5, "mean_length": 7.0}
        for name, r in (("good", [9.0, 8.0]), ("bad", [1.0, 2.0]))
    ]
    plain = render_html({"diagnostics": {"ranking": diag.rank_results(results)}})
    assert "weighted score" not in plain
    ranking = diag.rank_results(results, parse_rank_metric("return:0.8,-length:0.2"))
    page = render_html({"diagnostics": {"ranking": diag.jsonable(ranking)}})
    assert "weighted score [95 % CI]" in page
    assert "return:0.8,-length:0.2" in page
    assert page.index("good") < page.index("bad")
