"""The verdict: does augmentation help? Per learner and recipe, and best against best.

Each (learner, recipe) arm is compared with the same learner trained on the original data alone
("plain") over the training seeds both have (:func:`judge`): the IQM of final normalised scores,
the 95 % stratified bootstrap interval of the IQM difference and the probability of improvement
(:mod:`offaug.pipeline.outcome.statistics`). When an arm does not help, the recipe's diagnostics
name the likeliest reason and what to change.

The study's claim is :func:`judge_best`: the best augmented arm (by IQM over seeds, over every
learner and recipe) against the best plain arm (over every learner and every plain budget up to
the augmented arm's) trained for at most the same total gradient steps, the augmented arm's
rollout policy's and the plain run it starts from included, as docs/pipeline.md explains.

One rule everywhere: an arm *helps* when the interval of the IQM difference lies above zero,
*hurts* when it lies below, and is *inconclusive* otherwise (always so with fewer than two seeds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from offaug.pipeline.contracts import PLAIN, is_plain

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
    """The final score the verdict compares (the normalised score, or the return)."""
    steps: int | None = None
    """Total gradient steps behind the run (its rollout policy's included; None: unknown)."""
    own_steps: int | None = None
    """The run's own gradient steps."""
    simulator_steps: int | None = None
    """Simulator steps of the rollouts its data came from (every round)."""


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


class ArmSummary(TypedDict):
    """One side of the best-against-best comparison."""

    learner: str
    recipe: str
    steps: int | None
    """Total gradient steps of one run (an augmented arm's include its rollout policy's, and the
    plain run's it starts from)."""
    own_steps: int | None
    """The run's own gradient steps."""
    simulator_steps: int | None
    """Simulator steps of its rollouts per run, mean over seeds (0 for a plain arm)."""
    iqm: float
    iqm_interval: list[float]


class BestComparison(TypedDict):
    """The best augmented arm against the best plain arm at its total gradient steps or fewer
    (metrics.json ``comparison``); without one, every field but ``sentence`` is None."""

    outcome: Outcome | None
    plain: ArmSummary | None
    augmented: ArmSummary | None
    difference: float | None
    """IQM(augmented) - IQM(plain)."""
    interval: list[float] | None
    """95 % stratified bootstrap interval of the difference."""
    probability_of_improvement: float | None
    seeds: list[int] | None
    """The training seeds both arms have (the comparison's runs)."""
    sentence: str
    """The study's answer in one sentence (the report opens with it)."""


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
    outcome = _outcome(result.difference.low, result.difference.high, len(seeds))
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
        if is_plain(recipe) or plain is None:
            continue
        verdicts.append(judge_arm(learner, recipe, plain, arm, (diagnostics or {}).get(recipe)))
    return sorted(verdicts, key=lambda v: (v["learner"], -v["difference"]))


def _outcome(low: float, high: float, seeds: int) -> Outcome:
    if seeds >= _MIN_SEEDS and low > 0:
        return "helps"
    if seeds >= _MIN_SEEDS and high < 0:
        return "hurts"
    return "inconclusive"


def _no_comparison(sentence: str) -> BestComparison:
    return BestComparison(
        outcome=None,
        plain=None,
        augmented=None,
        difference=None,
        interval=None,
        probability_of_improvement=None,
        seeds=None,
        sentence=sentence,
    )


def _arm_summary(runs: list[RunScore], iqm: float, interval: list[float]) -> ArmSummary:
    simulator = [r.simulator_steps for r in runs if r.simulator_steps is not None]
    return ArmSummary(
        learner=runs[0].learner,
        recipe=runs[0].recipe,
        steps=runs[0].steps,
        own_steps=runs[0].own_steps,
        simulator_steps=round(sum(simulator) / len(simulator)) if simulator else None,
        iqm=iqm,
        iqm_interval=interval,
    )


def _steps(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _within(plain_steps: int | None, budget: int | None) -> bool:
    """Whether a plain arm of ``plain_steps`` is a candidate bar for an arm of ``budget``."""
    if plain_steps is None or budget is None:
        return plain_steps == budget
    return plain_steps <= budget


def judge_best(runs: Iterable[RunScore], *, expert: float | None = 100.0) -> BestComparison:
    """The best augmented arm against the best plain arm trained for at most its total steps.

    "Best" is the highest IQM over the arm's seeds, over every (learner, recipe). The plain
    candidates are every learner's plain runs with the augmented arm's total gradient steps or
    fewer: a learner that scores better trained shorter (offline learners often degrade with
    steps) is a bar a user could have had for less, so it is not dropped for one trained as long
    and worse. A plain run at exactly the augmented arm's total must exist (``train.baseline``),
    so that the bar is never only an under-trained one. Both arms are compared on the seeds they
    share. ``expert``: the score at which the plain arm leaves nothing to beat (100 for
    normalised scores; None for returns).
    """
    from offaug.pipeline.outcome.statistics import compare, iqm  # rliable: see judge_arm

    arms: dict[tuple[str, str], list[RunScore]] = {}
    for run in runs:
        arms.setdefault((run.learner, run.recipe), []).append(run)
    ranked = {key: iqm([r.normalised_score for r in arm]) for key, arm in arms.items()}
    augmented = sorted((k for k in arms if not is_plain(k[1])), key=lambda k: -ranked[k])
    if not augmented:
        return _no_comparison("No best-against-best verdict: no augmented arm was trained.")
    best = arms[augmented[0]]
    steps = best[0].steps
    plains = sorted(
        (k for k, arm in arms.items() if is_plain(k[1]) and _within(arm[0].steps, steps)),
        key=lambda k: -ranked[k],
    )
    name = f"{best[0].learner} with {best[0].recipe}"
    if not any(arms[k][0].steps == steps for k in plains):
        return _no_comparison(
            f"No best-against-best verdict: the best augmented arm ({name}) spent "
            f"{_steps(steps)} gradient steps and no plain arm was trained for as many "
            "(train.baseline is off)."
        )
    plain = arms[plains[0]]
    best_scores = {r.seed: r.normalised_score for r in best}
    plain_scores = {r.seed: r.normalised_score for r in plain}
    seeds = sorted(set(best_scores) & set(plain_scores))
    if not seeds:
        return _no_comparison(
            f"No best-against-best verdict: {name} and the best plain arm share no seed."
        )
    result = compare([plain_scores[s] for s in seeds], [best_scores[s] for s in seeds])
    low, high = result.difference.low, result.difference.high
    outcome = _outcome(low, high, len(seeds))
    words = {
        "helps": "augmentation helps",
        "hurts": "augmentation hurts",
        "inconclusive": "no clear difference",
    }[outcome]
    if len(seeds) < _MIN_SEEDS:
        words = "one seed is an anecdote, not a verdict"
    augmented_arm = _arm_summary(best, result.arm.value, [result.arm.low, result.arm.high])
    own, simulator = augmented_arm["own_steps"], augmented_arm["simulator_steps"]
    spent = f"{_steps(steps)} gradient steps" + (f", {_steps(own)} its own" if own else "")
    spent += f", {simulator:,} simulator steps" if simulator else ""
    sentence = (
        f"Best augmented arm {name} (IQM {result.arm.value:.1f}, {spent}) against the best "
        f"plain arm {plain[0].learner} (IQM {result.baseline.value:.1f}, "
        f"{_steps(plain[0].steps)} gradient steps): {words}; difference "
        f"{result.difference.value:+.1f}, 95% CI [{low:+.1f}, {high:+.1f}], P(improvement) = "
        f"{result.probability_of_improvement:.2f}, "
        f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}."
    )
    if expert is not None and result.baseline.value >= expert:
        sentence += " The best plain arm already reaches the expert: there is nothing to beat."
    return BestComparison(
        outcome=outcome,
        plain=_arm_summary(
            plain, result.baseline.value, [result.baseline.low, result.baseline.high]
        ),
        augmented=augmented_arm,
        difference=result.difference.value,
        interval=[low, high],
        probability_of_improvement=result.probability_of_improvement,
        seeds=seeds,
        sentence=sentence,
    )


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
