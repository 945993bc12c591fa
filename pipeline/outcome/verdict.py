"""The verdict: does augmentation help? Per learner and recipe, over seeds, with statistics.

Each (learner, recipe) arm is compared with the same learner trained on the original data alone
("plain") over the training seeds both have: the IQM of final normalised scores, the 95 %
stratified bootstrap interval of the IQM difference and the probability of improvement
(:mod:`offaug.pipeline.outcome.statistics`). An arm *helps* when the interval lies above zero,
*hurts* when it lies below, and is *inconclusive* otherwise (always so with fewer than two seeds).
When an arm does not help, the recipe's diagnostics name the likeliest reason and what to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from offaug.pipeline.contracts import PLAIN

if TYPE_CHECKING:
    from offaug.pipeline.outcome.statistics import Comparison

Outcome = Literal["helps", "hurts", "inconclusive"]

# Thresholds at which a diagnostic is named as a reason; each is a rule of thumb, not a test.
_RETURN_SHORTFALL = 0.1  # augmented episodes return this share less than the data per step
_LOW_ESS_FRACTION = 0.1
_HIGH_OOD_SHARE = 0.3
_MIN_SEEDS = 2


@dataclasses.dataclass(frozen=True)
class RunScore:
    """One trained policy's final evaluation."""

    learner: str
    recipe: str
    seed: int
    normalised_score: float


class RecipeDiagnostics(TypedDict, total=False):
    """What a recipe's diagnostics say, as far as the verdict reads them (all optional)."""

    augmented_reward_per_step: float
    """Mean reward per step of the augmented transitions."""
    original_reward_per_step: float
    """Mean reward per step of the original transitions."""
    ess_fraction: float
    """ESS/N of the importance weights the learner was trained with."""
    weighting: str
    """How augmented rows were weighted: none, behaviour or policy."""
    ood_share: float
    """Share of augmented states out of the data's distribution (k-NN)."""
    rollout_policy_score: float
    """Normalised score of the rollout policy itself."""
    data_score: float
    """Normalised score of the data's own episodes."""
    augmented_rows: float
    """Augmented transitions the recipe trained with (0: the filter kept no episode)."""


class ArmVerdict(TypedDict):
    """One (learner, recipe) arm against plain."""

    learner: str
    recipe: str
    outcome: Outcome
    iqm: float
    iqm_interval: list[float]
    """95 % stratified bootstrap interval of the arm's IQM."""
    plain_iqm: float
    plain_iqm_interval: list[float]
    difference: float
    interval: list[float]
    """95 % interval of the IQM difference (arm minus plain)."""
    probability_of_improvement: float
    seeds: list[int]
    sentence: str
    reasons: list[str]


def _reasons(diagnostics: RecipeDiagnostics) -> list[str]:
    reasons = []
    if diagnostics.get("augmented_rows") == 0:
        reasons.append(
            "the filter kept no augmented episode (the rollout policy earned less than the data "
            "from every start), so the arm trained on the original data alone: train a better "
            "rollout policy (longer BC, or a trained learner via rollout.policy) or lower the noise"
        )
    augmented = diagnostics.get("augmented_reward_per_step")
    original = diagnostics.get("original_reward_per_step")
    if augmented is not None and original is not None:
        shortfall = (original - augmented) / max(abs(original), 1e-9)
        if shortfall > _RETURN_SHORTFALL:
            reasons.append(
                f"the augmented data earns {augmented:.3g} reward per step against the data's "
                f"{original:.3g}: the rollout policy is worse than the data; train it longer, use "
                "a trained learner as the rollout policy, lower the noise, branch from dataset "
                "states with a short horizon, or filter episodes below the data's return"
            )
    policy_score = diagnostics.get("rollout_policy_score")
    data_score = diagnostics.get("data_score")
    if policy_score is not None and data_score is not None and policy_score < data_score:
        reasons.append(
            f"the rollout policy scores {policy_score:.1f} against the data's {data_score:.1f}"
        )
    ess = diagnostics.get("ess_fraction")
    if (
        ess is not None
        and diagnostics.get("weighting", "none") != "none"
        and ess < _LOW_ESS_FRACTION
    ):
        reasons.append(
            f"the importance weights are degenerate (ESS/N = {ess:.2f}): lower the noise, clip "
            "the weights lower, or turn weighting off for simulator data (real transitions need "
            "no correction for Q-learning)"
        )
    ood = diagnostics.get("ood_share")
    if ood is not None and ood > _HIGH_OOD_SHARE:
        reasons.append(
            f"{ood:.0%} of augmented states lie outside the data's distribution: branch from "
            "dataset states with a shorter horizon"
        )
    return reasons


