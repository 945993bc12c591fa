"""Human review of a run's policies: the best rollouts per start state on one page, a person's
pick per start state, and the picks kept as labelled data.

:func:`review_run` rolls every policy of a run (its BC policy and every trained learner, greedy)
from a few start states (reset seeds ``seed + 30_000 + i``), keeps the ``top`` episodes by
return per start state as *candidates*, and writes::

    RUN_DIR/review/
      review.html    one row per start state, its candidates side by side (an animation each
                     where the env renders offscreen, else the return curve), a radio button per
                     candidate and a "save" button that downloads choices.json (no server)
      review.json    the candidates: episode id, start state, policy, return, length
      candidates/    every candidate episode as a shard set (source ``REVIEWED``)

:func:`apply_choices` reads a ``choices.json`` the page saved and writes ``review/labelled/``:
the candidates of every start state that has a choice, with a ``label`` extra column (int8:
1 the chosen episode, 0 the others) and ``source`` = :attr:`Source.REVIEWED`. It loads with
``load_transitions`` and trains as one more source with its own mixing share.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.algorithms.evaluate import Policy, make_env
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.datasets import ShardSet, Transitions, write_shard_set
from offaug.datasets.atomic import write_json_atomic, write_text_atomic
from offaug.datasets.errors import DataError
from offaug.datasets.transitions import SPACE_META_KEYS, Source, concatenate
from offaug.pipeline.media.render import (
    RenderUnavailable,
    VideoOptions,
    make_render_env,
    render_episodes,
)
from offaug.pipeline.media.video import episode_animation

# The run directory's records have one reader today, the diagnostics' re-run.
from offaug.pipeline.rundir.files import read_run_records

RESET_SEED_OFFSET = 30_000
"""Review start states are reset seeds ``seed + 30_000 + i``, apart from training's and the
diagnostics' evaluation seeds."""
LABEL_COLUMN = "label"
"""The extra column of the labelled shard set: 1 the chosen episode, 0 the others."""
START_COLUMN = "review_start"
"""The extra column of the candidates: the index of the episode's start state."""


@dataclasses.dataclass(frozen=True)
class ReviewOptions:
    """How many start states and candidates a review shows."""

    starts: int = 3
    """Start states (one row of the page each)."""
    top: int = 3
    """Candidates per start state: the episodes with the highest return."""
    seed: int = 0
    """Start states are reset seeds ``seed + 30_000 + i``."""
    animations: bool = True
    """Film the candidates where the env renders offscreen (else return curves only)."""
    video: VideoOptions = dataclasses.field(
        default_factory=lambda: VideoOptions(frame_skip=4, max_frames=60)
    )
    """Frame size and count of each animation."""
    max_animation_bytes: int = 1_000_000
    """At most this size per animation (frames are dropped to fit)."""

    def __post_init__(self) -> None:
        if self.starts < 1 or self.top < 1:
            raise ValueError(f"starts and top must be at least 1, got {self.starts}, {self.top}")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate episode on the page."""

    episode_id: int
    """Its episode id in ``candidates/`` (and the value its radio button saves)."""
    start: int
    """Index of its start state."""
    reset_seed: int
    policy: str
    """The model's name in the run."""
    checkpoint: str
    episode_return: float
    length: int


@dataclasses.dataclass(frozen=True)
class ReviewResult:
    """What :func:`review_run` wrote."""

    page: Path
    candidates: tuple[Candidate, ...]
    shard_set: Path
    """``candidates/``."""
    media_note: str | None
    """Why the page shows return curves instead of animations (None when it animates)."""


def review_dir(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Where a run's review lives: ``out``, else ``RUN_DIR/review``."""
    return Path(out) if out is not None else Path(run_dir) / "review"


def record_episode(act: Policy, env: Any, reset_seed: int) -> Transitions:
    """One greedy episode from ``reset_seed`` as transitions (episode id 0, next observations
    its own, ``source`` :attr:`Source.REVIEWED`)."""
    observation, _ = env.reset(seed=int(reset_seed))
    observations, actions, rewards, next_observations = [], [], [], []
    terminated = truncated = False
    while not (terminated or truncated):
        obs = np.asarray(observation, dtype=np.float32).reshape(-1)
        action = np.asarray(act(obs[None]))[0]
        observation, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs)
        actions.append(action)
        rewards.append(float(reward))
        next_observations.append(np.asarray(observation, dtype=np.float32).reshape(-1))
    steps = len(rewards)
    last = np.arange(steps) == steps - 1
    action_array = np.asarray(actions)
    return Transitions(
        observations=np.stack(observations),
        actions=action_array.astype(np.int64 if action_array.dtype.kind in "iu" else np.float32),
        rewards=np.asarray(rewards, dtype=np.float32),
        next_observations=np.stack(next_observations),
        terminals=last & bool(terminated),
        timeouts=last & (not terminated),
        episode_ids=np.zeros(steps, dtype=np.int64),
        source=np.full(steps, Source.REVIEWED, dtype=np.int8),
    )


