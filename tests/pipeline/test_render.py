"""Offscreen videos: a real MuJoCo env (Hopper-v5) through EGL/OSMesa, GIF and MP4 files read
back with imageio, embeddable animations, and `offaug render` on a tiny BC checkpoint.

Rendering is slow on a software renderer, so every test films a handful of frames.
"""

from __future__ import annotations

import base64
import itertools
import os
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import pytest
from typer.testing import CliRunner

from offaug.algorithms.training.loop import train
from offaug.algorithms.training.options import TrainOptions
from offaug.cli import app
from offaug.pipeline.media.render import (
    RenderUnavailable,
    VideoOptions,
    gl_backend,
    make_render_env,
    render_episodes,
)
from offaug.pipeline.media.video import encode_frames, episode_animation, write_video

runner = CliRunner()
FRAMES = 4


@pytest.fixture(scope="module")
def opengl() -> str:
    """The offscreen GL backend (.ci/run installs Mesa; without it these tests skip)."""
    try:
        return gl_backend()
    except RenderUnavailable as exc:
        pytest.skip(str(exc))


def _random_policy(env: Any, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    low, high = env.action_space.low, env.action_space.high

    def act(observations: np.ndarray) -> np.ndarray:
        return rng.uniform(low, high, size=(len(observations), len(low))).astype(np.float32)

    return act


@pytest.fixture(scope="module")
def hopper_episode(opengl: str) -> Any:
    options = VideoOptions(width=96, height=72, frame_skip=3, max_frames=FRAMES)
    env = make_render_env({}, "Hopper-v5", options)
    try:
        (episode,) = render_episodes(_random_policy(env), env, episodes=1, seed=3, options=options)
    finally:
        env.close()
    return episode


def test_hopper_renders_offscreen_frames_that_differ(opengl: str, hopper_episode: Any) -> None:
    assert os.environ["MUJOCO_GL"] == opengl
    frames = hopper_episode.frames
    assert frames.shape == (FRAMES, 72, 96, 3) and frames.dtype == np.uint8
    assert frames.std() > 5  # a scene, not a blank buffer
    for earlier, later in itertools.pairwise(frames):
        assert np.abs(earlier.astype(int) - later.astype(int)).mean() > 0.1
    # The episode runs to its end (a random hopper falls) even after the last filmed frame.
    assert hopper_episode.length > (FRAMES - 1) * 3
    assert hopper_episode.fps == pytest.approx(125 / 3)


def test_gif_and_mp4_files_read_back_with_every_frame(hopper_episode: Any, tmp_path: Path) -> None:
    frames = hopper_episode.frames
    gif = write_video(frames, tmp_path / "episode.gif", hopper_episode.fps)
    assert iio.imread(gif, index=None).shape == frames.shape
    mp4 = write_video(frames, tmp_path / "episode.mp4", hopper_episode.fps)
    assert iio.imread(mp4, plugin="FFMPEG", index=None).shape == frames.shape
    assert not list(tmp_path.glob(".*"))  # written through a temporary name
    with pytest.raises(ValueError, match=r"\.gif, \.mp4 or \.webm"):
        write_video(frames, tmp_path / "episode.avi", 10.0)


def test_episode_animation_is_an_embeddable_size_bounded_data_uri(hopper_episode: Any) -> None:
    animation = episode_animation(hopper_episode)
    assert animation.mime == "image/gif" and animation.frames == FRAMES
    header, payload = animation.data_uri.split(",", 1)
    assert header == "data:image/gif;base64"
    assert len(base64.b64decode(payload)) == animation.bytes
    assert animation.html.startswith(f'<img src="{animation.data_uri[:40]}')
    assert animation.seconds == pytest.approx(FRAMES / hopper_episode.fps)

    full = len(encode_frames(hopper_episode.frames, hopper_episode.fps))
    bounded = episode_animation(hopper_episode, max_bytes=full - 1)
    assert bounded.frame_step == 2 and bounded.frames == FRAMES // 2
    assert bounded.bytes < full
    video = episode_animation(hopper_episode, video="mp4")
    assert video.data_uri.startswith("data:video/mp4;base64,") and "<video" in video.html


def test_an_env_without_frames_says_so() -> None:
    with pytest.raises(RenderUnavailable, match="no rgb_array render mode"):
        make_render_env({}, "offaug/PointGoal-v0", VideoOptions())


def test_cli_render_films_a_tiny_checkpoint(
    opengl: str, make_test_dataset: Any, tmp_path: Path
) -> None:
    dataset = make_test_dataset("hopper").dataset_id
    run = tmp_path / "bc"
    train("bc", [dataset], run, options=TrainOptions(steps=20, log_every=10, eval_every=0))
    out = tmp_path / "videos" / "bc.gif"
    args = ["render", str(run), "--episodes", "2", "--max-frames", "3", "--size", "64x48"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    for index in range(2):
        frames = iio.imread(out.with_name(f"bc-{index}.gif"), index=None)
        assert frames.shape == (3, 48, 64, 3)

    single = runner.invoke(
        app, ["render", str(run / "checkpoints" / "step_20.pt"), "--max-frames", "2"]
    )
    assert single.exit_code == 0, single.output
    assert iio.imread(run / "videos" / "episode.gif", index=None).shape[0] == 2
    refused = runner.invoke(app, ["render", str(tmp_path / "missing")])
    assert refused.exit_code == 2 and "no such checkpoint" in refused.output
