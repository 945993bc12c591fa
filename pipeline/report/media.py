"""The report's media sections: animations of the trained policies and of the data, fitted to
the report's size bound, and the dataset doctor's findings.

The videos are the GIF files the media stages wrote (:mod:`offaug.pipeline.stages.media`),
embedded as data URIs. Together they get what the rest of the page leaves of
``max_report_mb``: clips are fitted smallest first, each to an equal share of what is left
(so a small clip's unused share goes to the larger ones). A clip over its share keeps every
2nd, 4th, ... frame, then half or a quarter of its resolution, and is left out when even two
frames at a quarter of its size do not fit; the section says what was cut. The files
themselves keep every frame.
"""

from __future__ import annotations

import base64
import dataclasses
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
from PIL import Image

from offaug.pipeline.report.formatting import number

MEGABYTE = 1_000_000
"""``max_report_mb`` counts units of 10^6 bytes."""
DEFAULT_MAX_REPORT_MB = 20.0
_GIF_PREFIX = "data:image/gif;base64,"
_MARKUP_PER_CLIP = 800
"""Bytes kept aside per clip for its figure, caption and a line of the size note."""
_SCALES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class _Clip:
    group: str
    order: int
    clip: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class _Fitted:
    data_uri: str | None
    """None: left out."""
    cut: str
    """What was dropped to fit ("" for nothing; the reason when left out)."""


