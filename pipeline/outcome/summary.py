"""metrics.json: every run's score, each recipe's diagnostics, and the verdicts over seeds.

:func:`summarise` reads the stages' results through a :class:`RunIndex` (which stage holds
which (learner, recipe, seed) run, and each recipe's BC, rollout and diagnostics stages per
seed, as :func:`offaug.pipeline.engine.plan.plan_workflow` made them) and builds the document the
report renders (typed in :mod:`offaug.pipeline.report.metrics_document`). The verdict is
:func:`offaug.pipeline.outcome.verdict.judge` over the final evaluation scores, with each recipe's
:class:`~offaug.pipeline.outcome.verdict.RecipeDiagnostics` for its reasons; ``comparison`` is
:func:`~offaug.pipeline.outcome.verdict.judge_best` (best augmented against best plain at equal
total gradient steps).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import numpy as np

from offaug.pipeline.contracts import (
    BEST_VIDEO_STAGE,
    DATA_VIDEO_STAGE,
    DOCTOR_STAGE,
    PLAIN,
    VIDEO_STAGE_PREFIX,
    AugmentedRef,
    DatasetRef,
    ModelRef,
    RunIndex,
)
from offaug.pipeline.outcome.verdict import (
    RecipeDiagnostics,
    RunScore,
    as_json,
    headline,
    judge,
    judge_best,
)
from offaug.pipeline.schema.run_sections import ReportModel
from offaug.pipeline.schema.sections import TrainModel
from offaug.pipeline.schema.workflow import Workflow


class RecipeSummary(TypedDict, total=False):
    """One recipe beside the verdict (metrics.json ``recipes``); a missing figure is None."""

    weighting: str
    policy: str
    rollout: str | None
    """The first seed's rollout stage (None for backend none)."""
    augmented_rows: int | None
    """Augmented transitions of the first seed."""
    ess_fraction: float | None
    """ESS/N of the importance weights, mean over seeds."""
    clipped_fraction: float | None
    """Share of weights clipped, mean over seeds."""
    ood_share: float | None
    """Share of augmented states out of the data's distribution (first diagnosed seed)."""
    original_reward_per_step: float | None
    augmented_reward_per_step: float | None
    rollout_policy_score: float | None
    """The rollout policy's own normalised score, mean over seeds (when evaluated)."""
    diagnostics: str | None
    """The stage of its merged diagnostics (first diagnosed seed)."""
    quality: dict[str, Any] | None
    """The quality report of each augmented source by name (first diagnosed seed; the
    diagnostics' ``quality``, :mod:`offaug.pipeline.diagnostics.quality`)."""
    noise: list[str]
    """The noise each seed's rollouts used (``rollout.noise``, or what calibration chose)."""
    calibrated: bool
    """Whether ``rollout.noise_calibration`` chose the noise."""
    episodes_kept: int | None
    """Augmented episodes the filter kept, over every seed (None without a filter)."""
    episodes_dropped: int | None


def weighting_of(train: TrainModel) -> str:
    """The train section's weighting as a word (a boolean ``weighting`` is behaviour or none)."""
    weighting: Any = train.weighting
    if isinstance(weighting, bool):
        return "behaviour" if weighting else "none"
    return str(weighting)


def training_entries(results: Mapping[str, Any], index: RunIndex) -> dict[str, dict[str, Any]]:
    """``training`` of metrics.json: each run's final evaluation, by its label, with its total
    and own gradient steps and the simulator steps of the rollouts it trained on (every round;
    None where a rollout does not record them)."""
    training: dict[str, dict[str, Any]] = {}
    for run in index["runs"]:
        result = results.get(run["stage"])
        if not isinstance(result, ModelRef):
            continue
        evaluation = result.metrics.get("eval") or {}
        rollouts = [results.get(r) for r in run.get("rollouts", [])]
        simulator = [
            a.metrics.get("simulator_steps") for a in rollouts if isinstance(a, AugmentedRef)
        ]
        training[run["label"]] = {
            "learner": run["learner"],
            "recipe": run["recipe"],
            "seed": run["seed"],
            "return": evaluation.get("return"),
            "normalised_score": evaluation.get("normalised_score"),
            "checkpoint": result.path,
            "steps": run.get("steps"),
            "own_steps": run.get("own_steps"),
            "simulator_steps": None if None in simulator else sum(simulator),
        }
    return training


