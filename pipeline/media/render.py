"""Offscreen videos of a policy's evaluation episodes: frames, files and embeddable animations.

Frames come from Gymnasium's ``render_mode="rgb_array"``. MuJoCo envs render offscreen through
OpenGL: ``MUJOCO_GL`` is used as the user set it; unset, offaug picks the first of EGL (Mesa's
software renderer where there is no GPU) and OSMesa that can make a context, probed once per
process in a child process (PyOpenGL fixes its platform at its first import, so a failed
attempt in this process would rule out the fallback), and exports the choice so that child
processes inherit it. Where neither works, :class:`RenderUnavailable` says what to install.

A video keeps every ``frame_skip``-th step's frame, at most ``max_frames`` per episode (the
episode itself runs to its end, so its return is complete), at a small size (160x120 by
default): rendering costs far more than stepping.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
from PIL import Image

from offaug.algorithms.evaluate import Policy, make_env
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.datasets.shards import ShardSet, is_shard_set
from offaug.datasets.sources import load_transitions

GL_BACKENDS: tuple[str, ...] = ("egl", "osmesa")
"""The offscreen OpenGL backends tried, in order, when ``MUJOCO_GL`` is unset."""
INSTALL_HINT = (
    "install Mesa's EGL or OSMesa (Debian/Ubuntu: apt-get install libegl1 libgl1-mesa-dri "
    "libegl-mesa0 libosmesa6), or set MUJOCO_GL to a backend that works here"
)
_PROBE = "from mujoco.{0} import GLContext\nc = GLContext(8, 8)\nc.make_current()\nc.free()\n"


class RenderUnavailable(RuntimeError):
    """The environment cannot render frames here (no OpenGL, or no rgb_array render mode)."""


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    """How episodes are filmed."""

    width: int = 160
    """Frame width in pixels."""
    height: int = 120
    """Frame height in pixels."""
    frame_skip: int = 4
    """Keep the frame of every k-th step (and the first)."""
    max_frames: int = 120
    """At most this many frames per episode; later steps run unfilmed."""
    max_steps: int | None = None
    """End an episode after this many steps (default: its own end or time limit)."""

    def __post_init__(self) -> None:
        for name in ("width", "height", "frame_skip", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class RenderedEpisode:
    """One filmed evaluation episode."""

    frames: npt.NDArray[np.uint8]  # (F, height, width, 3)
    episode_return: float
    length: int
    """Steps the episode ran (filmed or not)."""
    seed: int
    """The reset seed."""
    fps: float
    """Playback rate that shows the episode in real time (the env's fps over frame_skip)."""
    render_seconds: float
    """Wall time spent stepping and rendering it."""


@dataclasses.dataclass(frozen=True)
class PolicyTarget:
    """A checkpoint to film and the environment it acts in."""

    checkpoint: Path
    run_dir: Path | None
    """The training run directory holding ``config.json`` (None for a loose checkpoint)."""
    meta: Mapping[str, Any]
    """The training data's ``meta`` (its env spec); empty when ``env_id`` is given."""
    env_id: str | None


@functools.cache
def _probe(backend: str) -> str | None:
    """None when ``backend`` makes an OpenGL context in a fresh process, else why not."""
    environment = {**os.environ, "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend}
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE.format(backend)],
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if result.returncode == 0:
        return None
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def gl_backend() -> str:
    """The MuJoCo OpenGL backend to render with; sets ``MUJOCO_GL`` when it was unset.

    Raises:
        RenderUnavailable: no backend can make a context.
    """
    chosen = os.environ.get("MUJOCO_GL")
    if chosen:
        return chosen
    failures = {}
    for backend in GL_BACKENDS:
        failure = _probe(backend)
        if failure is None:
            os.environ["MUJOCO_GL"] = backend
            return backend
        failures[backend] = failure
    tried = "; ".join(f"{name}: {why}" for name, why in failures.items())
    raise RenderUnavailable(f"no offscreen OpenGL for MuJoCo ({tried}); {INSTALL_HINT}")


def make_render_env(meta: Mapping[str, Any], env_id: str | None, options: VideoOptions) -> Any:
    """The dataset's env (or ``env_id``) rendering ``rgb_array`` frames at the options' size."""
    probe = make_env(meta, env_id)
    modes = probe.metadata.get("render_modes") or ()
    name = probe.spec.id if probe.spec else type(probe.unwrapped).__name__
    mujoco = hasattr(probe.unwrapped, "mujoco_renderer")
    probe.close()
    if "rgb_array" not in modes:
        raise RenderUnavailable(f"{name} cannot render frames (no rgb_array render mode)")
    if not mujoco:
        # Classic control draws with pygame: offscreen, with no display or sound to look for
        # (SDL otherwise prints an XDG_RUNTIME_DIR error on a headless machine).
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
        return make_env(meta, env_id, render_mode="rgb_array")
    # MuJoCo renders at its construction-time size, and needs OpenGL before its first frame.
    gl_backend()
    return make_env(
        meta, env_id, render_mode="rgb_array", width=options.width, height=options.height
    )


def render_episodes(
    policy: Policy,
    env: Any,
    *,
    episodes: int = 1,
    seed: int = 0,
    options: VideoOptions | None = None,
) -> list[RenderedEpisode]:
    """Run ``episodes`` greedy episodes (reset seeds ``seed``, ``seed + 1``, ...) and film them.

    Raises:
        RenderUnavailable: the env's renderer cannot start (no OpenGL, a missing package).
    """
    options = options or VideoOptions()
    real_fps = float(env.metadata.get("render_fps") or 30)
    filmed = []
    for episode in range(episodes):
        started = time.perf_counter()
        observation, _ = env.reset(seed=seed + episode)
        frames = [render_frame(env, options)]
        total, steps, done = 0.0, 0, False
        while not done and (options.max_steps is None or steps < options.max_steps):
            action = policy(np.asarray(observation, dtype=np.float32)[None])[0]
            observation, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            steps += 1
            done = bool(terminated or truncated)
            if steps % options.frame_skip == 0 and len(frames) < options.max_frames:
                frames.append(render_frame(env, options))
        filmed.append(
            RenderedEpisode(
                frames=np.stack(frames),
                episode_return=total,
                length=steps,
                seed=seed + episode,
                fps=real_fps / options.frame_skip,
                render_seconds=time.perf_counter() - started,
            )
        )
    return filmed


def render_frame(env: Any, options: VideoOptions) -> npt.NDArray[np.uint8]:
    """The env's current frame at the options' size (RGB, uint8)."""
    try:
        frame: Any = env.render()
    except gym.error.DependencyNotInstalled as exc:
        raise RenderUnavailable(f"the env's renderer needs a package: {exc}") from exc
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:
        # What PyOpenGL and MuJoCo raise when the GL backend named by MUJOCO_GL cannot start.
        backend = os.environ.get("MUJOCO_GL")
        raise RenderUnavailable(
            f"rendering failed with MUJOCO_GL={backend}: {exc}; {INSTALL_HINT}"
        ) from exc
    image = np.asarray(frame, dtype=np.uint8)[..., :3]
    if image.shape[:2] != (options.height, options.width):
        resized = Image.fromarray(image).resize((options.width, options.height))
        image = np.asarray(resized, dtype=np.uint8)
    return image


def resolve_policy(path: str | Path, *, env_id: str | None = None) -> PolicyTarget:
    """The checkpoint behind ``path`` (a checkpoint file or a training run directory) and its env.

    The env is ``env_id``, else the one the run evaluated in (``config.json``: its ``env_id``
    option, else its first source dataset's env spec).

    Raises:
        FileNotFoundError: no checkpoint there, or no way to tell the environment.
    """
    given = Path(path)
    if given.is_dir():
        checkpoint = given / "checkpoint.pt"
        if not checkpoint.is_file():
            models = sorted(p.name for p in (given / "models").glob("*/checkpoint.pt"))
            hint = f"; pick a model: {', '.join(str(given / 'models' / m) for m in models)}"
            raise FileNotFoundError(f"{given}: no checkpoint.pt{hint if models else ''}")
    elif given.is_file():
        checkpoint = given
    else:
        raise FileNotFoundError(f"{given}: no such checkpoint or run directory")
    run_dir = run_dir_of(checkpoint)
    config = json.loads((run_dir / "config.json").read_text()) if run_dir else {}
    env_id = env_id or config.get("options", {}).get("env_id")
    if env_id is not None:
        return PolicyTarget(checkpoint, run_dir, {}, env_id)
    sources = [s for s in config.get("sources", []) if s != "<in-memory>"]
    if not sources:
        raise FileNotFoundError(
            f"{checkpoint}: its run records no dataset to take the environment from; pass an "
            "env id (--env)"
        )
    return PolicyTarget(checkpoint, run_dir, _dataset_meta(sources[0]), None)


def run_dir_of(checkpoint: Path) -> Path | None:
    """The training run directory a checkpoint belongs to (None for a loose checkpoint)."""
    # A run's latest checkpoint sits in it; the numbered ones in its checkpoints/ folder.
    candidates = (checkpoint.parent, checkpoint.parent.parent)
    return next((d for d in candidates if (d / "config.json").is_file()), None)


def default_video_path(policy: Path) -> Path:
    """``videos/episode.gif`` in the policy's run directory (or beside a loose checkpoint)."""
    base = policy if policy.is_dir() else run_dir_of(policy) or policy.parent
    return base / "videos" / "episode.gif"


def render_checkpoint(
    path: str | Path,
    *,
    episodes: int = 1,
    seed: int = 0,
    options: VideoOptions | None = None,
    env_id: str | None = None,
) -> list[RenderedEpisode]:
    """Film ``episodes`` greedy episodes of the policy at ``path`` (see :func:`resolve_policy`)."""
    options = options or VideoOptions()
    target = resolve_policy(path, env_id=env_id)
    trainer = load_trainer(target.checkpoint, device="cpu")
    env = make_render_env(target.meta, target.env_id, options)
    try:
        return render_episodes(trainer.act, env, episodes=episodes, seed=seed, options=options)
    finally:
        env.close()


def _dataset_meta(source: str) -> Mapping[str, Any]:
    if is_shard_set(source):
        return ShardSet.open(source).meta
    return load_transitions(source).meta