def review_run(
    run_dir: str | Path, options: ReviewOptions | None = None, *, out: str | Path | None = None
) -> ReviewResult:
    """Roll a run's policies from ``options.starts`` start states and write the review page.

    Raises:
        FileNotFoundError: the run has no ``stages.json``.
        DataError: its records lack the ``source`` or ``bc`` stage.
    """
    options = options or ReviewOptions()
    root = Path(run_dir)
    records = read_run_records(root)
    data, bc, models = records.data, records.bc, records.models
    meta = dict(data.meta)
    policies = [(model.name, model.path) for model in (bc, *models)]
    env = make_env(meta)
    episodes: list[tuple[Candidate, Transitions]] = []
    try:
        acts = {name: load_trainer(path, device="cpu").act for name, path in policies}
        for start in range(options.starts):
            reset_seed = options.seed + RESET_SEED_OFFSET + start
            runs = [
                (name, path, record_episode(acts[name], env, reset_seed)) for name, path in policies
            ]
            runs.sort(key=lambda run: -float(run[2].rewards.sum()))
            for name, path, episode in runs[: options.top]:
                episode_id = len(episodes)
                candidate = Candidate(
                    episode_id,
                    start,
                    reset_seed,
                    name,
                    path,
                    float(episode.rewards.sum()),
                    len(episode),
                )
                renumbered = dataclasses.replace(
                    episode,
                    episode_ids=np.full(len(episode), episode_id, dtype=np.int64),
                    extras={START_COLUMN: np.full(len(episode), start, dtype=np.int64)},
                )
                episodes.append((candidate, renumbered))
    finally:
        env.close()
    candidates = tuple(candidate for candidate, _ in episodes)
    directory = review_dir(root, out)
    directory.mkdir(parents=True, exist_ok=True)
    rows = concatenate([episode for _, episode in episodes], renumber_episodes=False)
    space_meta = {key: meta[key] for key in SPACE_META_KEYS if key in meta}
    shard_set = write_shard_set(
        dataclasses.replace(rows, meta=space_meta),
        directory / "candidates",
        source={"run": str(root.absolute()), "dataset": data.source},
        params={
            "review": {"starts": options.starts, "top": options.top, "seed": options.seed},
            "candidates": [dataclasses.asdict(c) for c in candidates],
        },
        overwrite=True,
    )
    rewards = {candidate.episode_id: episode.rewards for candidate, episode in episodes}
    media, note = candidate_media(candidates, rewards, acts, meta, options)
    page = directory / "review.html"
    write_text_atomic(page, review_page(root.name, candidates, media, note))
    write_json_atomic(
        directory / "review.json",
        {"run": str(root.absolute()), "candidates": [dataclasses.asdict(c) for c in candidates]},
    )
    return ReviewResult(page, candidates, Path(shard_set.directory), note)


def candidate_media(
    candidates: Sequence[Candidate],
    rewards: Mapping[int, npt.NDArray[np.float32]],
    acts: Mapping[str, Policy],
    meta: Mapping[str, Any],
    options: ReviewOptions,
) -> tuple[dict[int, str], str | None]:
    """An HTML element per candidate: its animation where the env renders, else its return curve.

    A greedy episode repeats from its reset seed, so each candidate is filmed by running it
    again in a rendering env. Returns the elements by episode id and, when there are no
    animations, the reason.
    """
    if options.animations:
        try:
            env = make_render_env(meta, None, options.video)
        except RenderUnavailable as exc:
            note = f"No animations: {exc}."
        else:
            try:
                media = {}
                for c in candidates:
                    (filmed,) = render_episodes(
                        acts[c.policy], env, seed=c.reset_seed, options=options.video
                    )
                    animation = episode_animation(filmed, max_bytes=options.max_animation_bytes)
                    media[c.episode_id] = animation.html
                return media, None
            except RenderUnavailable as exc:
                note = f"No animations: {exc}."
            finally:
                env.close()
    else:
        note = "Animations were turned off."
    return {c.episode_id: return_curve(rewards[c.episode_id]) for c in candidates}, note


def return_curve(rewards: npt.NDArray[np.float32]) -> str:
    """An ``<img>`` of an episode's cumulative return over its steps (inline PNG)."""
    # Imported here: matplotlib is heavy and only the page's fallback plots need it.
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(2.6, 1.7), dpi=80)
    try:
        axes.plot(np.arange(1, len(rewards) + 1), np.cumsum(rewards), color="#1a73e8")
        axes.set_xlabel("step", fontsize=7)
        axes.set_ylabel("return so far", fontsize=7)
        axes.tick_params(labelsize=6)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
    finally:
        plt.close(figure)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{encoded}" alt="return curve">'


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5rem auto; padding: 0 1rem;
       max-width: 1200px; }
