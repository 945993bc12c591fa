"""The truncated normal's log-density, written once for numpy and for torch.

The formula takes its elementwise operations as an :class:`ArrayOps` (numpy with scipy's
special functions for the rollouts, torch for the learners), so both evaluate the same maths:
:func:`offaug.algorithms.nn.distributions.truncated_normal_log_prob` (torch) and
:func:`offaug.pipeline.rollouts.noise.truncnorm_log_prob` (numpy) are this function. Small rollout
batches stay in numpy, where a call costs a fraction of torch's per-op overhead. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclasses.dataclass(frozen=True)
class ArrayOps:
    """The elementwise operations the formula needs, from one array library."""

    exp: Callable[[Any], Any]
    log: Callable[[Any], Any]
    log1p: Callable[[Any], Any]
    where: Callable[[Any, Any, Any], Any]
    ndtr: Callable[[Any], Any]
    """The standard normal CDF Phi."""
    log_ndtr: Callable[[Any], Any]
    """log Phi, accurate far in the lower tail."""
    clamp: Callable[[Any, float | None, float | None], Any]
    """``clamp(x, low, high)``; None leaves that side open."""
    any: Callable[[Any], bool]
    """Whether any element is true; a library that must not branch on data (a compiled or
    GPU graph) answers True and always takes the exact branch."""


def truncated_normal_log_prob(
    ops: ArrayOps, actions: Any, mean: Any, log_std: Any, low: float = -1.0, high: float = 1.0
) -> Any:
    """Log-density of a Gaussian truncated to ``[low, high]^d``, summed over the last axis.

    ``log N(a; m, s) - log(Phi((high - m)/s) - Phi((low - m)/s))`` per dimension.
    """
    std = ops.exp(log_std)
    z = (actions - mean) / std
    log_pdf = -0.5 * z**2 - log_std - LOG_SQRT_2PI
    return (log_pdf - log_box_mass(ops, (low - mean) / std, (high - mean) / std)).sum(-1)


def log_box_mass(ops: ArrayOps, lower: Any, upper: Any) -> Any:
    """``log(Phi(upper) - Phi(lower))``, exact also when the box lies far in one tail.

    With the mean inside the box the plain difference is well conditioned. With the box wholly
    on one side (a noise centre outside it) the difference cancels to zero in floating point,
    so it is taken in log space on the lower tail, mirroring a box above the mean.
    """
    central = ops.log(ops.clamp(ops.ndtr(upper) - ops.ndtr(lower), 1e-12, None))
    in_tail = (upper <= 0) | (lower >= 0)
    if not ops.any(in_tail):
        return central
    mirrored = lower > 0
    a = ops.where(mirrored, -upper, lower)
    b = ops.where(mirrored, -lower, upper)
    log_a, log_b = ops.log_ndtr(a), ops.log_ndtr(b)
    tail = log_b + ops.log1p(-ops.exp(ops.clamp(log_a - log_b, None, 0.0)))
    return ops.where(in_tail, tail, central)
