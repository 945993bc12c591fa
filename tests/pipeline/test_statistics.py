"""rliable aggregates on inputs whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline.outcome.statistics import as_scores, compare, iqm, iqm_estimate


def test_iqm_is_the_mean_of_the_middle_half() -> None:
    # 8 runs: the lowest two and the highest two are cut, leaving 3, 4, 5, 6.
    assert iqm([8, 1, 7, 2, 6, 3, 5, 4]) == pytest.approx(4.5)
    assert iqm([[0.0, 10.0]] * 4) == pytest.approx(5.0)


def test_scores_shape_is_checked() -> None:
    assert as_scores([1.0, 2.0]).shape == (2, 1)
    with pytest.raises(ValueError, match="runs >= 1"):
        as_scores([])


def test_separated_arms_have_an_interval_above_zero_and_certain_improvement() -> None:
    rng = np.random.default_rng(0)
    baseline = rng.normal(0.0, 1.0, size=10)
    arm = baseline + 10.0
    result = compare(baseline, arm, reps=500)
    assert result.probability_of_improvement == pytest.approx(1.0)
    assert result.difference.value == pytest.approx(10.0)
    assert 0 < result.difference.low <= 10.0 <= result.difference.high
    assert result.arm_runs == result.baseline_runs == 10


def test_equal_arms_are_inconclusive() -> None:
    scores = np.arange(10, dtype=np.float64)
    result = compare(scores, scores.copy(), reps=500)
    assert result.probability_of_improvement == pytest.approx(0.5)
    assert result.difference.value == pytest.approx(0.0)
    assert result.difference.low < 0 < result.difference.high


def test_interval_brackets_the_point_and_repeats_with_the_seed() -> None:
    scores = np.random.default_rng(1).uniform(size=12)
    first, second = iqm_estimate(scores, reps=300, seed=3), iqm_estimate(scores, reps=300, seed=3)
    assert first == second
    assert first.low <= first.value <= first.high
    one_run = iqm_estimate([2.0])
    assert (one_run.low, one_run.value, one_run.high) == (2.0, 2.0, 2.0)
