"""An action space's box: its bounds, and the affine map between them and ``[-1, 1]^d``.

One class for both uses: the dataset doctor reads the bounds (a Discrete space of ``n`` actions
from ``start`` is the box ``[start, start + n - 1]``); the rollouts and the diagnostics map Box
actions into the learners' ``[-1, 1]^d`` with it, as a trainer's
:class:`~offaug.algorithms.nn.distributions.ActionNormaliser` does in torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, eq=False)
class ActionBox:
    """The bounds of an action space, one entry per (flattened) dimension, inclusive."""

    low: FloatArray
    """(d,) lower bounds."""
    high: FloatArray
    """(d,) upper bounds."""

    @classmethod
    def from_bounds(cls, low: npt.ArrayLike, high: npt.ArrayLike) -> ActionBox:
        """The box ``[low, high]``, flattened to float64."""
        return cls(
            np.asarray(low, dtype=np.float64).reshape(-1),
            np.asarray(high, dtype=np.float64).reshape(-1),
        )

    @classmethod
    def from_normaliser(cls, normaliser: Any) -> ActionBox:
        """The box a trainer's ``ActionNormaliser`` maps onto ``[-1, 1]^d`` (from its ``scale``
        and ``offset`` buffers), so a rollout maps actions as its trainer does."""
        scale = normaliser.scale.detach().cpu().numpy().astype(np.float64)
        offset = normaliser.offset.detach().cpu().numpy().astype(np.float64)
        return cls((-1.0 - offset) / scale, (1.0 - offset) / scale)

    @property
    def scale(self) -> FloatArray:
        """(d,) ``2 / (high - low)``: ``box = env * scale + offset``."""
        return np.asarray(2.0 / (self.high - self.low), dtype=np.float64)

    @property
    def offset(self) -> FloatArray:
        """(d,) ``-1 - low * scale``."""
        return np.asarray(-1.0 - self.low * self.scale, dtype=np.float64)

    def normalise(self, env_actions: npt.ArrayLike) -> FloatArray:
        """Environment actions into ``[-1, 1]^d`` (clipped), as the learners see them."""
        box = np.asarray(env_actions, dtype=np.float64) * self.scale + self.offset
        return np.asarray(np.clip(box, -1.0, 1.0), dtype=np.float64)

    def to_env(self, actions: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Normalised actions back to the environment's bounds."""
        return ((np.asarray(actions, dtype=np.float64) - self.offset) / self.scale).astype(
            np.float32
        )

    @property
    def log_abs_det(self) -> float:
        """log |d box / d env action|: add it to a box density to get the env-box density."""
        return float(np.log(np.abs(self.scale)).sum())
