"""Encoding filmed episodes: animated GIF (Pillow) or MP4/WebM (imageio-ffmpeg), as files or as
size-bounded data URIs for a self-contained HTML page.

```python
animation = episode_animation(episode, max_bytes=2_000_000)
html = f"<figure>{animation.html}<figcaption>return {episode.episode_return:.1f}</figcaption>"
```
"""

from __future__ import annotations

import base64
import dataclasses
import tempfile
from pathlib import Path
from typing import Literal

import imageio.v3 as iio
import numpy as np
import numpy.typing as npt

from offaug.datasets.atomic import write_bytes_atomic
from offaug.pipeline.media.render import RenderedEpisode

VideoFormat = Literal["gif", "mp4", "webm"]
MIME_TYPES: dict[VideoFormat, str] = {"gif": "image/gif", "mp4": "video/mp4", "webm": "video/webm"}
_CODECS: dict[VideoFormat, str] = {"mp4": "libx264", "webm": "libvpx-vp9"}


@dataclasses.dataclass(frozen=True)
class Animation:
    """An encoded animation ready to embed in an HTML page."""

    data_uri: str
    """``data:image/gif;base64,...`` (or ``video/mp4``, ``video/webm``)."""
    bytes: int
    """Size of the encoded file (its data URI is about 4/3 of it)."""
    frames: int
    seconds: float
    """Playing time."""
    mime: str
    width: int
    height: int
    frame_step: int
    """1 when every filmed frame is kept; k when only every k-th fitted ``max_bytes``."""

    @property
    def html(self) -> str:
        """An ``<img>`` (GIF) or an autoplaying, looping, muted ``<video>`` element."""
        size = f'width="{self.width}" height="{self.height}"'
        if self.mime == "image/gif":
            return f'<img src="{self.data_uri}" {size} alt="episode animation">'
        return f'<video src="{self.data_uri}" {size} autoplay loop muted playsinline></video>'


def video_format(path: str | Path) -> VideoFormat:
    """The format a file name asks for (``.gif``, ``.mp4`` or ``.webm``)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    for video in MIME_TYPES:
        if suffix == video:
            return video
    raise ValueError(f"{path}: a video file must end in .gif, .mp4 or .webm")


def encode_frames(frames: npt.NDArray[np.uint8], fps: float, video: VideoFormat = "gif") -> bytes:
    """``frames`` (F, H, W, 3) as the bytes of an animated GIF (looping) or an MP4/WebM file."""
    if video == "gif":
        encoded: bytes = iio.imwrite(
            "<bytes>", frames, extension=".gif", duration=1000.0 / fps, loop=0
        )
        return encoded
    # imageio's ffmpeg writer works on files only.
    with tempfile.TemporaryDirectory(prefix="offaug-video-") as scratch:
        path = Path(scratch) / f"video.{video}"
        _write_ffmpeg(path, frames, fps, video)
        return path.read_bytes()


def write_video(frames: npt.NDArray[np.uint8], path: str | Path, fps: float) -> Path:
    """Write ``frames`` to ``path`` (the format from its suffix), atomically."""
    final = Path(path)
    encoded = encode_frames(frames, fps, video_format(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(final, encoded)
    return final


def episode_animation(
    episode: RenderedEpisode,
    *,
    video: VideoFormat = "gif",
    max_bytes: int | None = 2_000_000,
    fps: float | None = None,
) -> Animation:
    """An embeddable animation of ``episode``, at most ``max_bytes`` when given.

    When the encoding is too large, every second frame is dropped (each shown twice as long,
    so the playing time stays) until it fits or two frames are left.
    """
    frames = episode.frames
    rate = fps or episode.fps
    step = 1
    while True:
        kept = frames[::step]
        encoded = encode_frames(kept, rate / step, video)
        if max_bytes is None or len(encoded) <= max_bytes or len(kept) <= 2:
            break
        step *= 2
    mime = MIME_TYPES[video]
    return Animation(
        data_uri=f"data:{mime};base64,{base64.b64encode(encoded).decode('ascii')}",
        bytes=len(encoded),
        frames=len(kept),
        seconds=len(kept) * step / rate,
        mime=mime,
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        frame_step=step,
    )


def _write_ffmpeg(
    path: Path, frames: npt.NDArray[np.uint8], fps: float, video: VideoFormat
) -> None:
    # yuv420p (what browsers play) needs even sizes; a macro block of 2 keeps the frame's own.
    iio.imwrite(path, frames, plugin="FFMPEG", fps=fps, codec=_CODECS[video], macro_block_size=2)