def _sentence(learner: str, recipe: str, outcome: Outcome, result: Comparison, seeds: int) -> str:
    low, high = result.difference.low, result.difference.high
    numbers = (
        f"IQM {result.arm.value:.1f} vs {result.baseline.value:.1f} "
        f"(difference {result.difference.value:+.1f}, 95% CI [{low:+.1f}, {high:+.1f}], "
        f"P(improvement) = {result.probability_of_improvement:.2f}, {seeds} seeds)"
    )
    if seeds < _MIN_SEEDS:
        return f"{learner} with {recipe}: one seed is an anecdote, not a verdict; {numbers}."
    words = {
        "helps": "augmentation helps",
        "hurts": "augmentation hurts",
        "inconclusive": "no clear difference",
    }[outcome]
    return f"{learner} with {recipe}: {words}; {numbers}."


def judge_arm(
    learner: str,
    recipe: str,
    plain: Mapping[int, float],
    arm: Mapping[int, float],
    diagnostics: RecipeDiagnostics | None = None,
) -> ArmVerdict:
    """Compare one arm's per-seed scores with plain's on the seeds both have."""
    seeds = sorted(set(plain) & set(arm))
    if not seeds:
        raise ValueError(f"{learner}/{recipe}: no training seed shared with the plain runs")
    # rliable brings arch, pandas and scipy (seconds to import): imported where the verdict is
    # made, so that the workflow schema, which names the plain recipe, stays light.
    from offaug.pipeline.outcome.statistics import compare

    result = compare([plain[s] for s in seeds], [arm[s] for s in seeds])
    outcome: Outcome = "inconclusive"
    if len(seeds) >= _MIN_SEEDS and result.difference.low > 0:
        outcome = "helps"
    elif len(seeds) >= _MIN_SEEDS and result.difference.high < 0:
        outcome = "hurts"
    reasons = _reasons(diagnostics or {}) if outcome != "helps" else []
    return ArmVerdict(
        learner=learner,
        recipe=recipe,
        outcome=outcome,
        iqm=result.arm.value,
        iqm_interval=[result.arm.low, result.arm.high],
        plain_iqm=result.baseline.value,
        plain_iqm_interval=[result.baseline.low, result.baseline.high],
        difference=result.difference.value,
        interval=[result.difference.low, result.difference.high],
        probability_of_improvement=result.probability_of_improvement,
        seeds=seeds,
        sentence=_sentence(learner, recipe, outcome, result, len(seeds)),
        reasons=reasons,
    )


def judge(
    runs: Iterable[RunScore],
    diagnostics: Mapping[str, RecipeDiagnostics] | None = None,
) -> list[ArmVerdict]:
    """Every (learner, recipe) arm against the same learner's plain runs, best first."""
    scores: dict[tuple[str, str], dict[int, float]] = {}
    for run in runs:
        scores.setdefault((run.learner, run.recipe), {})[run.seed] = run.normalised_score
    verdicts = []
    for (learner, recipe), arm in sorted(scores.items()):
        plain = scores.get((learner, PLAIN))
        if recipe == PLAIN or plain is None:
            continue
        verdicts.append(judge_arm(learner, recipe, plain, arm, (diagnostics or {}).get(recipe)))
    return sorted(verdicts, key=lambda v: (v["learner"], -v["difference"]))


def headline(verdicts: Iterable[ArmVerdict]) -> str:
    """One line for the terminal and the top of the report: the best arm per learner."""
    best: dict[str, ArmVerdict] = {}
    for verdict in verdicts:
        if (
            verdict["learner"] not in best
            or verdict["difference"] > best[verdict["learner"]]["difference"]
        ):
            best[verdict["learner"]] = verdict
    if not best:
        return "No verdict: the run trained no learner on both original and augmented data."
    return " ".join(v["sentence"] for v in best.values())


def as_json(verdicts: Iterable[ArmVerdict]) -> list[dict[str, Any]]:
    """The verdicts as plain JSON-ready dicts (for metrics.json)."""
    return [dict(v) for v in verdicts]
