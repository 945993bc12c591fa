"""Scores over seeds, aggregated as rliable recommends (Agarwal et al. 2021, arXiv:2108.13264).

Words used here:

* *scores*: an array ``(runs, tasks)`` of final normalised scores, one row per training seed
  (a 1-D array is one task);
* *IQM*: the interquartile mean, the mean of the middle 50 % of all runs' scores;
* *interval*: a 95 % stratified bootstrap confidence interval (runs resampled within each task);
* *probability of improvement*: P(X > Y), the chance that a run of one arm beats a run of the
  other, ties counting half (rliable's Mann-Whitney form).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
from rliable import library as rly
from rliable import metrics

FloatArray = npt.NDArray[np.float64]

BOOTSTRAP_REPS = 2000
"""Bootstrap resamples per interval: enough for two-digit intervals, fast on a CPU."""


def as_scores(values: npt.ArrayLike) -> FloatArray:
    """``values`` as a ``(runs, tasks)`` float array (a 1-D array becomes one task)."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[0] == 0:
        raise ValueError(
            f"scores must be (runs,) or (runs, tasks) with runs >= 1, got {array.shape}"
        )
    return array


def iqm(values: npt.ArrayLike) -> float:
    """The interquartile mean of all runs' scores."""
    return float(metrics.aggregate_iqm(as_scores(values)))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval."""

    value: float
    low: float
    high: float


@contextlib.contextmanager
def _seeded_global_rng(seed: int) -> Iterator[None]:
    # rliable's stratified bootstrap draws from numpy's global RNG (np.random.choice), not from
    # the generator it is given: seed that one for the call and put the caller's state back.
    state = np.random.get_state()  # noqa: NPY002 (the global RNG is the one rliable uses)
    np.random.seed(seed)  # noqa: NPY002
    try:
        yield
    finally:
        np.random.set_state(state)  # noqa: NPY002


def _interval(
    samples: list[FloatArray], statistic: Callable[..., FloatArray], reps: int, seed: int
) -> Estimate:
    # One arm: a stratified bootstrap over its runs; two arms: each resampled independently.
    with _seeded_global_rng(seed):
        bootstrap = (
            rly.StratifiedBootstrap(samples[0])
            if len(samples) == 1
            else rly.StratifiedIndependentBootstrap(*samples, seed=seed)
        )
        low, high = np.asarray(
            bootstrap.conf_int(statistic, reps=reps, size=0.95, method="percentile"),
            dtype=np.float64,
        ).reshape(2)
    point = float(np.asarray(statistic(*samples)).reshape(-1)[0])
    return Estimate(point, float(low), float(high))


def iqm_estimate(values: npt.ArrayLike, *, reps: int = BOOTSTRAP_REPS, seed: int = 0) -> Estimate:
    """IQM with its 95 % stratified bootstrap interval (a single run gives a zero-width one)."""
    scores = as_scores(values)
    if scores.shape[0] < 2:
        value = iqm(scores)
        return Estimate(value, value, value)
    return _interval([scores], lambda s: np.array([metrics.aggregate_iqm(s)]), reps, seed)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """An arm against a baseline over seeds."""

    arm: Estimate
    """The arm's IQM and interval."""
    baseline: Estimate
    """The baseline's IQM and interval."""
    difference: Estimate
    """IQM(arm) - IQM(baseline), with the interval of the difference."""
    probability_of_improvement: float
    """P(a run of the arm beats a run of the baseline), ties counting half."""
    arm_runs: int
    baseline_runs: int


def compare(
    baseline: npt.ArrayLike,
    arm: npt.ArrayLike,
    *,
    reps: int = BOOTSTRAP_REPS,
    seed: int = 0,
) -> Comparison:
    """Compare ``arm`` with ``baseline``: IQMs, their difference's interval, P(arm > baseline)."""
    base_scores, arm_scores = as_scores(baseline), as_scores(arm)
    if base_scores.shape[1] != arm_scores.shape[1]:
        raise ValueError(
            f"arm and baseline cover different tasks ({arm_scores.shape[1]} vs "
            f"{base_scores.shape[1]})"
        )
    improvement = float(metrics.probability_of_improvement(arm_scores, base_scores))
    if min(base_scores.shape[0], arm_scores.shape[0]) < 2:
        gap = iqm(arm_scores) - iqm(base_scores)
        difference = Estimate(gap, gap, gap)
    else:
        difference = _interval(
            [base_scores, arm_scores],
            lambda b, a: np.array([metrics.aggregate_iqm(a) - metrics.aggregate_iqm(b)]),
            reps,
            seed,
        )
    return Comparison(
        arm=iqm_estimate(arm_scores, reps=reps, seed=seed),
        baseline=iqm_estimate(base_scores, reps=reps, seed=seed),
        difference=difference,
        probability_of_improvement=improvement,
        arm_runs=int(arm_scores.shape[0]),
        baseline_runs=int(base_scores.shape[0]),
    )