def run_scores(training: Mapping[str, Mapping[str, Any]]) -> tuple[list[RunScore], str]:
    """The runs' final scores for the verdict, and which score it is: ``normalised_score``
    when every run has one (the data has reference scores), else ``return``."""
    entries = [e for e in training.values() if e.get("return") is not None]
    key = (
        "normalised_score"
        if all(e.get("normalised_score") is not None for e in entries)
        else "return"
    )
    runs = [
        RunScore(
            e["learner"],
            e["recipe"],
            int(e["seed"]),
            float(e[key]),
            e.get("steps"),
            e.get("own_steps"),
            e.get("simulator_steps"),
        )
        for e in entries
    ]
    return runs, key


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _dig(value: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def recipe_summaries(
    results: Mapping[str, Any], index: RunIndex, training: Mapping[str, Mapping[str, Any]]
) -> dict[str, RecipeSummary]:
    """Each recipe's weights, coverage, rewards and rollout policy score (``recipes``)."""
    summaries: dict[str, RecipeSummary] = {}
    for name, stages in index["recipes"].items():
        augmented = [results.get(s) for s in stages["rollout"].values()]
        first_rollout = next(iter(stages["rollout"].values()), None)
        first = results.get(first_rollout) if first_rollout else None
        diagnose = next(iter(stages["diagnose"].values()), None)
        document = results.get(diagnose) if diagnose else None
        # The stages whose models rolled out: the retrained policies of a last round, or the
        # BC clones; a learner's plain runs are found among the trainings.
        rolled_out = stages.get("policy_models") or (
            stages["bc"] if stages["policy"] == "bc" else None
        )
        if rolled_out is not None:
            policy_scores = [
                _dig(results[s].metrics, "eval", "normalised_score")
                for s in rolled_out.values()
                if isinstance(results.get(s), ModelRef)
            ]
        else:
            policy_scores = [
                e.get("normalised_score")
                for e in training.values()
                if e["learner"] == stages["policy"] and e["recipe"] == PLAIN
            ]
        refs = [a for a in augmented if isinstance(a, AugmentedRef)]
        filters = [a.metrics["filter"] for a in refs if "filter" in a.metrics]
        filtered = [f for f in filters if f.get("kind") != "none"]
        summaries[name] = RecipeSummary(
            noise=[str(a.metrics["noise"]) for a in refs if a.metrics.get("noise") is not None],
            calibrated=any(a.metrics.get("noise_calibration") for a in refs),
            episodes_kept=sum(int(f.get("kept", 0)) for f in filtered) if filtered else None,
            episodes_dropped=(
                sum(int(f.get("dropped", 0)) for f in filtered) if filtered else None
            ),
            weighting=stages["weighting"],
            policy=stages["policy"],
            rollout=first_rollout,
            augmented_rows=first.rows if isinstance(first, AugmentedRef) else None,
            ess_fraction=_mean([a.weight_stats.get("ess_fraction") for a in refs]),
            clipped_fraction=_mean([a.weight_stats.get("clipped_fraction") for a in refs]),
            ood_share=_dig(document, "coverage", "ood_fraction"),
            original_reward_per_step=_dig(document, "data", "original", "reward_mean"),
            augmented_reward_per_step=_dig(document, "data", "augmented", "reward_mean"),
            rollout_policy_score=_mean(policy_scores),
            diagnostics=diagnose,
            quality=_dig(document, "quality"),
        )
    return summaries


def _recorded_data_score(
    source: DatasetRef | None, diagnostics: Mapping[str, Any] | None, bc: Any = None
) -> float | None:
    """The normalised score of the data's own episodes: as the BC stage recorded it
    (``metrics["data"]``, :func:`offaug.pipeline.stages.learning.data_score`), else from the
    diagnostics' mean return and the reference scores."""
    if isinstance(bc, ModelRef) and _dig(bc.metrics, "data", "normalised_score") is not None:
        return float(bc.metrics["data"]["normalised_score"])
    mean_return = _dig(diagnostics, "data", "original", "return", "mean")
    if source is None or mean_return is None:
        return None
    # Reference scores come with the evaluation module (gymnasium): imported where needed, as
    # the workers unpickle this module with the stages before their background imports.
    from offaug.algorithms.evaluate import normalised_score, reference_scores

    return normalised_score(float(mean_return), reference_scores(source.meta, None))


_Figure = Literal[
    "augmented_reward_per_step",
    "original_reward_per_step",
    "ess_fraction",
    "ood_share",
    "rollout_policy_score",
    "augmented_rows",
]
_FIGURES: tuple[_Figure, ...] = typing.get_args(_Figure)
"""The figures of a recipe's summary that the verdict reads."""


def verdict_diagnostics(
    summaries: Mapping[str, RecipeSummary], data: float | None
) -> dict[str, RecipeDiagnostics]:
    """What the verdict reads of each recipe (the figures it has)."""
    out: dict[str, RecipeDiagnostics] = {}
    for name, summary in summaries.items():
        entry = RecipeDiagnostics(weighting=summary.get("weighting", "none"))
        for key in _FIGURES:
            value = summary.get(key)
            if value is not None:
                entry[key] = float(value)
        if data is not None:
            entry["data_score"] = data
        out[name] = entry
    return out


def _primary(
    results: Mapping[str, Any], index: RunIndex, kind: Literal["bc", "rollout", "diagnose"]
) -> Any:
    """The default stage's result of ``kind`` (``bc``, ``rollout``, ``diagnose``), else the
    first recipe's of the first seed that has one."""
    if kind in results:
        return results[kind]
    for stages in index["recipes"].values():
        for name in stages[kind].values():
            return results.get(name)
    return None


def summarise(workflow: Workflow, results: dict[str, Any], index: RunIndex) -> dict[str, Any]:
    """metrics.json: scores per run, weights and diagnostics, each recipe, and the verdict."""
    training = training_entries(results, index)
    augmented = _primary(results, index, "rollout")
    diagnostics = _primary(results, index, "diagnose")
    source = results.get("source")
    source = source if isinstance(source, DatasetRef) else None
    summaries = recipe_summaries(results, index, training)
    runs, score = run_scores(training)
    data = _recorded_data_score(source, diagnostics, _primary(results, index, "bc"))
    verdicts = judge(runs, verdict_diagnostics(summaries, data))
    metrics: dict[str, Any] = {
        "workflow": workflow.name,
        "workflow_hash": workflow.digest(),
        "seeds": list(index["seeds"]),
        "source": {"dataset": source.source, "rows": source.rows, "episodes": source.episodes}
        if source is not None
        else None,
        "augmented": {
            "rows": augmented.rows,
            "episodes": augmented.episodes,
            "shards": augmented.shards,
            "faults": augmented.faults,
        }
        if isinstance(augmented, AugmentedRef)
        else None,
        "weights": augmented.weight_stats if isinstance(augmented, AugmentedRef) else None,
        "training": training,
        "recipes": summaries,
        "data_score": data,
        "verdict_score": score,
        "verdict": as_json(verdicts),
        "verdict_headline": headline(verdicts),
        "comparison": judge_best(runs, expert=100.0 if score == "normalised_score" else None),
    }
    if diagnostics is not None:
        metrics["diagnostics"] = diagnostics
    if "publish" in results:
        metrics["publish"] = results["publish"]
    metrics.update(media_metrics(results, workflow.report))
    return metrics


def media_metrics(results: Mapping[str, Any], config: ReportModel) -> dict[str, Any]:
    """``metrics.json``'s ``best_video``, ``videos`` and ``doctor`` entries from the stages'
    results (by stage name); empty when the run made none."""
    metrics: dict[str, Any] = {}
    policies = {
        name.removeprefix(VIDEO_STAGE_PREFIX): record
        for name, record in results.items()
        if name.startswith(VIDEO_STAGE_PREFIX) and name not in (DATA_VIDEO_STAGE, BEST_VIDEO_STAGE)
    }
    if results.get(BEST_VIDEO_STAGE) is not None:
        metrics["best_video"] = {
            **results[BEST_VIDEO_STAGE],
            "max_report_mb": config.max_report_mb,
        }
    if policies or DATA_VIDEO_STAGE in results:
        metrics["videos"] = {
            "policies": policies,
            "data": results.get(DATA_VIDEO_STAGE),
            "max_report_mb": config.max_report_mb,
        }
    if results.get(DOCTOR_STAGE) is not None:
        metrics["doctor"] = results[DOCTOR_STAGE]
    return metrics
