"""The run report's media stages: videos of the trained policies and of the data, and the
dataset doctor. Plain functions like :mod:`offaug.pipeline.stages.learning` (no Dask); each returns
a small JSON-ready record that ``metrics.json`` keeps under ``videos`` and ``doctor`` (typed in
:mod:`offaug.pipeline.report.metrics_document`), and the videos themselves are GIF files under
``RUN_DIR/videos/``.

**Policies.** Training ends with greedy evaluation episodes from the reset seeds
``seed + EVALUATION_SEED_OFFSET + i`` and records their returns. :func:`render_policy_stage`
films the ones at evenly spaced return ranks (:func:`return_ranks`: the best and the worst for
two) by running the same seeds again, so each film is that evaluation episode; its own return
is kept beside the recorded one.

**Data.** Original episodes are shown from the dataset's own simulator states: each filmed
row's ``infos/qpos`` and ``infos/qvel`` are set with MuJoCo's ``set_state`` and rendered, so a
frame shows exactly the recorded state (no physics is run, nothing can drift). Augmented
simulator rollouts record no simulator state; one branched from a dataset state
(``rollout.start: dataset``) starts at the dataset row whose observation equals its first one.
That state is set and the episode's recorded actions are replayed; the largest difference
between replayed and recorded observations is kept beside the clip (float32 rounding for
an exact replay). Episodes started from env resets, and model rollouts, have no state to show.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.datasets.sources import load_transitions
from offaug.datasets.transitions import SIMULATOR_STATE_KEYS, Source, Transitions
from offaug.pipeline.contracts import (
    AugmentedRef,
    DatasetRef,
    ModelRef,
)
from offaug.pipeline.schema.run_sections import ReportModel

EVALUATION_SEED_OFFSET = 10_000
"""Training evaluates from reset seed ``seed + 10_000``
(:func:`offaug.algorithms.training.loop.train`)."""
START_MATCH_TOLERANCE = 1e-5
"""Largest difference between an augmented episode's first observation and a dataset
observation for that dataset row to count as its branch point."""


def return_ranks(
    returns: Sequence[float] | npt.NDArray[np.float64], count: int
) -> list[tuple[int, str]]:
    """``count`` episodes at evenly spaced ranks by return, best first, as (index, label).

    Labels are ``best``, ``worst`` and ``rank R of N``; ties keep their order.
    """
    order = np.argsort(-np.asarray(returns, dtype=np.float64), kind="stable")
    n = len(order)
    if n == 0:
        return []
    positions = np.unique(np.round(np.linspace(0, n - 1, min(count, n))).astype(int))
    labels = {0: "best", n - 1: "worst"}
    return [(int(order[p]), labels.get(int(p), f"rank {p + 1} of {n}")) for p in positions]


def _video_options(config: ReportModel) -> Any:
    # Imported here: the renderer imports torch, and Dask workers import this module on their
    # first stage (offaug.pipeline.engine.workers keeps torch out of that path).
    from offaug.pipeline.media.render import VideoOptions

    chosen = {
        name: getattr(config, name)
        for name in ("width", "height", "frame_skip", "max_frames")
        if getattr(config, name) is not None
    }
    return VideoOptions(**chosen)


def _clip(frames: npt.NDArray[np.uint8], fps: float, path: Path, **facts: Any) -> dict[str, Any]:
    """Write ``frames`` as a GIF at ``path`` and describe it."""
    from offaug.pipeline.media.video import write_video  # with the renderer (see _video_options)

    write_video(frames, path, fps)
    return {
        "path": str(path),
        "frames": int(frames.shape[0]),
        "width": int(frames.shape[2]),
        "height": int(frames.shape[1]),
        "fps": float(fps),
        "bytes": path.stat().st_size,
        **facts,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def render_policy_stage(
    data: DatasetRef, model: ModelRef, config: ReportModel, out_dir: Path, seed: int
) -> dict[str, Any]:
    """Film ``model``'s evaluation episodes at evenly spaced return ranks into ``out_dir``.

    Returns:
        ``{"kind": "files", "paths", "policy", "clips", "seconds"}``, or
        ``{"policy", "unavailable": why}`` when the env cannot render here.
    """
    from offaug.algorithms.training.checkpoints import load_trainer
    from offaug.pipeline.media.render import RenderUnavailable, make_render_env, render_episodes

    started = time.perf_counter()
    options = _video_options(config)
    recorded = list((model.metrics.get("eval") or {}).get("returns") or [])
    first_seed = seed + EVALUATION_SEED_OFFSET
    try:
        env = make_render_env(data.meta, None, options)
    except RenderUnavailable as exc:
        return {"policy": model.name, "unavailable": str(exc)}
    policy = load_trainer(model.path, device="cpu").act
    try:
        if recorded:
            picks = return_ranks(recorded, config.video_episodes)
            filmed = {
                index: render_episodes(
                    policy, env, episodes=1, seed=first_seed + index, options=options
                )[0]
                for index, _ in picks
            }
        else:  # trained without an environment to evaluate in: film fresh episodes
            episodes = render_episodes(
                policy, env, episodes=config.video_episodes, seed=first_seed, options=options
            )
            filmed = dict(enumerate(episodes))
            picks = return_ranks([e.episode_return for e in episodes], config.video_episodes)
    except RenderUnavailable as exc:
        return {"policy": model.name, "unavailable": str(exc)}
    finally:
        env.close()
    clips = []
    for index, label in picks:
        episode = filmed[index]
        clips.append(
            _clip(
                episode.frames,
                episode.fps,
                out_dir / f"{_slug(model.name)}-{_slug(label)}.gif",
                label=label,
                episode_return=episode.episode_return,
                evaluation_return=float(recorded[index]) if recorded else None,
                length=episode.length,
                seed=episode.seed,
                render_seconds=episode.render_seconds,
            )
        )
    return {
        "kind": "files",
        "paths": [c["path"] for c in clips],
        "policy": model.name,
        "clips": clips,
        "seconds": time.perf_counter() - started,
    }


def render_best_policy_stage(
    data: DatasetRef,
    models: Sequence[ModelRef],
    arms: Sequence[tuple[str, str, int]],
    config: ReportModel,
    out_dir: Path,
    seed: int,
) -> dict[str, Any]:
    """Film the best policy of the study in its best evaluation episode into ``out_dir``.

    ``models[i]`` is the run ``arms[i]`` = (learner, recipe, seed). The best arm is the one
    with the highest IQM of its evaluation scores over its seeds (normalised scores, else
    returns), plain or augmented; its run of seed ``seed`` (else its first) is filmed.

    Returns:
        :func:`render_policy_stage`'s record with ``arm``: ``{"learner", "recipe", "seed",
        "iqm", "seeds", "score"}``, or ``{"unavailable": why}`` when no run was evaluated.
    """
    from offaug.pipeline.outcome.statistics import iqm  # rliable, imported by the stage only

    by_arm: dict[tuple[str, str], list[tuple[int, float, ModelRef]]] = {}
    score_key = "normalised_score"
    evaluations = [(model.metrics.get("eval") or {}) for model in models]
    if any(e.get(score_key) is None for e in evaluations):
        score_key = "return"
    for (learner, recipe, run_seed), model, evaluation in zip(
        arms, models, evaluations, strict=True
    ):
        if evaluation.get(score_key) is not None:
            by_arm.setdefault((learner, recipe), []).append(
                (run_seed, float(evaluation[score_key]), model)
            )
    if not by_arm:
        return {"unavailable": "no trained policy was evaluated (evaluation.episodes 0?)"}
    ranked = {arm: iqm([score for _, score, _ in runs]) for arm, runs in by_arm.items()}
    (learner, recipe), value = max(ranked.items(), key=lambda item: item[1])
    runs = by_arm[learner, recipe]
    run_seed, score, model = next((r for r in runs if r[0] == seed), runs[0])
    record = render_policy_stage(
        data, model, config.model_copy(update={"video_episodes": 1}), out_dir, run_seed
    )
    record["arm"] = {
        "learner": learner,
        "recipe": recipe,
        "seed": run_seed,
        "iqm": value,
        "seeds": len(runs),
        "score": score,
        "metric": score_key,
    }
    return record


def render_data_stage(
    data: DatasetRef,
    augmented: AugmentedRef | None,
    config: ReportModel,
    out: Path,
    seed: int,
) -> dict[str, Any]:
    """Film original and augmented episodes at evenly spaced return ranks into ``out`` (see
    the module).

    Returns:
        ``{"kind": "files", "paths", "original", "augmented", "seconds"}`` where each part is
        ``{"method", "clips"}`` or ``{"unavailable": why}``; or ``{"unavailable": why}`` when
        nothing can render here.
    """
    # torch (see _video_options)
    from offaug.pipeline.media.render import RenderUnavailable, make_render_env

    started = time.perf_counter()
    options = _video_options(config)
    try:
        make_render_env(data.meta, None, options).close()  # an env that cannot film says so
        if data.has_simulator_state:
            original_rows = load_transitions(data.source, info_keys=list(SIMULATOR_STATE_KEYS))
            original = _film_states(original_rows, config, options, out, seed)
        else:
            original_rows = load_transitions(data.source)
            original = {"unavailable": "the dataset records no simulator state (infos/qpos)"}
        if augmented is None:
            rollouts: dict[str, Any] = {"unavailable": "the run made no augmented data"}
        else:
            rows = load_transitions(augmented.directory)
            rollouts = _film_replays(rows, original_rows, config, options, out, seed)
    except RenderUnavailable as exc:
        return {"unavailable": str(exc)}
    paths = [c["path"] for part in (original, rollouts) for c in part.get("clips", [])]
    return {
        "kind": "files",
        "paths": paths,
        "original": original,
        "augmented": rollouts,
        "seconds": time.perf_counter() - started,
    }


def _film_states(
    data: Transitions, config: ReportModel, options: Any, out: Path, seed: int
) -> dict[str, Any]:
    """Original episodes, each filmed row's recorded simulator state set and rendered."""
    from offaug.pipeline.media.render import make_render_env, render_frame

    env = make_render_env(data.meta, None, options)
    bounds = data.episode_bounds()
    qpos, qvel = (np.asarray(data.extras[f"infos/{key}"]) for key in SIMULATOR_STATE_KEYS)
    fps = float(env.metadata.get("render_fps") or 30) / options.frame_skip
    clips = []
    try:
        env.reset(seed=seed)
        for episode, label in return_ranks(data.episode_returns(), config.video_episodes):
            tic = time.perf_counter()
            start, stop = int(bounds[episode]), int(bounds[episode + 1])
            rows = np.arange(start, stop, options.frame_skip)[: options.max_frames]
            frames = []
            for row in rows.tolist():
                env.unwrapped.set_state(qpos[row], qvel[row])
                frames.append(render_frame(env, options))
            clips.append(
                _clip(
                    np.stack(frames),
                    fps,
                    out / f"data-original-{_slug(label)}.gif",
                    label=label,
                    episode=episode,
                    episode_return=float(data.rewards[start:stop].sum()),
                    length=stop - start,
                    replay_error=0.0,
                    render_seconds=time.perf_counter() - tic,
                )
            )
    finally:
        env.close()
    return {"method": "dataset simulator states (set_state per frame)", "clips": clips}


