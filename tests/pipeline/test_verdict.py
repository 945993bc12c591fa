"""The verdict on hand-made scores: helps, hurts, inconclusive, and the reasons it names."""

from __future__ import annotations

from offaug.pipeline.contracts import PLAIN
from offaug.pipeline.outcome.verdict import RunScore, headline, judge, judge_arm


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
