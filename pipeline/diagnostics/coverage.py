"""The ``coverage`` section: how far augmented states lie from the original data's states.

The OOD score of a state is its distance to the k-th nearest original state, in the state space
standardised by the original sample's mean and std. The threshold is the ``quantile`` of the
original states' own leave-one-out k-NN distances, so in-distribution data scores an OOD
fraction of about ``1 - quantile``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.document import CoverageSection, RangeViolation
from offaug.pipeline.diagnostics.histograms import paired_histogram, quantiles
from offaug.pipeline.diagnostics.sampling import FloatArray, flat, sample_indices


def standardiser(reference: npt.NDArray[Any]) -> tuple[FloatArray, FloatArray]:
    """Mean and std of ``reference`` per dimension (a constant dimension gets std 1)."""
    array = np.asarray(reference, dtype=np.float64)
    std = array.std(axis=0)
    return array.mean(axis=0), np.where(std > 1e-8, std, 1.0)


def knn_distances(tree: Any, reference_size: int, queries: FloatArray, k: int) -> FloatArray:
    """Distance of each query to its k-th nearest reference point, leaving the query out.

    ``k + 1`` neighbours are asked for; a query found in the reference at distance 0 (itself, or
    an identical state) is dropped from its own neighbours, which makes the reference's own
    distances leave-one-out and gives data identical to the reference the same distances.
    """
    if len(queries) == 0:
        return np.zeros(0)
    asked = min(k + 1, reference_size)
    distances, _ = tree.query(queries, k=asked)
    distances = np.asarray(distances, dtype=np.float64).reshape(len(queries), asked)
    self_match = distances[:, 0] == 0.0
    column = np.where(self_match, min(k, asked - 1), min(k - 1, asked - 1))
    return np.asarray(distances[np.arange(len(queries)), column], dtype=np.float64)


def range_violations(original: npt.NDArray[Any], augmented: npt.NDArray[Any]) -> RangeViolation:
    """Fraction of augmented states outside the original's per-dimension [min, max]."""
    # Views, not copies: these are all rows, possibly memory-mapped.
    reference = np.asarray(original).reshape(len(original), -1)
    states = np.asarray(augmented).reshape(len(augmented), -1)
    if len(states) == 0 or len(reference) == 0:
        return {
            "per_dimension": [],
            "any_dimension": 0.0,
            "worst_dimension": None,
            "worst_fraction": 0.0,
        }
    outside = (states < reference.min(axis=0)) | (states > reference.max(axis=0))
    per_dimension = outside.mean(axis=0)
    worst = int(np.argmax(per_dimension))
    return {
        "per_dimension": [float(v) for v in per_dimension],
        "any_dimension": float(outside.any(axis=1).mean()),
        "worst_dimension": worst,
        "worst_fraction": float(per_dimension[worst]),
    }


def state_coverage(
    original: npt.NDArray[Any],
    augmented: npt.NDArray[Any],
    *,
    k: int,
    quantile: float,
    max_states: int,
    rng: np.random.Generator,
    bins: int = 30,
) -> CoverageSection:
    """The ``coverage`` section: k-NN OOD score of augmented states against the original.

    Up to ``max_states`` states of each are sampled; both are standardised with the original
    sample's mean and std; the threshold is the ``quantile`` of the original sample's own
    leave-one-out k-NN distances.
    """
    # Imported here: scipy's spatial package is heavy and only this section needs it.
    from scipy.spatial import cKDTree

    reference = flat(np.asarray(original)[sample_indices(len(original), max_states, rng)])
    queries = flat(np.asarray(augmented)[sample_indices(len(augmented), max_states, rng)])
    mean, std = standardiser(reference)
    reference_std = (reference - mean) / std
    queries_std = (queries - mean) / std
    tree = cKDTree(reference_std)
    own = knn_distances(tree, len(reference_std), reference_std, k)
    threshold = float(np.quantile(own, quantile)) if own.size else 0.0
    distances = knn_distances(tree, len(reference_std), queries_std, k)
    return {
        "k": k,
        "quantile": quantile,
        "threshold": threshold,
        "ood_fraction": float(np.mean(distances > threshold)) if distances.size else 0.0,
        "states": {"original": len(reference), "augmented": len(queries)},
        "original_distances": quantiles(own),
        "augmented_distances": quantiles(distances),
        "histogram": paired_histogram(own, distances, bins),
        "range_violation": range_violations(original, augmented),
    }