.start { display: flex; gap: 1rem; flex-wrap: wrap; margin-bottom: 1.5rem; }
.candidate { border: 2px solid #d0d0d0; border-radius: 6px; padding: 0.5rem; cursor: pointer; }
.candidate:has(input:checked) { border-color: #137333; background: #eef7f0; }
.candidate figure { margin: 0.3rem 0; }
.candidate figcaption, p.note { font-size: 0.85rem; color: #444; }
button { font-size: 1rem; padding: 0.4rem 1rem; }
"""

# The page's only behaviour: collect the checked radio buttons and download them as JSON.
_SCRIPT = """
const STARTS = document.querySelectorAll("div.start").length;
function choices() {
  const picked = {};
  for (const input of document.querySelectorAll("input[type=radio]:checked")) {
    picked[input.dataset.start] = Number(input.value);
  }
  return picked;
}
function update() {
  const marked = Object.keys(choices()).length;
  document.getElementById("status").textContent = marked + " of " + STARTS + " start states marked";
}
function save() {
  const body = JSON.stringify({run: RUN, choices: choices()}, null, 2);
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([body], {type: "application/json"}));
  link.download = "choices.json";
  link.click();
  URL.revokeObjectURL(link.href);
}
document.addEventListener("change", update);
document.getElementById("save").addEventListener("click", save);
update();
"""


def review_page(
    run_name: str,
    candidates: Sequence[Candidate],
    media: Mapping[int, str],
    note: str | None,
) -> str:
    """The self-contained review page: a row of candidates per start state, radio buttons and
    a button that downloads ``choices.json`` (``{"run": ..., "choices": {start: episode_id}}``).
    """
    rows = []
    for start in sorted({c.start for c in candidates}):
        cells = []
        for c in (c for c in candidates if c.start == start):
            caption = f"{html.escape(c.policy)}: return {c.episode_return:.2f}, {c.length} steps"
            cells.append(
                f'<label class="candidate"><input type="radio" name="start-{start}" '
                f'data-start="{start}" value="{c.episode_id}"> pick'
                f"<figure>{media[c.episode_id]}<figcaption>{caption}</figcaption></figure></label>"
            )
        seed = next(c.reset_seed for c in candidates if c.start == start)
        rows.append(
            f"<h2>Start state {start + 1} (reset seed {seed})</h2>"
            f'<div class="start" data-start="{start}">{"".join(cells)}</div>'
        )
    title = f"offaug review: {html.escape(run_name)}"
    remark = f'<p class="note">{html.escape(note)}</p>' if note else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title><style>{_CSS}</style></head><body><h1>{title}</h1>"
        "<p>Pick the best episode of each start state, then save: the browser downloads "
        "<code>choices.json</code>; <code>offaug review RUN_DIR --apply choices.json</code> "
        f"keeps the picks as labelled data.</p>{remark}{''.join(rows)}"
        '<p><button id="save" type="button">Save choices.json</button> '
        '<span id="status"></span></p>'
        f"<script>const RUN = {json.dumps(run_name)};{_SCRIPT}</script></body></html>\n"
    )


def read_choices(path: str | Path, candidates: Sequence[Candidate]) -> dict[int, int]:
    """``{start: chosen episode id}`` from a saved ``choices.json``, checked against the
    candidates.

    Raises:
        DataError: unreadable JSON, or a choice that is not a candidate of its start state.
    """
    file = Path(path)
    try:
        document = json.loads(file.read_text())
        raw = document["choices"]
        chosen = {int(start): int(episode) for start, episode in raw.items()}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(
            f"not a choices file ({exc})", path=file, hint='expected {"choices": {START: EPISODE}}'
        ) from exc
    by_start: dict[int, set[int]] = {}
    for c in candidates:
        by_start.setdefault(c.start, set()).add(c.episode_id)
    for start, episode in chosen.items():
        if episode not in by_start.get(start, set()):
            allowed = sorted(by_start.get(start, set()))
            raise DataError(
                f"episode {episode} is not a candidate of start state {start} "
                f"(candidates: {allowed})",
                path=file,
                field=f"choices[{start}]",
            )
    return chosen


def apply_choices(
    choices: str | Path, review: str | Path, *, out: str | Path | None = None
) -> ShardSet:
    """Write the labelled shard set (``REVIEW_DIR/labelled`` unless ``out``) from a choices file.

    Every candidate of a start state with a choice is kept, labelled 1 (chosen) or 0; start
    states without a choice are left out.

    Raises:
        DataError: no candidates under ``review``, a bad choices file, or no choice at all.
    """
    directory = Path(review)
    shard_set = ShardSet.open(directory / "candidates")
    candidates = [Candidate(**c) for c in shard_set.params.get("candidates", [])]
    chosen = read_choices(choices, candidates)
    if not chosen:
        raise DataError("no start state is marked", path=choices, field="choices")
    rows = shard_set.load()
    starts = np.asarray(rows.extras[START_COLUMN])
    keep = np.flatnonzero(np.isin(starts, list(chosen)))
    picked = np.isin(rows.episode_ids[keep], list(chosen.values()))
    taken = rows.take(keep)
    labelled = dataclasses.replace(
        taken, extras={**taken.extras, LABEL_COLUMN: picked.astype(np.int8)}
    )
    return write_shard_set(
        labelled,
        Path(out) if out is not None else directory / "labelled",
        source={**dict(shard_set.source), "candidates": shard_set.directory},
        params={"choices": {str(k): v for k, v in sorted(chosen.items())}},
        overwrite=True,
    )