def _uri_length(size: int) -> int:
    return len(_GIF_PREFIX) + 4 * ((size + 2) // 3)


def _data_uri(encoded: bytes) -> str:
    return _GIF_PREFIX + base64.b64encode(encoded).decode("ascii")


def _fit(clip: Mapping[str, Any], budget: int) -> _Fitted:
    """The clip's GIF as a data URI of at most ``budget`` characters, cut down if it must be."""
    path = Path(str(clip.get("path")))
    if not path.is_file():
        return _Fitted(None, f"its file {path} is missing")
    encoded = path.read_bytes()
    if _uri_length(len(encoded)) <= budget:
        return _Fitted(_data_uri(encoded), "")
    # Imported only to re-encode: pipeline.video pulls in the renderer, and so torch.
    from offaug.pipeline.media.render import RenderedEpisode
    from offaug.pipeline.media.video import episode_animation

    frames = np.asarray(iio.imread(path, index=None), dtype=np.uint8)[..., :3]
    fps = float(clip.get("fps") or 10.0)
    max_bytes = max(0, (budget - len(_GIF_PREFIX)) * 3 // 4)
    for scale in _SCALES:
        height, width = frames.shape[1] // scale, frames.shape[2] // scale
        smaller = frames
        if scale > 1:
            smaller = np.stack(
                [np.asarray(Image.fromarray(f).resize((width, height))) for f in frames]
            )
        episode = RenderedEpisode(smaller, 0.0, len(frames), 0, fps, 0.0)
        animation = episode_animation(episode, max_bytes=max_bytes)
        if animation.bytes <= max_bytes:
            cuts = []
            if animation.frame_step > 1:
                cuts.append(f"every {_ordinal(animation.frame_step)} frame")
            if scale > 1:
                cuts.append(f"1/{scale} of the resolution")
            return _Fitted(animation.data_uri, " at ".join(cuts))
    return _Fitted(None, "even two frames at 1/4 of the resolution do not fit")


def _ordinal(n: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _caption(clip: Mapping[str, Any]) -> str:
    label = html.escape(str(clip.get("label", "")))
    text = f"{label}: return {number(clip.get('episode_return'), 4)}, {clip.get('length')} steps"
    recorded = clip.get("evaluation_return")
    if recorded is not None:
        text += f" (the evaluation recorded {number(recorded, 4)})"
    if clip.get("start_row") is not None:
        text += f"; branched from dataset row {clip['start_row']}"
    error = clip.get("replay_error")
    if error:
        text += f"; replay differs from the record by up to {number(error)}"
    return text


def _groups(videos: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(title, video set)`` per trained policy, then original and augmented data."""
    groups: list[tuple[str, Mapping[str, Any]]] = [
        (str(name), record or {}) for name, record in (videos.get("policies") or {}).items()
    ]
    data = videos.get("data")
    if data:
        if data.get("unavailable"):
            groups.append(("data", data))
        else:
            groups.append(("original data", data.get("original") or {}))
            groups.append(("augmented data", data.get("augmented") or {}))
    return groups


def _fit_all(clips: Sequence[_Clip], budget: int) -> dict[int, _Fitted]:
    """Fit every clip, smallest file first, each to an equal share of the budget left."""
    by_size = sorted(range(len(clips)), key=lambda i: int(clips[i].clip.get("bytes") or 0))
    left = budget - _MARKUP_PER_CLIP * len(clips)
    fitted: dict[int, _Fitted] = {}
    for position, index in enumerate(by_size):
        share = max(0, left // (len(by_size) - position))
        result = _fit(clips[index].clip, share)
        fitted[index] = result
        if result.data_uri is not None:
            left -= len(result.data_uri)
    return fitted


def videos_html(videos: Mapping[str, Any] | None, budget: int) -> str:
    """The Videos section, its animations taking at most ``budget`` bytes of the page."""
    if not videos:
        return '<p class="missing">No videos (the workflow\'s report.videos is off).</p>'
    groups = _groups(videos)
    clips = [
        _Clip(title, order, clip)
        for title, record in groups
        for order, clip in enumerate(record.get("clips") or [])
    ]
    if not clips:
        reasons = {str(r.get("unavailable")) for _, r in groups if r.get("unavailable")}
        if len(reasons) == 1:
            return f'<p class="missing">No videos: {html.escape(reasons.pop())}</p>'
        if not reasons:
            return '<p class="missing">No videos: nothing was filmed.</p>'
    fitted = _fit_all(clips, budget)
    parts = []
    for title, record in groups:
        parts.append(f"<h3>{html.escape(title)}</h3>")
        if record.get("unavailable"):
            parts.append(f'<p class="missing">Not filmed: {html.escape(record["unavailable"])}</p>')
            continue
        if record.get("method"):
            parts.append(f'<p class="note">Shown from {html.escape(record["method"])}.</p>')
        figures = []
        for index, clip in enumerate(clips):
            if clip.group != title or fitted[index].data_uri is None:
                continue
            size = f'width="{clip.clip.get("width")}" height="{clip.clip.get("height")}"'
            figures.append(
                f'<figure><img src="{fitted[index].data_uri}" {size} '
                f'alt="{html.escape(title)} {html.escape(str(clip.clip.get("label")))}">'
                f"<figcaption>{_caption(clip.clip)}</figcaption></figure>"
            )
        parts.append(f'<div class="clips">{"".join(figures)}</div>')
    limit = float(videos.get("max_report_mb") or DEFAULT_MAX_REPORT_MB)
    cuts = [
        f"{html.escape(clip.group)} {html.escape(str(clip.clip.get('label')))}: "
        + (html.escape(fitted[i].cut) if fitted[i].data_uri else f"left out ({fitted[i].cut})")
        for i, clip in enumerate(clips)
        if fitted[i].cut
    ]
    if cuts:
        parts.append(
            f'<p class="note">To keep the report under {limit:g} MB it shows: '
            + "; ".join(cuts)
            + ". The GIF files in the run's videos/ folder keep every frame.</p>"
        )
    return "".join(parts)


def best_video_html(best: Mapping[str, Any] | None, budget: int) -> str:
    """The best policy's section: its arm and its best evaluation episode, within ``budget``
    bytes of the page."""
    if not best:
        return '<p class="missing">Not filmed (the workflow\'s report.best_video is off).</p>'
    arm = best.get("arm") or {}
    clips = best.get("clips") or []
    if arm:
        metric = "normalised score" if arm.get("metric") == "normalised_score" else "return"
        text = (
            f"<b>{html.escape(str(arm.get('learner')))} with"
            f" {html.escape(str(arm.get('recipe')))}</b>: IQM {metric}"
            f" {number(arm.get('iqm'), 4)} over {arm.get('seeds')} seed(s), the highest of the"
            f" study; seed {arm.get('seed')}'s run scored {number(arm.get('score'), 4)}."
        )
        parts = [f"<p>{text}</p>"]
    else:
        parts = []
    if best.get("unavailable") or not clips:
        why = best.get("unavailable") or "nothing was filmed"
        return "".join(parts) + f'<p class="missing">Not filmed: {html.escape(str(why))}</p>'
    clip = clips[0]
    fitted = _fit(clip, max(0, budget - _MARKUP_PER_CLIP))
    if fitted.data_uri is None:
        return "".join(parts) + f'<p class="missing">Left out: {html.escape(fitted.cut)}.</p>'
    size = f'width="{clip.get("width")}" height="{clip.get("height")}"'
    cut = f" (shown at {html.escape(fitted.cut)})" if fitted.cut else ""
    parts.append(
        f'<div class="clips"><figure><img src="{fitted.data_uri}" {size} alt="the best policy">'
        f"<figcaption>{_caption(clip)}{cut}</figcaption></figure></div>"
    )
    return "".join(parts)


def doctor_html(doctor: Mapping[str, Any] | None) -> str:
    """The Dataset doctor section: the findings on the source and on the augmented data."""
    if not doctor:
        return '<p class="missing">No dataset doctor findings (the workflow\'s report.doctor).</p>'
    parts = []
    for key, title in (("source", "Source data"), ("augmented", "Augmented data")):
        report = doctor.get(key)
        parts.append(f"<h3>{title}</h3>")
        if not report:
            parts.append('<p class="missing">No augmented data.</p>')
            continue
        facts = report.get("facts") or {}
        parts.append(
            f"<p>{number(facts.get('steps'))} steps in {number(facts.get('episodes'))} episodes; "
            f"γ = {number(facts.get('gamma'))}, T_eff = {number(facts.get('t_eff'))} steps; "
            f"worst finding: <b>{html.escape(str(report.get('worst')))}</b>.</p>"
        )
        rows = [
            f'<tr class="{html.escape(str(f.get("severity")))}">'
            f"<td>{html.escape(str(f.get('severity')))}</td>"
            f"<td>{html.escape(str(f.get('code')))}</td>"
            f"<td>{html.escape(str(f.get('message')))}</td>"
            f"<td>{html.escape(str(f.get('advice') or ''))}</td></tr>"
            for f in report.get("findings") or []
        ]
        if not rows:
            parts.append('<p class="note">No findings.</p>')
            continue
        head = "<tr><th>severity</th><th>check</th><th>what it saw</th><th>what to do</th></tr>"
        parts.append(
            f'<table class="doctor"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'
        )
    return "".join(parts)