def _film_replays(
    rollouts: Transitions,
    original: Transitions,
    config: ReportModel,
    options: Any,
    out: Path,
    seed: int,
) -> dict[str, Any]:
    """Augmented episodes replayed from the dataset state they branched from."""
    from offaug.pipeline.media.render import make_render_env, render_frame

    if rollouts.source is not None and len(rollouts) and rollouts.source[0] == Source.MODEL:
        return {"unavailable": "model rollouts have no simulator states to show"}
    if rollouts.source is not None and len(rollouts) and rollouts.source[0] == Source.GENERATED:
        return {"unavailable": "generated transitions have no simulator states to show"}
    if not {f"infos/{k}" for k in SIMULATOR_STATE_KEYS} <= set(original.extras):
        return {"unavailable": "the dataset records no simulator state to replay from"}
    qpos, qvel = (np.asarray(original.extras[f"infos/{key}"]) for key in SIMULATOR_STATE_KEYS)
    bounds = rollouts.episode_bounds()
    picks = return_ranks(rollouts.episode_returns(), config.video_episodes)
    starts = {}
    for episode, _ in picks:
        first = np.asarray(rollouts.observations[bounds[episode]])
        distance = np.abs(np.asarray(original.observations) - first).max(axis=1)
        row = int(distance.argmin())
        if distance[row] > START_MATCH_TOLERANCE:
            return {
                "unavailable": "augmented episodes do not start at dataset states (rollout."
                "start: reset) and record no simulator state to replay from"
            }
        starts[episode] = row
    env = make_render_env(rollouts.meta or original.meta, None, options)
    fps = float(env.metadata.get("render_fps") or 30) / options.frame_skip
    clips = []
    try:
        for episode, label in picks:
            tic = time.perf_counter()
            start, stop = int(bounds[episode]), int(bounds[episode + 1])
            env.reset(seed=seed)
            env.unwrapped.set_state(qpos[starts[episode]], qvel[starts[episode]])
            frames, error = [render_frame(env, options)], 0.0
            for step, row in enumerate(range(start, stop), start=1):
                observation, _, terminated, truncated, _ = env.step(rollouts.actions[row])
                recorded = np.asarray(rollouts.next_observations[row])
                error = max(error, float(np.abs(np.asarray(observation) - recorded).max()))
                if step % options.frame_skip == 0:
                    frames.append(render_frame(env, options))
                if len(frames) >= options.max_frames or terminated or truncated:
                    break
            clips.append(
                _clip(
                    np.stack(frames),
                    fps,
                    out / f"data-augmented-{_slug(label)}.gif",
                    label=label,
                    episode=episode,
                    episode_return=float(rollouts.rewards[start:stop].sum()),
                    length=stop - start,
                    start_row=starts[episode],
                    replay_error=error,
                    render_seconds=time.perf_counter() - tic,
                )
            )
    finally:
        env.close()
    method = "recorded actions replayed from the dataset state each episode branched from"
    return {"method": method, "clips": clips}
