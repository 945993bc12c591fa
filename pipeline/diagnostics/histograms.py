"""Quantiles and histograms in the shapes of :mod:`offaug.pipeline.diagnostics.document`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from offaug.pipeline.diagnostics.document import QUANTILE_LEVELS, PairedHistogram, Quantiles


def quantiles(values: npt.ArrayLike) -> Quantiles:
    """``{"levels": QUANTILE_LEVELS, "values": [...]}`` (values empty for no data)."""
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        return {"levels": list(QUANTILE_LEVELS), "values": []}
    return {
        "levels": list(QUANTILE_LEVELS),
        "values": [float(v) for v in np.quantile(array, QUANTILE_LEVELS)],
    }


def shared_histogram(series: Mapping[str, npt.ArrayLike | None], bins: int) -> dict[str, Any]:
    """Counts of several series over one set of edges: ``{"edges": [...], name: [...]}``.

    A series that is None stays None; finite values only.
    """
    arrays = {
        name: None if values is None else np.asarray(values, dtype=np.float64).reshape(-1)
        for name, values in series.items()
    }
    present = [a[np.isfinite(a)] for a in arrays.values() if a is not None]
    pooled = np.concatenate(present) if present else np.zeros(0)
    if pooled.size == 0:
        edges = np.linspace(0.0, 1.0, bins + 1)
    else:
        low, high = float(pooled.min()), float(pooled.max())
        if high <= low:
            low, high = low - 0.5, high + 0.5
        edges = np.linspace(low, high, bins + 1)
    out: dict[str, Any] = {"edges": edges.tolist()}
    for name, array in arrays.items():
        if array is None:
            out[name] = None
        else:
            counts, _ = np.histogram(array[np.isfinite(array)], bins=edges)
            out[name] = counts.astype(int).tolist()
    return out


def paired_histogram(
    original: npt.ArrayLike | None, augmented: npt.ArrayLike | None, bins: int
) -> PairedHistogram:
    """:func:`shared_histogram` of an original and an augmented series."""
    counts = shared_histogram({"original": original, "augmented": augmented}, bins)
    return {
        "edges": counts["edges"],
        "original": counts["original"],
        "augmented": counts["augmented"],
    }
