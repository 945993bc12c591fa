"""The verdicts on hand-made scores: helps, hurts, inconclusive, the reasons they name, and the
best augmented arm against the best plain arm at equal gradient steps."""

from __future__ import annotations

import pytest

from offaug.pipeline.contracts import PLAIN
from offaug.pipeline.outcome.verdict import RunScore, headline, judge, judge_arm, judge_best


def _runs(learner: str, recipe: str, scores: list[float]) -> list[RunScore]:
    return [RunScore(learner, recipe, seed, score) for seed, score in enumerate(scores)]


PLAIN_SCORES = [40.0, 42.0, 44.0, 41.0, 43.0]


def test_a_clearly_better_arm_helps() -> None:
    runs = _runs("cql", PLAIN, PLAIN_SCORES) + _runs("cql", "branch", [60, 62, 61, 63, 64])
    (verdict,) = judge(runs)
    assert verdict["outcome"] == "helps"
    assert verdict["interval"][0] > 0
    assert verdict["probability_of_improvement"] == 1.0
    assert verdict["reasons"] == []
    assert "augmentation helps" in verdict["sentence"]
    assert verdict["seeds"] == [0, 1, 2, 3, 4]


def test_a_clearly_worse_arm_hurts_and_names_the_diagnostic_reason() -> None:
    diagnostics = {
        "noisy": {
            "augmented_reward_per_step": -6.0,
            "original_reward_per_step": -2.5,
            "ess_fraction": 0.03,
            "weighting": "behaviour",
            "ood_share": 0.5,
        }
    }
    runs = _runs("cql", PLAIN, PLAIN_SCORES) + _runs("cql", "noisy", [20, 22, 21, 19, 18])
    (verdict,) = judge(runs, diagnostics)  # type: ignore[arg-type]
    assert verdict["outcome"] == "hurts"
    assert verdict["interval"][1] < 0
    text = " ".join(verdict["reasons"])
    assert "rollout policy is worse than the data" in text
    assert "ESS/N = 0.03" in text
    assert "50%" in text


def test_overlapping_arms_are_inconclusive_and_one_seed_is_an_anecdote() -> None:
    same = judge_arm(
        "bcq", "mix", dict(enumerate(PLAIN_SCORES)), dict(enumerate([41, 43, 40, 44, 42]))
    )
    assert same["outcome"] == "inconclusive"
    assert same["interval"][0] < 0 < same["interval"][1]
    single = judge_arm("bcq", "mix", {0: 10.0}, {0: 90.0})
    assert single["outcome"] == "inconclusive"
    assert "anecdote" in single["sentence"]


def test_only_shared_seeds_count_and_headline_picks_the_best_arm() -> None:
    runs = (
        _runs("cql", PLAIN, PLAIN_SCORES)
        + _runs("cql", "a", [50, 50, 50, 50, 50, 99])  # seed 5 has no plain run
        + _runs("cql", "b", [30, 30, 30, 30, 30])
    )
    verdicts = judge(runs)
    assert [v["recipe"] for v in verdicts] == ["a", "b"]
    assert verdicts[0]["seeds"] == [0, 1, 2, 3, 4]
    assert headline(verdicts).startswith("cql with a: augmentation helps")


def test_an_arm_whose_filter_kept_nothing_says_so() -> None:
    runs = _runs("cql", PLAIN, PLAIN_SCORES) + _runs("cql", "filtered", [41, 43, 40, 44, 42])
    (verdict,) = judge(runs, {"filtered": {"augmented_rows": 0}})
    assert verdict["outcome"] == "inconclusive"
    assert "the filter kept no augmented episode" in verdict["reasons"][0]


def _arm(
    learner: str, recipe: str, scores: list[float], steps: int, own: int | None = None
) -> list[RunScore]:
    """One run per seed with ``steps`` in all; an augmented arm (``own`` given) trained ``own``
    of them itself and rolled out 900 simulator steps, a plain arm none."""
    return [
        RunScore(learner, recipe, seed, score, steps, own or steps, 0 if own is None else 900)
        for seed, score in enumerate(scores)
    ]


def _study(augmented: list[float]) -> list[RunScore]:
    """Two learners: each plain at train.steps (1,000) and at the augmented arms' total (3,000),
    and one recipe each; bcq's plain arm at 3,000 steps is the best plain arm there; cql's at
    5,000 steps is better but was trained longer than the augmented arms."""
    return (
        _arm("cql", PLAIN, [30, 32, 34, 31, 33], 1000)
        + _arm("cql", "baseline[3000]", [40, 42, 44, 41, 43], 3000)
        + _arm("cql", "baseline[5000]", [90, 92, 94, 91, 93], 5000)
        + _arm("bcq", PLAIN, [20, 22, 21, 23, 24], 1000)
        + _arm("bcq", "baseline[3000]", [50, 52, 54, 51, 53], 3000)
        + _arm("cql", "branch", augmented, 3000, own=1000)
        + _arm("bcq", "branch", [10, 11, 12, 13, 14], 3000, own=1000)
    )


