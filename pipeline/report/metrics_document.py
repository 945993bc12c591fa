"""What the report reads: ``metrics.json``, typed.

Every key is optional: a missing section is reported as missing rather than failing.
"""

from __future__ import annotations

from typing import Any, TypedDict

from offaug.pipeline.outcome.summary import RecipeSummary
from offaug.pipeline.outcome.verdict import ArmVerdict, BestComparison

# ``return`` is a keyword, so this one is spelled functionally: the final evaluation's mean
# return and its D4RL-normalised score (None without reference scores), the learner, recipe
# (``plain`` for the baseline, ``baseline[STEPS]`` for a plain run of another budget) and training
# seed, the checkpoint's path, the total gradient steps (its rollout policy's and the plain run's
# it starts from included), its own, and the simulator steps of the rollouts it trained on.
TrainingResult = TypedDict(
    "TrainingResult",
    {
        "learner": str,
        "recipe": str,
        "seed": int,
        "return": float,
        "normalised_score": float | None,
        "checkpoint": str,
        "steps": int | None,
        "own_steps": int | None,
        "simulator_steps": int | None,
    },
    total=False,
)


class RolloutWeights(TypedDict, total=False):
    """The rollout's pooled importance-weight statistics
    (:func:`offaug.pipeline.rollouts.simulator.weight_statistics`)."""

    n: int
    """Transitions."""
    ess: float
    """Effective sample size."""
    ess_fraction: float
    """ESS / N."""
    clipped_fraction: float
    """Share of raw weights above the clip."""
    max_weight: float
    """The clip."""
    mean_log_ratio: float
    """Mean log beta_hat/mu."""


class VideoClip(TypedDict, total=False):
    """One filmed episode, a GIF under ``RUN_DIR/videos/``
    (:mod:`offaug.pipeline.stages.media`)."""

    path: str
    label: str
    """``best``, ``worst`` or ``rank R of N`` (by return)."""
    frames: int
    width: int
    height: int
    fps: float
    """Playback rate that shows the episode in real time."""
    bytes: int
    episode_return: float
    length: int
    """Steps of the episode (filmed or not)."""
    render_seconds: float
    seed: int
    """Policies: the reset seed (that of the evaluation episode)."""
    evaluation_return: float | None
    """Policies: the return the training evaluation recorded for the same episode."""
    episode: int
    """Data: the episode's index in its dataset."""
    start_row: int
    """Augmented data: the dataset row the episode branched from."""
    replay_error: float
    """Data: largest |replayed - recorded observation| (0 for states set as recorded; float32
    rounding for an exact replay)."""


class VideoSet(TypedDict, total=False):
    """The clips of one policy or one kind of data, or why there are none."""

    clips: list[VideoClip]
    unavailable: str
    """Why nothing was filmed (no OpenGL, no simulator state, ...)."""
    method: str
    """Data: how the episodes were put back into the simulator."""
    policy: str
    seconds: float


class DataVideos(VideoSet, total=False):
    """The data's videos: ``original`` and ``augmented`` parts (or one ``unavailable``)."""

    original: VideoSet
    augmented: VideoSet


class Videos(TypedDict, total=False):
    """``metrics.json``'s ``videos``."""

    policies: dict[str, VideoSet]
    """Per trained policy (``<algorithm>-plain`` / ``-augmented``: its train stage's name)."""
    data: DataVideos | None
    max_report_mb: float
    """Bound on report.html (10^6 bytes)."""


class BestArm(TypedDict, total=False):
    """The arm :func:`offaug.pipeline.stages.media.render_best_policy_stage` chose."""

    learner: str
    recipe: str
    seed: int
    """The seed whose run was filmed."""
    iqm: float
    """The arm's IQM over its seeds."""
    seeds: int
    score: float
    """The filmed run's own evaluation score."""
    metric: str
    """``normalised_score``, or ``return`` without reference scores."""


class BestVideo(VideoSet, total=False):
    """``metrics.json``'s ``best_video``: the study's best policy in its best evaluation
    episode (workflow ``report.best_video``)."""

    arm: BestArm
    max_report_mb: float


class DoctorFindings(TypedDict, total=False):
    """:meth:`offaug.datasets.doctor.DoctorReport.to_json`."""

    worst: str
    exit_code: int
    facts: dict[str, Any]
    findings: list[dict[str, Any]]
    """Each ``{code, severity, message, advice, numbers}``."""


class Doctor(TypedDict, total=False):
    """``metrics.json``'s ``doctor``: the dataset doctor on the source and the augmented data."""

    gamma: float
    source: DoctorFindings
    augmented: DoctorFindings | None


class Metrics(TypedDict, total=False):
    """``metrics.json``: a run's metrics."""

    training: dict[str, TrainingResult]
    """One result per training run, named ``LEARNER-RECIPE`` (``cql-plain``,
    ``cql-augmented``), with ``@sSEED`` for seeds other than the workflow's ``seed``."""
    seeds: list[int]
    """The training seeds."""
    recipes: dict[str, RecipeSummary]
    """Each augmentation recipe's weights, coverage and rewards, beside the verdict."""
    data_score: float | None
    """The normalised score of the data's own episodes (None without reference scores)."""
    verdict_score: str
    """What the verdict compares: ``normalised_score``, or ``return`` without reference scores."""
    verdict: list[ArmVerdict]
    """Each (learner, recipe) against plain over seeds
    (:func:`offaug.pipeline.outcome.verdict.judge`)."""
    verdict_headline: str
    """One line: the best arm per learner (:func:`offaug.pipeline.outcome.verdict.headline`)."""
    comparison: BestComparison
    """The best augmented arm against the best plain arm at its total gradient steps or fewer
    (:func:`offaug.pipeline.outcome.verdict.judge_best`): the study's answer."""
    weights: RolloutWeights
    """The rollout's importance weights."""
    diagnostics: dict[str, Any]
    """:func:`offaug.pipeline.diagnostics.run_diagnostics`'s document, typed as
    :class:`offaug.pipeline.diagnostics.document.Diagnostics`."""
    best_video: BestVideo
    """The study's best policy, filmed (workflow ``report.best_video``)."""
    videos: Videos
    """Animations of trained policies and of the data (workflow ``report.videos``)."""
    doctor: Doctor
    """The dataset doctor's findings."""
