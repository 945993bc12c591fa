"""Conserved quantities of a dataset's observations, and the projection of a predicted state
back onto them.

Some observations are functions of a smaller state. Pendulum-v1 records (cos θ, sin θ, θ̇), so
every observation keeps cos² θ + sin² θ = 1; an env that records a unit quaternion keeps its
norm. A learned model's step does not know that: over a long rollout its predictions drift off
the states the env can be in, and a search that picks the continuation the model scores highest
goes where the model is wrong in its favour (benchmarks/LOG.md, 2026-12-07: the search's
100-step episodes in Pendulum's ensemble, 25-39 % of rows more than 0.05 off the unit circle).
The members agree on that error, so no uncertainty penalty sees it.

:func:`find_invariants` finds every quadratic function of the standardised observation,
``g(z) = w · φ(z)`` with ``φ(z) = (z_i, z_i z_j for i ≤ j)``, that is constant over the data: the
eigenvectors of the features' covariance whose eigenvalue is below ``tolerance`` times the
largest. Only exact relations pass: Pendulum's circle holds to float32's precision (an
eigenvalue near 1e-15 of the largest), where the closest relation in 20,000 random-action
Hopper-v5 observations stands at 3e-9 and is no invariant. A dataset without one (most MuJoCo
observations: joint positions and velocities) gets none, and so does one with too few rows to
tell (fewer than ten per feature) or too many dimensions (over :data:`MAX_DIMENSIONS`).
:meth:`QuadraticInvariants.project` then moves a batch of predicted states to the nearest point
(in the standardised metric) where every invariant keeps the data's value, by Gauss-Newton
steps on the constraints ``g(z) = c`` (``z ← z − Jᵀ (J Jᵀ)⁻¹ (g(z) − c)``), as manifold
integrators project a step back onto a constraint.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch

MAX_DIMENSIONS = 32
"""Observations wider than this get no invariants (their quadratic features grow as d²/2)."""
ROWS_PER_FEATURE = 10
"""Rows the search needs per quadratic feature, so a null direction is the data's, not the
sample's."""
CONSTANT_SCALE = 1e-6
"""Observation dimensions with a smaller standard deviation are left out (constant)."""


@dataclasses.dataclass(frozen=True)
class QuadraticInvariants:
    """``k`` quadratic functions of the observation that the data keeps constant."""

    dimensions: torch.Tensor
    """(m,) int64: the observation dimensions the features are made of (the non-constant ones)."""
    mean: torch.Tensor
    """(m,) their mean over the data."""
    scale: torch.Tensor
    """(m,) their standard deviation: ``z = (x - mean) / scale``."""
    weights: torch.Tensor
    """(k, F) unit-norm combinations of the features ``φ(z)`` (F = m + m(m+1)/2)."""
    values: torch.Tensor
    """(k,) each combination's value over the data."""

    @property
    def count(self) -> int:
        """How many invariants there are (0: the projection is the identity)."""
        return int(self.weights.shape[0])

    @functools.cached_property
    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (i, j), i <= j, of the product features, in their order."""
        first, second = torch.triu_indices(len(self.dimensions), len(self.dimensions))
        return first, second

    def _features(self, z: torch.Tensor) -> torch.Tensor:
        """``(B, m) -> (B, F)``: the standardised values, then their products ``z_i z_j``."""
        first, second = self._pairs
        return torch.cat([z, z[:, first] * z[:, second]], 1)

    def violation(self, observations: torch.Tensor) -> torch.Tensor:
        """``(B, obs) -> (B, k)``: each invariant's value minus the data's."""
        z = (observations[:, self.dimensions].double() - self.mean) / self.scale
        return self._features(z) @ self.weights.T - self.values

    def project(self, observations: torch.Tensor, iterations: int = 3) -> torch.Tensor:
        """``(B, obs) -> (B, obs)``: each state moved to the nearest one (standardised metric)
        that keeps every invariant at the data's value; dimensions outside the invariants, and
        every state when there are none, unchanged."""
        if self.count == 0:
            return observations
        first, second = self._pairs
        m = len(self.dimensions)
        z = (observations[:, self.dimensions].double() - self.mean) / self.scale  # (B, m)
        eye = torch.eye(m, dtype=z.dtype)
        for _ in range(iterations):
            residual = self._features(z) @ self.weights.T - self.values  # (B, k)
            # d(z_i z_j)/dz = z_j e_i + z_i e_j: (B, pairs, m).
            products = z[:, second, None] * eye[first] + z[:, first, None] * eye[second]
            jacobian_features = torch.cat([eye.expand(len(z), m, m), products], 1)  # (B, F, m)
            jacobian = self.weights @ jacobian_features  # (B, k, m)
            gram = jacobian @ jacobian.transpose(1, 2)  # (B, k, k)
            # Damped: invariants may be dependent (a dimension fixed by another gives several).
            gram = gram + 1e-9 * torch.eye(self.count, dtype=z.dtype)
            step = torch.linalg.solve(gram, residual[..., None])  # (B, k, 1)
            z = z - (jacobian.transpose(1, 2) @ step)[..., 0]
        projected = observations.clone()
        projected[:, self.dimensions] = (z * self.scale + self.mean).to(observations.dtype)
        return projected

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The invariants' tensors, by field, to keep in a model's checkpoint."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> QuadraticInvariants:
        """Restore :meth:`state_dict`."""
        return cls(**{field.name: state[field.name] for field in dataclasses.fields(cls)})


def find_invariants(observations: npt.ArrayLike, tolerance: float = 1e-12) -> QuadraticInvariants:
    """The quadratic functions of ``observations`` ``(N, obs)`` constant over its rows (the
    module docstring says how); none where the rows are too few or the observation too wide."""
    x = np.asarray(observations, dtype=np.float64)
    scale = x.std(0) if len(x) else np.zeros(x.shape[1])
    dimensions = np.flatnonzero(scale > CONSTANT_SCALE)
    m = len(dimensions)
    n_features = m + m * (m + 1) // 2
    mean = x[:, dimensions].mean(0) if len(x) else np.zeros(m)
    none = QuadraticInvariants(
        torch.as_tensor(dimensions, dtype=torch.long),
        torch.as_tensor(mean),
        torch.as_tensor(scale[dimensions]),
        torch.zeros((0, n_features), dtype=torch.float64),
        torch.zeros(0, dtype=torch.float64),
    )
    if m == 0 or m > MAX_DIMENSIONS or len(x) < ROWS_PER_FEATURE * n_features:
        return none
    z = (x[:, dimensions] - mean) / scale[dimensions]
    first, second = np.triu_indices(m)
    features = np.concatenate([z, z[:, first] * z[:, second]], 1)  # (N, F)
    eigenvalues, eigenvectors = np.linalg.eigh(np.cov(features, rowvar=False))
    null = eigenvalues <= tolerance * max(float(eigenvalues[-1]), 1e-300)
    weights = eigenvectors[:, null].T  # (k, F)
    return dataclasses.replace(
        none,
        weights=torch.as_tensor(weights),
        values=torch.as_tensor(features.mean(0) @ weights.T),
    )