def test_best_augmented_against_best_plain_at_equal_steps_helps() -> None:
    comparison = judge_best(_study([70, 72, 71, 73, 74]))
    assert comparison["outcome"] == "helps"
    assert comparison["augmented"] is not None and comparison["plain"] is not None
    assert (comparison["augmented"]["learner"], comparison["augmented"]["recipe"]) == (
        "cql",
        "branch",
    )
    assert comparison["augmented"]["steps"] == 3000
    assert comparison["augmented"]["own_steps"] == 1000
    assert comparison["augmented"]["simulator_steps"] == 900
    # The best plain arm at 3,000 steps or fewer, not cql's better plain run at 5,000.
    assert comparison["plain"]["learner"] == "bcq"
    assert comparison["plain"]["recipe"] == "baseline[3000]"
    assert comparison["plain"]["steps"] == 3000
    assert comparison["plain"]["iqm"] == pytest.approx(52.0)
    assert comparison["difference"] == pytest.approx(72.0 - 52.0)
    assert comparison["interval"] is not None and comparison["interval"][0] > 0
    assert comparison["probability_of_improvement"] == 1.0
    assert comparison["seeds"] == [0, 1, 2, 3, 4]
    sentence = comparison["sentence"]
    assert sentence.startswith("Best augmented arm cql with branch")
    assert "3,000 gradient steps, 1,000 its own" in sentence
    assert "best plain arm bcq" in sentence and "augmentation helps" in sentence


def test_best_augmented_against_best_plain_hurts_or_is_inconclusive() -> None:
    hurts = judge_best(_study([30, 31, 32, 33, 34]))
    assert hurts["outcome"] == "hurts"
    assert hurts["interval"] is not None and hurts["interval"][1] < 0
    assert "augmentation hurts" in hurts["sentence"]
    close = judge_best(_study([50, 53, 51, 54, 52]))
    assert close["outcome"] == "inconclusive"
    assert close["interval"] is not None and close["interval"][0] < 0 < close["interval"][1]
    assert "no clear difference" in close["sentence"]
    # The per-learner verdict still compares with the same learner's plain arm alone.
    assert {(v["learner"], v["recipe"]) for v in judge(_study([50, 53, 51, 54, 52]))} == {
        ("cql", "branch"),
        ("bcq", "branch"),
    }


def test_a_plain_arm_better_at_fewer_steps_is_the_bar() -> None:
    """Offline learners can degrade with steps: a plain run that scores better trained shorter
    is what a user gets for less, so it is the bar, and the sentence names its own steps."""
    study = (
        _arm("bc", PLAIN, [80, 82, 84, 81, 83], 1000)
        + _arm("bc", "baseline[3000]", [60, 62, 64, 61, 63], 3000)
        + _arm("iql", "baseline[3000]", [50, 52, 54, 51, 53], 3000)
        + _arm("bc", "branch", [83, 85, 87, 84, 86], 3000, own=1000)
    )
    comparison = judge_best(study)
    assert comparison["plain"] is not None
    assert (comparison["plain"]["recipe"], comparison["plain"]["steps"]) == (PLAIN, 1000)
    assert comparison["difference"] == pytest.approx(85.0 - 82.0)
    assert "best plain arm bc (IQM 82.0, 1,000 gradient steps)" in comparison["sentence"]
    # Against the plain arm trained as long alone (the old bar) the same arm would have won by 23.
    assert comparison["difference"] < 85.0 - 62.0


def test_best_against_best_says_why_it_has_no_verdict() -> None:
    plain_only = judge_best(_arm("cql", PLAIN, [1, 2, 3], 1000))
    assert plain_only["outcome"] is None and "no augmented arm" in plain_only["sentence"]
    no_bar = judge_best(
        _arm("cql", PLAIN, [1, 2, 3], 1000) + _arm("cql", "branch", [5, 6, 7], 3000, own=1000)
    )
    assert no_bar["outcome"] is None and no_bar["plain"] is None
    assert "no plain arm was trained for as many" in no_bar["sentence"]
    expert = judge_best(
        _arm("cql", "baseline[3000]", [100, 101, 102], 3000)
        + _arm("cql", "branch", [99, 100, 101], 3000, own=1000)
    )
    assert "already reaches the expert" in expert["sentence"]
