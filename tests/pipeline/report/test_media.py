"""The report's Videos and Dataset doctor sections: animations that play in headless Chromium,
the size bound, the line that stands in for videos without OpenGL, and the doctor's findings.

The clips are real GIF files written by :func:`offaug.pipeline.media.video.write_video` from small
drawn frames (a square moving across, or noise that compresses badly); the media stages' own
rendering is tested in ``tests/pipeline/test_media_stages.py``.
"""

from __future__ import annotations

import html
import io
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from offaug.datasets.doctor import diagnose_dataset
from offaug.pipeline.media.video import write_video
from offaug.pipeline.report import render_html, write_report
from tests.datasets.test_doctor import clean_dataset
from tests.pipeline.report.browser import Browser
from tests.pipeline.report.metrics import full_metrics

WIDTH, HEIGHT = 96, 72


def _moving_square(frames: int = 8) -> np.ndarray:
    video = np.full((frames, HEIGHT, WIDTH, 3), 230, dtype=np.uint8)
    for index in range(frames):
        left = index * (WIDTH - 16) // max(1, frames - 1)
        video[index, 28:44, left : left + 16] = (200, 30, 30)
    return video


def _noise(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(frames, HEIGHT, WIDTH, 3), dtype=np.uint8)


def _clip(path: Path, frames: np.ndarray, fps: float, label: str) -> dict[str, Any]:
    write_video(frames, path, fps)
    return {
        "path": str(path),
        "label": label,
        "frames": len(frames),
        "width": WIDTH,
        "height": HEIGHT,
        "fps": fps,
        "bytes": path.stat().st_size,
        "episode_return": 12.5,
        "length": 40,
    }


def _videos(clips: dict[str, list[dict[str, Any]]], mb: float = 20) -> Any:
    return {
        "policies": {name: {"clips": c} for name, c in clips.items()},
        "data": None,
        "max_report_mb": mb,
    }


def _pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_the_animation_plays_in_headless_chromium(tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not on PATH (CI installs Debian's chromium package)")
    clip = _clip(tmp_path / "square.gif", _moving_square(16), 10.0, "best")
    page = write_report({"videos": _videos({"bc-plain": [clip]})}, tmp_path / "r.html")
    assert '<img src="data:image/gif;base64,' in page.read_text(encoding="utf-8")
    # Tall enough to hold the video below the report's opening sections.
    browser = Browser(chromium, tmp_path / "profile", page, size="800,1600")
    try:
        time.sleep(1.0)  # loaded and playing
        early = _pixels(browser.screenshot())
        time.sleep(0.3)  # three frames on: the loop lasts 1.6 s
        later = _pixels(browser.screenshot())
    finally:
        browser.close()
    changed = np.abs(early - later).sum(axis=-1) > 0
    rows, columns = np.nonzero(changed)
    assert len(rows) > 100  # the square moved
    # Only the video's region changed: the changed pixels fit in one frame's box.
    assert rows.max() - rows.min() < HEIGHT and columns.max() - columns.min() < WIDTH


def test_without_opengl_the_report_says_so_in_one_line() -> None:
    reason = "no offscreen OpenGL for MuJoCo (egl: ...); install Mesa's EGL or OSMesa"
    videos = {
        "policies": {"bc-plain": {"policy": "bc-plain", "unavailable": reason}},
        "data": {"unavailable": reason},
        "max_report_mb": 20,
    }
    metrics = full_metrics()
    with_videos = render_html({**metrics, "videos": videos})
    section = with_videos.split("<h2>Videos</h2>", 1)[1].split("<h2>", 1)[0]
    assert section == f'<p class="missing">No videos: {html.escape(reason)}</p>'
    # Everything else is as without the videos.
    without = render_html({**metrics, "videos": None}).split("<h2>Videos</h2>", 1)
    assert with_videos.split("<h2>Videos</h2>", 1)[0] == without[0]
    assert with_videos.split(section, 1)[1] == without[1].split("</p>", 1)[1]


def test_the_size_bound_drops_frames_then_episodes_and_says_so(tmp_path: Path) -> None:
    small = _clip(tmp_path / "square.gif", _moving_square(), 10.0, "best")
    large = _clip(tmp_path / "noise.gif", _noise(16), 10.0, "worst")
    base = len(render_html({"videos": _videos({})}).encode())
    # Room for the small clip and about half of the large one.
    limit = base + small["bytes"] * 4 // 3 + large["bytes"] * 2 // 3 + 4000
    videos = _videos({"bc-plain": [small, large]}, mb=limit / 1e6)
    report = write_report({"videos": videos}, tmp_path / "bounded.html")
    text = report.read_text(encoding="utf-8")
    assert report.stat().st_size <= limit
    assert text.count('<img src="data:image/gif;base64,') == 2
    assert f"To keep the report under {limit / 1e6:g} MB it shows: bc-plain worst: every" in text
    assert "bc-plain best" not in text.split("To keep the report", 1)[1]  # shown whole

    tight = _videos({"bc-plain": [small, large]}, mb=(base + 3000) / 1e6)
    squeezed = write_report({"videos": tight}, tmp_path / "tight.html")
    assert squeezed.stat().st_size <= base + 3000
    assert "left out" in squeezed.read_text(encoding="utf-8")


def test_a_missing_video_file_is_left_out_and_named(tmp_path: Path) -> None:
    clip = _clip(tmp_path / "square.gif", _moving_square(), 10.0, "best")
    Path(clip["path"]).unlink()
    text = render_html({"videos": _videos({"bc-plain": [clip]})})
    assert "<img" not in text and "left out (its file" in text


def test_the_doctor_section_lists_the_findings() -> None:
    clean = clean_dataset()
    scaled = clean.with_columns(rewards=(clean.rewards * 1000).astype(np.float32))
    doctor = {
        "gamma": 0.99,
        "source": diagnose_dataset(clean).to_json(),
        "augmented": diagnose_dataset(scaled).to_json(),
    }
    text = render_html({"doctor": doctor})
    section = text.split("<h2>Dataset doctor</h2>", 1)[1].split("<h2>", 1)[0]
    augmented = section.split("<h3>Augmented data</h3>", 1)[1]
    assert '<tr class="warning"><td>warning</td><td>reward-scale</td>' in augmented
    assert "worst finding: <b>warning</b>" in augmented
    assert "reward-scale" in section.split("<h3>Augmented data</h3>", 1)[0]  # info on source
    assert "No dataset doctor findings" in render_html({})
