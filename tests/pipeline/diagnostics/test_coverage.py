"""The ``coverage`` section: identical states score 1 - quantile, noise states are OOD."""

from __future__ import annotations

import numpy as np
import pytest

from offaug.pipeline import diagnostics as diag
from tests.pipeline.diagnostics.helpers import (
    Hopper,
    noise_copy,
)


def test_identical_states_score_one_minus_quantile(hopper: Hopper) -> None:
    observations = np.asarray(hopper.data.observations)
    coverage = diag.state_coverage(
        observations,
        observations.copy(),
        k=5,
        quantile=0.95,
        max_states=10_000,
        rng=np.random.default_rng(0),
    )
    # Same states, same leave-one-out distances: exactly the share above the 0.95 quantile,
    # which is 0.05 up to the quantile's interpolation (tolerance 0.01 on ~800 states).
    assert coverage["ood_fraction"] == pytest.approx(0.05, abs=0.01)
    assert coverage["range_violation"]["any_dimension"] == 0.0


def test_fresh_states_from_the_same_distribution_score_one_minus_quantile() -> None:
    rng = np.random.default_rng(1)
    original = rng.normal(size=(3000, 4))
    augmented = rng.normal(size=(3000, 4))
    coverage = diag.state_coverage(
        original, augmented, k=5, quantile=0.9, max_states=3000, rng=np.random.default_rng(2)
    )
    # 0.1 expected; tolerance 0.03: about 5 binomial standard deviations plus the threshold's
    # own sampling error.
    assert coverage["ood_fraction"] == pytest.approx(0.1, abs=0.03)


def test_noise_states_are_out_of_distribution(hopper: Hopper) -> None:
    noise = noise_copy(hopper.data)
    coverage = diag.state_coverage(
        hopper.data.observations,
        noise.observations,
        k=5,
        quantile=0.95,
        max_states=2000,
        rng=np.random.default_rng(0),
    )
    assert coverage["ood_fraction"] > 0.99
    assert coverage["range_violation"]["any_dimension"] > 0.99
    assert min(coverage["range_violation"]["per_dimension"]) > 0.9


def test_knn_distances_leave_the_query_out() -> None:
    from scipy.spatial import cKDTree

    points = np.array([[0.0], [1.0], [3.0], [7.0]])
    tree = cKDTree(points)
    # k = 1: nearest *other* point for members, nearest point for a new query.
    assert diag.knn_distances(tree, 4, points, 1) == pytest.approx([1.0, 1.0, 2.0, 4.0])
    assert diag.knn_distances(tree, 4, np.array([[2.0]]), 1) == pytest.approx([1.0])
